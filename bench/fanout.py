"""Fan-out and size: broadcast to 10 and 100 agents, and ``tail -n 20`` on a huge inbox.

A broadcast is compared with the same sender making one ``send`` per recipient, in
the same run: what a caller would do without ``broadcast``. ``tail`` on a 1,000,000
message inbox is compared with ``tail`` on a 1,000 message one: both time and peak
memory must not grow with the inbox, because tail has to read from the end.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Final

from bench.cli import executable, peak_rss_mib, run_cmd
from bench.common import Row, Section, Sizes, Workspace, child_env, interleave, ralph
from bench.send import guarded

#: Messages in the small inbox that ``tail`` on the big one is compared with.
SMALL_INBOX: Final = 1_000
TAIL_N: Final = 20


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Measure broadcast against per-recipient sends, then tail on a small and a big inbox."""
    sec = Section("fanout", "Fan-out (ms per broadcast) and tail on a big inbox (ms)")
    rm = ralph()
    status = rm if isinstance(rm, str) else "ok"
    cases: list[Callable[[], None]] = []
    buses = []
    try:
        for n in sizes.fanout_sizes:
            loop = sec.add(
                Row(
                    f"sends_{n}",
                    f"{n} separate sends (one per recipient)",
                    "ms",
                    "lower",
                    status=status,
                )
            )
            bcast = sec.add(
                Row(
                    f"broadcast_{n}",
                    f"ralph_mail broadcast to {n} agents",
                    "ms",
                    "lower",
                    anchor=loop.key,
                    status=status,
                )
            )
            if status != "ok":
                continue
            assert not isinstance(rm, str)
            home = ws.fresh(f"fanout{n}")
            names = [f"a{i}" for i in range(n)]
            rm.create_team("fan", ["s", *names], home=home)
            bus = rm.MessageBus("fan", "s", home=home)
            buses.append(bus)
            text = rm.MessageType.TEXT

            def broadcasts(bus: object = bus) -> float:
                t0 = time.perf_counter()
                for _ in range(sizes.fanout_n):
                    bus.broadcast("tests are green")  # type: ignore[attr-defined]
                return (time.perf_counter() - t0) / sizes.fanout_n * 1e3

            def sends(bus: object = bus, names: list[str] = names, text: object = text) -> float:
                t0 = time.perf_counter()
                for _ in range(sizes.fanout_n):
                    for name in names:
                        bus.send(name, text, "tests are green")  # type: ignore[attr-defined]
                return (time.perf_counter() - t0) / sizes.fanout_n * 1e3

            cases += [guarded(loop, sends), guarded(bcast, broadcasts)]
        interleave(sizes.reps, cases)
    finally:
        for bus in buses:
            bus.close()
    _tail(sec, sizes, ws, status)
    return sec


def _tail(sec: Section, sizes: Sizes, ws: Workspace, status: str) -> None:
    """``ralph-mail tail -n 20`` on a small and a big inbox, plus coreutils for scale."""
    exe = executable()
    if status == "ok" and isinstance(exe, str):
        status = exe
    big = sizes.tail_backlog
    small_row = sec.add(
        Row(
            "tail_small",
            f"ralph-mail tail -n {TAIL_N}, {SMALL_INBOX:,} msgs",
            "ms",
            "lower",
            status=status,
            extra={"rss_mib": []},
        )
    )
    big_row = sec.add(
        Row(
            "tail_big",
            f"ralph-mail tail -n {TAIL_N}, {big:,} msgs",
            "ms",
            "lower",
            anchor=small_row.key,
            status=status,
            extra={"rss_mib": []},
        )
    )
    gnu = shutil.which("tail")
    core_row = sec.add(
        Row(
            "coreutils_tail",
            f"coreutils tail -n {TAIL_N}, {big:,} msgs",
            "ms",
            "lower",
            status="ok" if gnu else "not installed: tail",
            extra={"rss_mib": []},
        )
    )
    cases: list[tuple[Row, list[str], dict[str, str]]] = []
    if status == "ok":
        rm = ralph()
        assert not isinstance(rm, str) and not isinstance(exe, str)
        for row, n in ((small_row, SMALL_INBOX), (big_row, big)):
            home = ws.fresh(f"tail{n}")
            rm.create_team("tl", ["reader", "sender"], home=home)
            ws.place_inbox(home / "teams/tl/mailbox/reader.jsonl", n)
            env = child_env({"RALPH_HOME": str(home), "RALPH_TEAM": "tl", "RALPH_AGENT": "sender"})
            cases.append((row, [str(exe), "tail", "reader", "-n", str(TAIL_N)], env))
    if gnu:
        cases.append((core_row, [gnu, "-n", str(TAIL_N), str(ws.inbox_file(big))], child_env()))
    sec.samples["tail_inbox_bytes"] = ws.inbox_file(big).stat().st_size
    for i in range(1 + sizes.tail_runs):  # the first round is a warm-up
        for row, argv, env in cases:
            if row.status != "ok":
                continue
            result = run_cmd(argv, env)
            if result.code != 0:
                row.status = f"failed: exit {result.code}: {result.stderr.strip()[-300:]}"
            elif i > 0:
                row.values.append(result.seconds * 1e3)
    scratch = ws.fresh("tail-rss")
    for row, argv, env in cases:
        if row.status == "ok":
            row.extra["rss_mib"].append(peak_rss_mib(argv, env, scratch))
