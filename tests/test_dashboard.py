"""`ralph-mail top`: the dashboard, driven with Textual's Pilot; snapshots of its main
screens as text (times masked), compared with the ones kept in tests/snapshots."""

from __future__ import annotations

import asyncio
import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from conftest import BOUND_S, cli_env, ralph
from rich.console import Console
from textual.pilot import Pilot

from ralph_mail import MessageBus, create_team
from ralph_mail.dashboard import Dashboard, Help, fold

SNAPSHOTS = Path(__file__).with_name("snapshots")


def screen_text(app: Dashboard) -> str:
    """What the screen shows, as plain text."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens))  # fmt: skip
    return console.export_text()


def studio(home: Path) -> None:
    """A small team with a channel, a task and both kinds of messages."""
    create_team("studio", ["lead", ("writer", "drafts posts"), "analyst"], home=home)
    lead, writer = MessageBus("studio", "lead", home), MessageBus("studio", "writer", home)
    writer.set_presence("working")
    lead.channels.create("standup", ["writer"])
    lead.send("writer", "text", "draft the Q4 post", visibility="user_visible")
    writer.send("lead", "text", "which numbers?")
    writer.send("lead", "text", "found them")
    writer.send("lead", "text", "the post is up", visibility="user_visible")
    lead.delegate("writer", "Write the Q4 post", id="T-1")
    lead.close()
    writer.close()


def drive(
    home: Path, size: tuple[int, int], body: Callable[[Dashboard, Pilot[None]], Awaitable[None]]
) -> None:
    async def main() -> None:
        app = Dashboard("studio", str(home))
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await body(app, pilot)

    asyncio.run(main())


async def until(pilot: Pilot[None], app: Dashboard, seen: str) -> str:
    """Pause until the screen shows ``seen`` (BOUND_S at most); the screen."""
    deadline = time.monotonic() + BOUND_S
    while seen not in (shown := screen_text(app)):
        assert time.monotonic() < deadline, f"never showed {seen!r}:\n{shown}"
        await pilot.pause(0.02)
    return shown


def test_internal_messages_fold_between_user_visible_ones() -> None:
    """Runs of internal messages fold into their count; with internal, all show."""
    from ralph_mail.message import Message

    def message(n: int, visibility: str) -> Message:
        return Message(f"{n:012x}", "a", "b", "text", str(n), {}, "", None, "normal", False,
                       visibility, ())  # type: ignore[arg-type]  # fmt: skip

    messages = [message(0, "user_visible"), message(1, "internal"), message(2, "internal"),
                message(3, "user_redacted"), message(4, "internal")]  # fmt: skip
    assert [x if isinstance(x, int) else x.content for x in fold(messages, False)] == [
        "0", 2, "3", 1]  # fmt: skip
    assert fold(messages, True) == messages


def test_keys_open_toggle_search_and_help(home: Path) -> None:
    """enter opens the selected row; i unfolds; tab moves focus; / searches; ? helps; q
    quits."""
    studio(home)

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        shown = await until(pilot, app, "inbox of lead")
        assert "Internal agent messages (2)" in shown and "the post is up" in shown
        assert "which numbers?" not in shown
        await pilot.press("i")
        assert "which numbers?" in await until(pilot, app, "i: fold")
        await pilot.press("down", "enter")  # the writer's row
        await until(pilot, app, "inbox of writer")
        await pilot.press("down", "down", "down", "enter")  # the channel
        await until(pilot, app, "#standup  (")
        focused = app.focused
        await pilot.press("tab")
        assert app.focused is not focused and app.focused is not None
        await pilot.press("enter")  # the task: its thread
        await until(pilot, app, "task thread T-1")
        await pilot.press("slash")
        await pilot.press(*"numbers", "enter")
        assert "which numbers?" in await until(pilot, app, "search: numbers")
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, Help) and "/        search" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, Help)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running

    drive(home, (100, 30), body)


def test_it_follows_a_send_from_another_process_and_moves_no_cursor(home: Path) -> None:
    """A message sent by another process shows without a key pressed; the roster's
    unread count goes up; no cursor file changes while the dashboard runs."""
    studio(home)
    cursors = home / "teams" / "studio" / "cursors"
    before = {p.name: p.read_bytes() for p in cursors.iterdir()}

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        await until(pilot, app, "inbox of lead")
        done = await asyncio.to_thread(ralph, home, "send", "lead", "live from outside",
                                       "--visibility", "user_visible", "--team", "studio",
                                       "--agent", "analyst")  # fmt: skip
        assert done.returncode == 0, done.stderr
        shown = await until(pilot, app, "live from outside")
        assert re.search(r"lead\s+\S+\s+0s\s+4\s", shown), shown  # 3 unread before, 4 now

    drive(home, (120, 30), body)
    assert {p.name: p.read_bytes() for p in cursors.iterdir()} == before


def masked(text: str) -> str:
    """The screen with what changes from run to run masked: digits, and the status line
    after the team's name (the home, a temporary path of varying length)."""
    return re.sub(r"(?m)^( studio · ).*$", r"\1HOME", re.sub(r"\d", "9", text))


