"""Makes docs/top.svg, the README's screenshot of `ralph-mail top`: a small team mid-work,
in a temporary home.

    python docs/screenshot.py docs
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import sys
import tempfile

from rich.console import Console

os.environ["RALPH_HOME"] = tempfile.mkdtemp(prefix="ralph-shot-")  # never a real home
os.environ["RALPH_CHANNEL_DELAY"] = "0"

from ralph_mail import MessageBus, create_team
from ralph_mail.dashboard import Dashboard
from ralph_mail.orchestrator import TeamOrchestrator

create_team(
    "studio",
    [
        "lead",
        ("writer", "drafts posts"),
        ("analyst", "explains the numbers"),
        ("data", "knows the numbers"),
    ],
)
lead, w, a = (
    MessageBus("studio", "lead"),
    MessageBus("studio", "writer"),
    MessageBus("studio", "analyst"),
)
w.set_presence("working")
a.set_presence("idle")
lead.channels.create("standup", ["writer", "analyst", "data"])
orch = TeamOrchestrator("studio")
orch.bus.send("writer", "text", "Draft the Q4 update for the board", visibility="user_visible")
orch.bus.delegate("writer", "Write the Q4 update", id="T-1")
w.poll()
w.delegate("analyst", "Check the Q4 numbers", id="T-1.1", parent="T-1")
w.send(
    "lead",
    "status_update",
    "outline done, drafting",
    {"state": "working", "task": "T-1", "progress": "0.4"},
)
a.poll()
a.complete("T-1.1", "revenue 2.4M, up 14%")
w.send("lead", "text", "asked the analyst for the numbers")
w.send("lead", "text", "numbers in: 2.4M")
w.send("lead", "text", "Draft is up: Q4 revenue grew 14% to 2.4M", visibility="user_visible")
orch.handle_pending()
orch.close()


async def main():
    app = Dashboard("studio")
    async with app.run_test(size=(110, 28)) as pilot:
        await pilot.pause()
        if len(sys.argv) > 1:
            app.save_screenshot("top.svg", path=sys.argv[1])
        console = Console(width=110, height=28, file=io.StringIO(), record=True)
        console.print(
            app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
        )
        print(console.export_text())


asyncio.run(main())
shutil.rmtree(os.environ["RALPH_HOME"], ignore_errors=True)
