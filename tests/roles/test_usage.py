"""What agents cost: `ralph-mail run` records what each job reports (Claude Code's JSON
output, or $RALPH_USAGE_FILE) in the answer's metadata and the team's usage log;
`ralph-mail usage`, `tasks` and the library roll it up. Runs use a scripted "model": a
small Python program that prints what `claude -p --output-format json` prints."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, Team, usage
from tests.helpers.processes import BOUND_S, Processes, ralph, runner

#: A stand-in for `claude -p --output-format json`: the answer in ``result``, what it
#: cost in ``total_cost_usd`` ($COST, default 0.01) and ``usage``; ``is_error`` with
#: $FAIL set.
MODEL = """\
import json, os, sys
prompt = sys.stdin.read()
fail = bool(os.environ.get("FAIL"))
print(json.dumps({
    "type": "result", "subtype": "error_during_execution" if fail else "success",
    "is_error": fail, "duration_ms": 812, "num_turns": 1,
    "result": "answered: " + prompt.strip().splitlines()[-1],
    "session_id": "7f9c", "total_cost_usd": float(os.environ.get("COST", "0.01")),
    "usage": {"input_tokens": 1200, "cache_creation_input_tokens": 0,
              "cache_read_input_tokens": 300, "output_tokens": 80}}))
"""


def model(tmp_path: Path, **env: str) -> str:
    """The script that runs `MODEL` with ``env`` set (for `runner`)."""
    script = tmp_path / "model.py"
    script.write_text(MODEL)
    settings = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
    return f"{settings} exec {shlex.quote(sys.executable)} {shlex.quote(str(script))}"


def lead_cli(home: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return ralph(home, *args, "--team", "demo", "--agent", "lead")


def test_claude_json_is_read_for_its_answer_cost_and_tokens() -> None:
    """Claude Code's result object gives the answer (``result``), the cost and the
    tokens; ``is_error`` makes it an error; anything else is not Claude's JSON."""
    line = orjson.dumps({"type": "result", "is_error": False, "result": "42",
                         "total_cost_usd": 0.0123, "usage": {"input_tokens": 10,
                         "output_tokens": 2, "cache_read_input_tokens": 5}}).decode()  # fmt: skip
    found = usage.from_claude(line + "\n")
    assert found == usage.Reported(usage.Usage(10, 2, 5, 0, 0.0123), "42")
    failed = usage.from_claude('{"type": "result", "is_error": true, "result": "",'
                               ' "subtype": "error_max_turns"}')  # fmt: skip
    assert failed is not None and failed.error == "claude stopped: error_max_turns"
    others = ("42", '{"result": "no type"}', '[{"type": "result"}]', '{"type": "result"',
              '{"type": "result", "result": "x", "total_cost_usd": -1}')  # fmt: skip
    for other in others:
        assert usage.from_claude(other) is None, other


def test_a_usage_report_is_checked_and_named_when_wrong(tmp_path: Path) -> None:
    """A usage file holds {input_tokens, output_tokens, cost_usd}; an empty one says
    nothing; one that is not a report raises naming the problem."""
    path = tmp_path / "usage.json"
    path.write_text("")
    assert usage.read_report(path) is None
    path.write_text('{"input_tokens": 5, "output_tokens": 7, "cost_usd": 0.5}')
    assert usage.read_report(path) == usage.Usage(5, 7, cost_usd=0.5)
    for bad, says in (("nope", "not JSON"), ("[1]", "not a JSON object"),
                      ('{"cost_usd": -1}', "cost_usd -1"),
                      ('{"input_tokens": 1.5}', "input_tokens 1.5"),
                      ('{"output_tokens": true}', "output_tokens True")):  # fmt: skip
        path.write_text(bad)
        with pytest.raises(ValueError, match=says):
            usage.read_report(path)


def test_costs_add_up_exactly_and_over_subtrees() -> None:
    """Five jobs of $0.01 make $0.05 exactly (sums in millionths); a subtree's cost
    counts each cost once, even when parents name each other."""
    records = [usage.Record("2026-01-01T00:00:00.000000Z", "a", usage.Usage(cost_usd=0.01),
                            task="t")] * 5  # fmt: skip
    (total,) = usage.rollup(records)
    assert total.micro_usd == 50_000 and total.jobs == 5
    tangled = usage.subtree_costs({"x": 1, "y": 2}, {"x": "y", "y": "x"})
    assert tangled == {"x": 3, "y": 3}