def test_snapshots_of_the_main_screen(home: Path) -> None:
    """The main screen at 80x24 and 140x40 as tests/snapshots keep it (times, ids and
    the home masked). RALPH_UPDATE_SNAPSHOTS=1 writes them again."""
    studio(home)
    for width, height in ((80, 24), (140, 40)):
        kept = SNAPSHOTS / f"top_{width}x{height}.txt"

        async def body(app: Dashboard, pilot: Pilot[None], kept: Path = kept) -> None:
            shown = await until(pilot, app, "inbox of lead")
            text = masked(shown)
            if os.environ.get("RALPH_UPDATE_SNAPSHOTS"):
                SNAPSHOTS.mkdir(exist_ok=True)
                kept.write_text(text)
            assert text == kept.read_text(), f"{kept} differs:\n{text}"

        drive(home, (width, height), body)


def test_without_the_tui_extra_one_line_says_how_to_install(home: Path, tmp_path: Path) -> None:
    """A Python without Textual: one line naming the extra, exit 2."""
    create_team("studio", ["lead"], home=home)
    hidden = tmp_path / "hide"
    (hidden / "textual").mkdir(parents=True)
    (hidden / "textual" / "__init__.py").write_text("raise ImportError('no textual here')\n")
    env = cli_env(home, PYTHONPATH=str(hidden))
    done = subprocess.run([sys.executable, "-m", "ralph_mail", "top", "--team", "studio"],
                          env=env, capture_output=True, timeout=BOUND_S)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count(b"\n") == 1, done.stderr
    assert b"pip install 'ralph_mail[tui]'" in done.stderr


def test_the_readme_screenshot_is_made_by_its_script(tmp_path: Path) -> None:
    """docs/screenshot.py (which made docs/top.svg) still runs, in a home of its own."""
    script = Path(__file__).resolve().parent.parent / "docs" / "screenshot.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          timeout=BOUND_S, env=cli_env(tmp_path / "unused"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert b"T-1.1 Check the Q4 numbers" in done.stdout
    assert (tmp_path / "top.svg").read_text().startswith("<svg")


def test_a_roster_change_shows_without_a_restart(home: Path) -> None:
    """A member's new description (team set, from anywhere) shows within the second."""
    from ralph_mail.team import update_team

    studio(home)

    async def body(app: Dashboard, pilot: Pilot[None]) -> None:
        await until(pilot, app, "drafts posts")
        await asyncio.to_thread(update_team, "studio", home, member="analyst",
                                description="reads the numbers")  # fmt: skip
        await until(pilot, app, "reads the numbers")

    drive(home, (120, 30), body)
