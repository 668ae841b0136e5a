"""An answer never kills its responder: a command's output that is under the message limit
raw but over it as a JSON line (quotes, backslashes and control characters are escaped on
the wire) is cut by its encoded size, with a note, for a reply, a task's result and a
channel answer alike; the runner goes on. Real runner processes, real children."""

from __future__ import annotations

import signal

import orjson
import pytest

from ralph_mail import Message, MessageBus, Team, settings
from ralph_mail.message import fit_text
from tests.helpers.processes import BOUND_S, Processes, ask, ralph, runner, wait_until

#: 1,040,000 quotes: under the 1 MiB limit raw, about 2 MiB as a JSON string.
QUOTES = "head -c 1040000 /dev/zero | tr '\\0' '\"'"
#: The child answers the next request in a few bytes (after the flood, for the same run).
SHORT = "echo short"


def _line_of(team: Team, inbox: str, kind: str) -> bytes:
    """The last line of ``kind`` in ``inbox``, as stored."""
    lines = (team.home / "teams/demo/mailbox" / f"{inbox}.jsonl").read_bytes().splitlines()
    return [line for line in lines if orjson.loads(line)["type"] == kind][-1]


def _flood_then_short(tmp: str) -> str:
    """A script that floods with quotes the first time it runs, then answers shortly."""
    return f"cat >/dev/null; if [ -e {tmp} ]; then {SHORT}; else touch {tmp}; {QUOTES}; fi"


def test_a_reply_over_the_limit_once_encoded_is_cut_and_the_runner_goes_on(
    team: Team, procs: Processes, tmp_path: object
) -> None:
    """A reply of 1,040,000 quotes is cut to fit the limit as a line, with a note; the
    asker gets it (exit 0), the stored line is within the limit, and the runner answers
    the next ask."""
    child = runner(procs, team.home, "worker-1", _flood_then_short(f"{tmp_path}/ran"))
    done = ask(team.home, "worker-1", "quote me")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(b'""""') and b"[output cut at " in done.stdout
    assert len(_line_of(team, "lead", "reply")) <= settings.max_message_bytes()
    again = ask(team.home, "worker-1", "still there?")
    assert again.returncode == 0 and again.stdout == b"short\n", again.stderr
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=BOUND_S) == 0


def test_a_task_result_over_the_limit_once_encoded_is_cut(
    team: Team, procs: Processes, tmp_path: object
) -> None:
    """A delegation answered with 1,040,000 quotes completes with the result cut to fit,
    and the runner takes the next task."""
    child = runner(procs, team.home, "worker-1", _flood_then_short(f"{tmp_path}/ran"))
    done = ralph(team.home, "delegate", "worker-1", "quote everything", "--wait", "30",
                 "--team", "demo", "--agent", "lead")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(b'""""') and b"[output cut at " in done.stdout
    assert len(_line_of(team, "lead", "task_result")) <= settings.max_message_bytes()
    again = ralph(team.home, "delegate", "worker-1", "and now?", "--wait", "30",
                  "--team", "demo", "--agent", "lead")  # fmt: skip
    assert again.returncode == 0 and again.stdout == b"short\n", again.stderr
    assert child.poll() is None


def test_a_channel_answer_over_the_limit_once_encoded_is_cut(
    team: Team, procs: Processes, tmp_path: object
) -> None:
    """A mention answered with 1,040,000 quotes is posted cut to fit; the runner answers
    the next ask."""
    child = runner(procs, team.home, "worker-1", _flood_then_short(f"{tmp_path}/ran"))
    with MessageBus("demo", "lead", team.home) as lead:
        lead.channels.create("quotes", ["worker-1"])
        lead.channel_post("quotes", "@worker-1 quote it all")
        again = ask(team.home, "worker-1", "still there?")
        assert again.returncode == 0 and again.stdout == b"short\n", again.stderr

        def posted() -> list[Message]:  # (the runner runs both at once: either ends first)
            return [m for m in lead.channel_history("quotes") if m.from_agent == "worker-1"]

        wait_until(posted, "the mention's answer in the channel")
        posts = posted()
    assert len(posts) == 1 and posts[0].content.startswith('""""')
    assert "[output cut at " in posts[0].content
    assert child.poll() is None


@pytest.mark.parametrize("char", ['"', "\\", "\x01", "é", "a"])
def test_fit_text_keeps_the_longest_start_that_fits_encoded(char: str) -> None:
    """fit_text cuts by the JSON-encoded size: the start it keeps fits, one more
    character would not."""
    text = char * 1000
    kept = fit_text(text, 777)
    assert len(orjson.dumps(kept)) - 2 <= 777
    assert len(orjson.dumps(text[: len(kept) + 1])) - 2 > 777
    assert fit_text("short", 777) == "short"