def test_a_claude_run_answers_with_its_result_and_records_what_it_cost(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """An ask answered by the scripted model: the reply is its ``result``, with the cost
    and tokens in the metadata; the usage log has the job; 'usage' sums it by agent."""
    runner(procs, team.home, "worker-1", model(tmp_path, COST="0.0125"))
    asked = lead_cli(team.home, "ask", "worker-1", "what is 6x7?", "--json")
    assert asked.returncode == 0, asked.stderr
    reply = orjson.loads(asked.stdout)
    assert reply["content"] == "answered: what is 6x7?"
    assert reply["metadata"] == {"cost_usd": "0.0125", "input_tokens": "1200",
                                 "output_tokens": "80"}  # fmt: skip
    (entry,) = usage.load(team.store)
    assert (entry.agent, entry.pattern, entry.requester, entry.task) == (
        "worker-1", "ask", "lead", None)  # fmt: skip
    assert entry.usage == usage.Usage(1200, 80, 300, 0, 0.0125)
    report = ralph(team.home, "usage", "--team", "demo", "--json")
    assert orjson.loads(report.stdout) == {"agent": "worker-1", "jobs": 1, "input_tokens": 1200,
                                           "output_tokens": 80, "cost_usd": 0.0125}  # fmt: skip


def test_a_failed_claude_run_is_a_failed_task_and_still_costs(
    team: Team, procs: Processes, tmp_path: Path
) -> None:
    """``is_error`` fails the task with Claude's text; what the run cost is recorded
    and travels with the failure."""
    runner(procs, team.home, "worker-1", model(tmp_path, FAIL="1"))
    done = lead_cli(team.home, "delegate", "worker-1", "do it", "--wait", str(BOUND_S))
    assert (done.returncode, done.stdout) == (3, b"answered: do it\n"), done.stderr
    lead = MessageBus("demo", "lead", team.home)
    (result,) = lead.search(type="task_result", limit=1)  # (the wait consumed it)
    assert result.metadata["status"] == "failed" and result.metadata["cost_usd"] == "0.01"
    lead.close()
    assert [r.pattern for r in usage.load(team.store)] == ["delegate"]


def test_any_command_reports_through_the_usage_file_and_tasks_show_subtree_costs(
    team: Team, procs: Processes
) -> None:
    """A shell command writes its figures to $RALPH_USAGE_FILE: each task's result
    carries them; 'tasks' shows what each subtree cost, 'usage --by task' each task's
    jobs and subtree, and --since leaves older jobs out."""
    script = ('printf \'{"input_tokens": 100, "output_tokens": 10, "cost_usd": 0.25}\' '
              '> "$RALPH_USAGE_FILE"; echo done')  # fmt: skip
    runner(procs, team.home, "worker-1", script)
    for part, where in (("plan", ("--id", "T-1")), ("draft", ("--parent", "T-1")),
                        ("check", ("--parent", "T-1"))):  # fmt: skip
        done = lead_cli(team.home, "delegate", "worker-1", part, *where, "--wait", str(BOUND_S))
        assert done.stdout == b"done\n", done.stderr
    lead = MessageBus("demo", "lead", team.home)
    results = lead.search(type="task_result")
    assert len(results) == 3 and {m.metadata["cost_usd"] for m in results} == {"0.25"}
    lead.close()
    tree = lead_cli(team.home, "tasks").stdout.decode().splitlines()
    assert re.match(r"T-1  plan +worker-1  completed  \$0\.75  ", tree[0]), tree
    assert all(re.search(r"  completed  \$0\.25  ", line) for line in tree[1:]), tree
    by_task = ralph(team.home, "usage", "--by", "task", "--team", "demo", "--json")
    rows = [orjson.loads(line) for line in by_task.stdout.splitlines()]
    parent = next(row for row in rows if row["task"] == "T-1")
    assert (parent["jobs"], parent["cost_usd"], parent["subtree_cost_usd"]) == (1, 0.25, 0.75)
    assert ralph(team.home, "usage", "--since", "2999-01-01T00:00Z", "--team", "demo").stdout == b""


def test_a_usage_file_that_is_not_a_report_is_said_and_the_job_still_answered(
    team: Team, procs: Processes
) -> None:
    """A command that writes something else to $RALPH_USAGE_FILE gets its answer sent;
    the runner says in one line that its cost was not recorded."""
    child = runner(procs, team.home, "worker-1", 'echo "lots" > "$RALPH_USAGE_FILE"; echo fine')
    asked = lead_cli(team.home, "ask", "worker-1", "how much?")
    assert asked.stdout == b"fine\n"
    assert child.stderr is not None
    said = b""
    while b"not a usage report" not in said:
        said += child.stderr.readline()
    assert b"(it is not JSON): its cost is not recorded" in said
    assert usage.load(team.store) == []


def test_usage_refuses_a_bad_option_and_prints_nothing_without_records(team: Team) -> None:
    """--by other than agent or task, or a bad --since: exit 2 in one line; nothing
    recorded: no output, exit 0."""
    empty = ralph(team.home, "usage", "--team", "demo")
    assert (empty.returncode, empty.stdout, empty.stderr) == (0, b"", b"")
    for args, says in ((("--by", "model"),  b"invalid --by 'model': agent or task"),
                       (("--since", "soon"), b"--since: invalid time 'soon'")):  # fmt: skip
        bad = ralph(team.home, "usage", *args, "--team", "demo")
        assert bad.returncode == 2 and says in bad.stderr and bad.stderr.count(b"\n") == 1
