"""Budgets (``policy budget AGENT AMOUNT --per hour|day``): once an agent's jobs spent
it, the Gate refuses the contact it starts (BudgetExceeded, exit 4) on every face,
``ralph-mail run`` answers new requests with the error without running its command, and
the lead gets one ``budget_exceeded`` message. A runaway loop of two scripted "model"
agents stops there."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio
import orjson
import pytest
from mcp import Client

from ralph_mail import (
    BudgetExceeded,
    Event,
    EventKind,
    MailError,
    MessageBus,
    MessageType,
    RateLimited,
    Team,
    TeamOrchestrator,
    usage,
)
from ralph_mail.govern.budget import exhausted
from ralph_mail.govern.policy import Budget
from ralph_mail.mcp_server import build
from ralph_mail.message import format_ts
from tests.helpers.processes import BOUND_S, Processes, ralph, runner

LEAD = ("--team", "demo", "--agent", "lead")


def spend(team: Team, agent: str, *costs: float) -> None:
    """Record jobs of ``agent`` costing ``costs``, now, as `ralph-mail run` would."""
    for cost in costs:
        entry = usage.Record(usage.now_ts(), agent, usage.Usage(cost_usd=cost), "ask")
        usage.record(team.store, entry)


def budget(team: Team, agent: str, amount: str, per: str = "hour") -> None:
    done = ralph(team.home, "policy", "budget", agent, amount, "--per", per, *LEAD)
    assert done.returncode == 0, done.stderr


def told(team: Team) -> list[object]:
    """The budget_exceeded messages in the lead's inbox (read without consuming)."""
    lead = MessageBus("demo", "lead", team.home)
    try:
        return [m for m in lead.peek() if m.type == "budget_exceeded"]
    finally:
        lead.close()


def test_the_lead_sets_shows_and_removes_budgets(team: Team) -> None:
    """'policy budget' saves {usd, per}; 'policy show' lists it; 'off' removes it; a
    bad amount or window is exit 2, anyone but the lead exit 4, changing nothing."""
    budget(team, "worker-1", "$0.50", "hour")
    budget(team, "*", "20", "day")
    saved = orjson.loads(ralph(team.home, "policy", "show", "--json", "--team", "demo").stdout)
    assert saved["budgets"] == {"*": {"usd": 20.0, "per": "day"},
                                "worker-1": {"usd": 0.5, "per": "hour"}}  # fmt: skip
    shown = ralph(team.home, "policy", "show", "--team", "demo").stdout.decode()
    assert "worker-1\t$0.5\thour\n" in shown
    for args, code, says in (
        (("worker-1", "lots"), 2, "invalid budget 'lots'"),
        (("worker-1", "0"), 2, "invalid budget 0.0"),
        (("worker-1", "nan"), 2, "invalid budget 'nan'"),
        (("worker-1", "5", "--per", "week"), 2, "invalid --per 'week': hour or day"),
    ):  # fmt: skip
        bad = ralph(team.home, "policy", "budget", *args, *LEAD)
        assert (bad.returncode, bad.stderr.count(b"\n")) == (code, 1), bad.stderr
        assert says in bad.stderr.decode()
    other = ralph(team.home, "policy", "budget", "worker-1", "9", "--team", "demo",
                  "--agent", "worker-2")  # fmt: skip
    assert other.returncode == 4
    budget(team, "worker-1", "off")
    saved = orjson.loads(ralph(team.home, "policy", "show", "--json", "--team", "demo").stdout)
    assert saved["budgets"] == {"*": {"usd": 20.0, "per": "day"}}


def test_the_spend_window_rolls_and_says_when_it_frees(team: Team) -> None:
    """Spend counts within the rolling window, to the minute; the budget frees when
    enough of it has left the window."""
    hour = Budget(0.05, "hour")
    t0 = 1_800_000_000.0  # a minute boundary
    for minute, cost in ((0, 0.02), (10, 0.02), (20, 0.01)):
        when = format_ts(int((t0 + minute * 60) * 1e6))
        usage.record(team.store, usage.Record(when, "worker-1", usage.Usage(cost_usd=cost)))
    assert exhausted(team.store, "worker-1", hour, t0 + 20 * 60) == (
        50_000, format_ts(int((t0 + 3600) * 1e6))[:19] + "Z")  # fmt: skip
    assert exhausted(team.store, "worker-1", hour, t0 + 3600) is None  # the first left
    assert exhausted(team.store, "worker-1", Budget(0.06, "hour"), t0 + 20 * 60) is None


