"""`ralph-mail top` on a big team: 100 agents and ``search_n`` messages (1,000,000 in the
full run) spread over their inboxes, all unread.

* First paint: from making the app to its first screen with the conversation pane
  filled, against an empty Textual app with one table (the floor: Textual's own start).
* A send by another process to the message in the conversation pane (p50).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import ModuleType

from bench.common import Row, Section, Sizes, Workspace, child_env, optional_module, ralph

AGENTS = 100
#: Sends timed from another process to the screen.
SENDS = 30
#: The child that sends on each line of its stdin.
SENDER = """
import sys
from ralph_mail import MessageBus
bus = MessageBus("big", "a1", sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    bus.send("lead", "text", line.strip(), visibility="user_visible")
"""


def _team(rm: ModuleType, ws: Workspace, n: int) -> object:
    home = ws.fresh("dashboard")
    names = ["lead", *(f"a{i}" for i in range(1, AGENTS))]
    rm.create_team("big", names, home=home)
    for name in names:
        ws.place_inbox(home / "teams" / "big" / "mailbox" / f"{name}.jsonl", n // AGENTS)
    return home


def run(sizes: Sizes, ws: Workspace) -> Section:
    """First paint and send-to-screen on a 100-agent team."""
    n = sizes.search_n
    sec = Section("dashboard", f"ralph-mail top on {AGENTS} agents and {n:,} messages")
    floor = sec.add(Row("tui_floor", "an empty Textual app with one table: first paint",
                        "ms", "lower"))  # fmt: skip
    paint = sec.add(Row("tui_first_paint", f"top: first paint ({AGENTS} agents, {n:,} "
                        "messages)", "ms", "lower", anchor=floor.key))  # fmt: skip
    seen = sec.add(Row("tui_send_to_screen", "top: a send in another process to the "
                       "screen (p50)", "ms", "lower"))  # fmt: skip
    rm = ralph()
    missing = optional_module("textual")
    if isinstance(rm, str) or isinstance(missing, str):
        paint.status = seen.status = floor.status = str(rm if isinstance(rm, str) else missing)
        return sec
    from textual.app import App, ComposeResult
    from textual.widgets import DataTable, RichLog

    from ralph_mail.dashboard import Dashboard

    class Empty(App[None]):
        def compose(self) -> ComposeResult:
            yield DataTable()

    home = _team(rm, ws, n)

    async def first(make: type[App[None]] | None) -> float:
        t0 = time.perf_counter()
        app = make() if make is not None else Dashboard("big", str(home))
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause()
            return (time.perf_counter() - t0) * 1e3

    for _ in range(max(1, sizes.reps)):
        floor.values.append(asyncio.run(first(Empty)))
        paint.values.append(asyncio.run(first(None)))

    async def follow() -> None:
        sender = subprocess.Popen([sys.executable, "-c", SENDER, str(home)], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=child_env())  # fmt: skip
        assert sender.stdin is not None and sender.stdout is not None
        try:
            assert sender.stdout.readline().strip() == "ready"
            app = Dashboard("big", str(home))
            async with app.run_test(size=(140, 40)) as pilot:
                await pilot.pause()
                log = app.query_one("#conversation", RichLog)
                for i in range(SENDS):
                    mark = f"on screen {i}"
                    t0 = time.perf_counter()
                    sender.stdin.write(mark + "\n")
                    sender.stdin.flush()
                    deadline = t0 + 30
                    while not any(mark in line.text for line in log.lines[-4:]):
                        assert time.perf_counter() < deadline, "the send never showed"
                        await asyncio.sleep(0.0005)
                    seen.values.append((time.perf_counter() - t0) * 1e3)
        finally:
            sender.stdin.close()
            sender.wait(timeout=30)

    asyncio.run(follow())
    return sec