def test_over_budget_contact_is_refused_everywhere_and_the_lead_is_told_once(
    team: Team,
) -> None:
    """Over budget: the library raises BudgetExceeded (a MailError, "budget exhausted
    until ..."), the CLI exits 4 with that one line, an answer still goes out, and the
    lead gets one budget_exceeded message however often contact is refused."""
    budget(team, "worker-1", "0.05")
    spend(team, "worker-1", 0.03)
    worker = MessageBus("demo", "worker-1", team.home)
    worker.send("lead", MessageType.TEXT, "still under")
    assert told(team) == []
    spend(team, "worker-1", 0.02)
    with pytest.raises(BudgetExceeded, match=r"^budget exhausted until \d{4}-.*Z: worker-1 "
                       r"spent \$0.05 of its \$0.05 per hour") as refused:  # fmt: skip
        worker.send("worker-2", MessageType.TEXT, "more")
    assert isinstance(refused.value, MailError) and refused.value.agent == "worker-1"
    for args in (("send", "lead", "hi"), ("broadcast", "all"), ("ask", "lead", "q?")):
        done = ralph(team.home, *args, "--team", "demo", "--agent", "worker-1")
        assert done.returncode == 4 and done.stderr.count(b"\n") == 1, done.stderr
        assert done.stderr.startswith(b"ralph-mail: error: budget exhausted until ")
    lead = MessageBus("demo", "lead", team.home)
    question = lead.send("worker-1", MessageType.REQUEST, "are you there?")
    worker.reply(question, "yes, but out of budget")  # an answer is not contact
    (message,) = told(team)
    assert message.from_agent == "worker-1" and message.to_agent == "lead"  # type: ignore[attr-defined]
    assert message.metadata["spent_usd"] == "0.05" and message.metadata["per"] == "hour"  # type: ignore[attr-defined]
    events: list[Event] = []
    orchestrator = TeamOrchestrator("demo", home=team.home, on_event=events.append)
    assert orchestrator.run(until=lambda o: len(events) == 3, timeout=BOUND_S)
    (event,) = [e for e in events if e.kind == EventKind.BUDGET_EXCEEDED]
    assert event.agent == "worker-1" and "spent $0.05 of its $0.05 per hour" in event.text
    orchestrator.bus.close()
    worker.close()
    lead.close()


def test_a_budget_is_checked_before_the_rate_counts(team: Team) -> None:
    """A refused message costs no rate: with a budget spent and a rate of 1, the refusal
    is the budget's, and once the budget is raised the one message goes out."""
    budget(team, "worker-1", "0.01")
    assert ralph(team.home, "policy", "rate", "worker-1", "1", *LEAD).returncode == 0
    spend(team, "worker-1", 0.01)
    worker = MessageBus("demo", "worker-1", team.home)
    for _ in range(3):
        with pytest.raises(BudgetExceeded):
            worker.send("lead", MessageType.TEXT, "x")
    budget(team, "worker-1", "1")
    worker.send("lead", MessageType.TEXT, "within budget and rate")
    with pytest.raises(RateLimited):
        worker.send("lead", MessageType.TEXT, "over the rate")
    worker.close()


def test_mcp_refuses_contact_over_budget_in_one_line(team: Team) -> None:
    """Through the MCP server, contact an agent over budget starts is a tool error whose
    text is the one-line refusal."""
    budget(team, "worker-1", "0.01", "day")
    spend(team, "worker-1", 0.02)
    lead = MessageBus("demo", "lead", team.home)
    lead.channels.create("ops", ["lead", "worker-1"])
    lead.close()

    async def main() -> None:
        server, box = build("demo", "worker-1", team.home)
        box.start()
        try:
            async with Client(server) as client:
                for tool, arguments in (
                    ("send_to_agent", {"target_agent": "lead", "message": "hi"}),
                    ("contact_agent", {"action": "notify", "agentId": "worker-2",
                                       "message": "fyi"}),
                    ("post_to_channel", {"channel": "ops", "content": "@lead look"}),
                ):  # fmt: skip
                    result = await client.call_tool(tool, arguments)
                    assert result.is_error
                    (block,) = result.content
                    said = block.text  # type: ignore[union-attr]
                    assert said.startswith("budget exhausted until ") and "\n" not in said
        finally:
            box.close()

    anyio.run(main)


def test_run_answers_with_the_error_without_running_over_budget(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """An agent over budget: its runner answers an ask with an error reply "budget
    exhausted until ..." and a delegation with a failed task; the command never runs."""
    budget(team, "worker-1", "0.01")
    spend(team, "worker-1", 0.01)
    ran = tmp_path / "ran"
    runner(procs, team.home, "worker-1", f'touch "{ran}"; echo hi')
    asked = ralph(team.home, "ask", "worker-1", "anything?", "--json", *LEAD)
    assert asked.returncode == 3, asked.stderr
    reply = orjson.loads(asked.stdout)
    assert reply["metadata"]["error"].startswith("budget exhausted until ")
    done = ralph(team.home, "delegate", "worker-1", "work", "--wait", str(BOUND_S), *LEAD)
    assert done.returncode == 3 and done.stdout.startswith(b"budget exhausted until ")
    assert not ran.exists()


#: A scripted model that keeps a loop going: each run delegates to $OTHER (through the
#: CLI, as its agent), then answers as `claude -p --output-format json` does, $0.01 a run.
LOOPING = """\
import json, os, subprocess, sys
sys.stdin.read()
subprocess.run([sys.executable, "-m", "ralph_mail", "delegate", os.environ["OTHER"],
                "keep going"], capture_output=True, timeout=60)
print(json.dumps({"type": "result", "is_error": False, "result": "passed it on",
                  "total_cost_usd": 0.01, "usage": {"input_tokens": 900,
                  "output_tokens": 40}}))
"""


def test_a_runaway_loop_of_two_agents_stops_at_the_budget(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """worker-1 and worker-2 delegate to each other forever, $0.01 a run; worker-1's
    budget of $0.05 an hour stops the loop after its fifth run: its sixth task fails
    with "budget exhausted until", nothing more runs, and the lead is told once."""
    script = tmp_path / "looping.py"
    script.write_text(LOOPING)
    budget(team, "worker-1", "0.05", "hour")
    for agent, other in (("worker-1", "worker-2"), ("worker-2", "worker-1")):
        runner(procs, team.home, agent, f"OTHER={other} exec {sys.executable} {script}")
    assert ralph(team.home, "delegate", "worker-1", "start", *LEAD).returncode == 0
    worker2 = MessageBus("demo", "worker-2", team.home)  # (its runner consumes; this reads)
    deadline = time.monotonic() + BOUND_S
    stopped: list[object] = []
    while not stopped or len(usage.load(team.store)) < 10:  # worker-2's 5th run ends last
        assert time.monotonic() < deadline, "the loop did not stop"
        found = worker2.search(type="task_result", limit=5)
        stopped = [m for m in found if m.from_agent == "worker-1"
                   and m.content.startswith("budget exhausted until ")]  # fmt: skip
        time.sleep(0.05)
    worker2.close()
    by_agent = {t.key: t for t in usage.rollup(usage.load(team.store))}
    assert (by_agent["worker-1"].jobs, by_agent["worker-1"].micro_usd) == (5, 50_000)
    assert by_agent["worker-2"].jobs == 5
    assert len(told(team)) == 1
    report = ralph(team.home, "usage", "--team", "demo").stdout.decode().splitlines()
    assert sorted(report) == ["worker-1\t5\t4500\t200\t$0.05", "worker-2\t5\t4500\t200\t$0.05"]


def test_an_answer_to_a_request_its_asker_has_not_indexed_yet_is_still_an_answer(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asker indexes its request just after appending it; a reply sent in between (a
    runner is that quick) answers a request in the replier's inbox, so it is not contact
    and an agent over its budget still sends it."""
    budget(team, "worker-1", "0.01")
    spend(team, "worker-1", 0.01)
    lead = MessageBus("demo", "lead", team.home)
    with monkeypatch.context() as late:  # the asker has appended, not yet indexed
        late.setattr(type(lead), "_index", lambda *args: None)
        question = lead.send("worker-1", MessageType.REQUEST, "still there?")
    worker = MessageBus("demo", "worker-1", team.home)
    (received,) = worker.poll()
    answer = worker.reply(received, "yes")
    assert answer.reply_to == question.id and answer.ts
    with pytest.raises(BudgetExceeded):
        worker.send("lead", MessageType.TEXT, "a note is contact")
    worker.close()
    lead.close()
