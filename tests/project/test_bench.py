"""The benchmark harness runs end to end at tiny sizes, so it never rots.

No test here asserts a timing: the bench measures, CI machines are noisy, and a figure
is judged by a person reading the report. What is pinned is that every section runs,
every case either produced a figure or says why not, and the output has its shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO

#: The smoke run loads the machine: it takes turns with the other heavy runs (pyproject).
pytestmark = pytest.mark.xdist_group("heavy")

SECTIONS = {
    "send", "writers", "read", "wakeup", "ask", "conversation", "receipts", "search",
    "channels", "mcp_server", "dashboard", "nats_backend", "cli", "fanout", "scale", "members",
    "serve", "hotpath",
}  # fmt: skip
TARGETS = {
    "nats_send",
    "nats_ask",
    "nats_ask_stored",
    "nats_ask_run",
    "tui_first_paint",
    "tui_send_to_screen",
    "mcp_send",
    "mcp_check",
    "mcp_send_peer",
    "mcp_check_peer",
    "mcp_push",
    "run_start",
    "run_exit",
    "turn_overhead",
    "channel_post",
    "channel_read",
    "send_vs_peer",
    "send_vs_raw",
    "floor_vs_raw",
    "floor_vs_peer",
    "send_policy",
    "durable_vs_fsync",
    "writers_rate",
    "writers_p99",
    "wake_p50",
    "wake_p99",
    "idle_cpu",
    "poll_vs_raw",
    "poll_backlog",
    "ask_vs_pipe",
    "ask_vs_file_floor",
    "python_ask_vs_file_floor",
    "ask_no_spin_vs_file_floor",
    "send_flat",
    "ask_flat",
    "rss_flat",
    "send_cpu_vs_raw",
    "send_cpu_vs_peer",
    "ask_p50",
    "ask_p99",
    "ask_vs_agent_mail",
    "history_buried",
    "receipt_flat",
    "thread_buried",
    "tasks_tree",
    "search_p50",
    "search_rate",
    "cli_send",
    "cli_read",
    "cli_wait",
    "cli_tail",
    "cli_status",
    "cli_ask",
    "cli_reply",
    "cli_history",
    "cli_task_done",
    "cli_send_warm",
    "cli_read_warm",
    "cli_wait_warm",
    "cli_tail_warm",
    "cli_status_warm",
    "cli_ask_warm",
    "cli_reply_warm",
    "cli_history_warm",
    "cli_task_done_warm",
    "scale_idle",
    "scale_p99",
    "scale_slept",
}
#: Statuses that are not a failure: an optional peer missing, or no ralph-mail script
#: beside the interpreter (an install without console scripts).
ACCEPTED = ("ok", "not installed", "unavailable: no ")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One smoke run of ``python -m bench`` (seconds), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALPH_")}
    env["RALPH_HOME"] = str(tmp / "home")
    page = tmp / "performance.md"
    page.write_text((REPO / "docs" / "performance.md").read_text())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--smoke",
            "--json",
            str(out),
            "--out",
            str(tmp / "out"),
            "--page",
            str(page),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp / "out" / "report.md").is_file()
    assert not (tmp / "home").exists(), "the bench wrote into RALPH_HOME instead of its scratch"
    data: dict[str, Any] = json.loads(out.read_text())
    data["page"] = page.read_text()
    return data


def test_smoke_run_reports_every_section(report: dict[str, Any]) -> None:
    """The JSON has every section, each with rows."""
    assert set(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["rows"], f"section {name} has no rows"


def test_every_case_has_a_figure_or_says_why_not(report: dict[str, Any]) -> None:
    """No case failed: each row has values, or is a peer that is not installed."""
    for name, section in report["sections"].items():
        for row in section["rows"]:
            assert row["status"].startswith(ACCEPTED), (name, row["key"], row["status"])
            if row["status"] == "ok":
                assert row["values"], (name, row["key"])
                assert {"median", "min", "max", "n"} <= row.keys()


def test_ralph_mail_itself_was_measured(report: dict[str, Any]) -> None:
    """The core's own rows ran (the bench did not quietly skip ralph_mail)."""
    rows = {r["key"]: r for s in report["sections"].values() for r in s["rows"]}
    for key in ("ralph_send", "ralph_send_durable", "poll_100", "backlog_1000", "ralph",
                "ask_roundtrip", "history_big", "bus_tasks"):  # fmt: skip
        assert rows[key]["status"] == "ok", (key, rows[key]["status"])


def test_the_scale_section_measures_its_agents_beside_a_lone_one(report: dict[str, Any]) -> None:
    """At its largest N the scale section wakes one of the N agents and a lone agent in
    turn, each after a sleep, and judges the N against the lone one."""
    rows = {r["key"]: r for r in report["sections"]["scale"]["rows"]}
    for key in ("wake_lone", "wake_3_slept", "wake_3", "idle_3"):
        assert rows[key]["status"] == "ok" and rows[key]["values"], key
    assert rows["wake_3_slept"]["anchor"] == "wake_lone"
    judged = {t["key"]: t for t in report["targets"]}
    assert all(judged[k]["met"] is not None for k in ("scale_idle", "scale_p99", "scale_slept"))


def test_the_mcp_agent_mail_peer_says_how_to_get_it(report: dict[str, Any]) -> None:
    """Without --peer-venv the MCP Agent Mail rows say "not installed" and how to fix it."""
    rows = {r["key"]: r for r in report["sections"]["ask"]["rows"]}
    for key in ("agent_mail_roundtrip", "agent_mail_send"):
        assert rows[key]["status"].startswith("not installed: pass --peer-venv PATH")


def test_a_peer_venv_without_the_peer_is_refused_in_one_line(tmp_path: Path) -> None:
    """--make-peer-venv without --peer-venv: exit 2, one line naming the fix."""
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--only", "ask", "--make-peer-venv"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == "--make-peer-venv needs --peer-venv PATH: where to make it\n"


def test_the_page_gets_the_report_between_its_markers(report: dict[str, Any]) -> None:
    """--page rewrites the tables of docs/performance.md and keeps the prose around them."""
    before = (REPO / "docs" / "performance.md").read_text()
    prose, _, rest = before.partition("<!-- bench: begin")
    after = report["page"]
    assert after.startswith(prose)
    assert after.endswith(rest.split("<!-- bench: end -->", 1)[1])
    assert "Mode `smoke`" in after and "### Targets" in after
    assert after.count("<!-- bench: begin") == after.count("<!-- bench: end -->") == 1


def test_a_page_without_markers_is_refused_before_the_run(tmp_path: Path) -> None:
    """--page FILE without the markers: exit 2 at once, one line naming the file."""
    page = tmp_path / "page.md"
    page.write_text("# no markers\n")
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--only", "send", "--page", str(page)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith(f"--page {page}: no ") and done.stderr.count("\n") == 1
    assert page.read_text() == "# no markers\n"


def test_writers_left_exactly_every_message(report: dict[str, Any]) -> None:
    """After the many-writers runs every inbox held exactly the lines sent, all parseable."""
    for row in report["sections"]["writers"]["rows"]:
        assert row["extra"]["verified"]["values"], row["key"]
        assert all(v == 1.0 for v in row["extra"]["verified"]["values"]), row["key"]


def test_every_target_is_reported(report: dict[str, Any]) -> None:
    """Each target of the issue appears, with a verdict or the reason there is none."""
    targets = {t["key"]: t for t in report["targets"]}
    assert set(targets) == TARGETS
    for target in targets.values():
        assert target["met"] in (True, False, None)
        if target["met"] is None:
            assert target["note"], target["key"]


def test_hold_time_experiment_runs() -> None:
    """bench/hold_time.py (cited in docs/performance.md) runs and prints one row per hold time."""
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "hold_time.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "µs |" in line]
    assert [row.split(" |")[0] for row in rows] == ["| 0 µs", "| 2 µs", "| 5 µs", "| 10 µs"]


def test_the_ask_path_tool_stamps_every_step_of_an_ask() -> None:
    """bench/askpath.py (cited in docs/performance.md) prints the median of each step of
    an ask between two processes, every step stamped, the whole ask, then the CPU time
    an ask cost each process."""
    from bench.askpath import CPU_NAMES, NAMES

    done = subprocess.run(
        [sys.executable, "-m", "bench.askpath", "--asks", "30"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.rsplit(None, 2) for line in done.stdout.splitlines()]
    assert [name for name, _, _ in rows] == [*NAMES, *CPU_NAMES]
    assert all(unit == "µs" for _, _, unit in rows)
    steps, whole = [float(t) for _, t, _ in rows[: len(NAMES) - 1]], float(rows[len(NAMES) - 1][1])
    assert all(step >= 0 for step in steps) and whole > 0
    asker, replier = (float(t) for _, t, _ in rows[len(NAMES) :])
    assert asker > 0 and replier >= 0  # (the replier's in clock ticks: 30 asks may be none)


def test_the_ask_path_tool_refuses_a_bad_count_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.askpath", "--asks", "0"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2 and "--asks 0: give at least 1" in done.stderr


def test_the_builds_tool_compares_checkouts_wake_up_by_wake_up() -> None:
    """bench/builds.py (cited in docs/performance.md) wakes agents of each checkout in
    turn and prints each one's percentiles, with agents that work on their mail, with
    the processes pinned to CPUs, and with a build woken only every K-th round."""
    runs = [
        ([".", ".:3", "--samples", "12", "--busy-us", "20"], ["1", "3"], [12, 12]),
        ([".", "--samples", "4", "--pin", "0,0"], ["1"], [4]),
        ([".:2", ".:1/4", "--samples", "10"], ["2", "1/4"], [10, 3]),
    ]
    for args, agents, woken in runs:
        done = subprocess.run(
            [sys.executable, "-m", "bench.builds", *args],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        rows = done.stdout.splitlines()
        assert len(rows) == len(agents)
        for row, count, wakes in zip(rows, agents, woken, strict=True):
            name, _, p50, _, *_ = row.split()
            assert name == f"{REPO}:{count}"
            assert float(p50) > 0 and row.endswith(f"({wakes} wake-ups)")


def test_the_builds_tool_refuses_what_is_not_a_checkout_in_one_line(tmp_path: Path) -> None:
    for args, says in [
        ([str(tmp_path)], "is not a checkout of ralph_mail"),
        ([".:0"], "N after the ':' is a count of agents"),
        ([".:1/0"], "K after the '/' is how many rounds pass between two wake-ups"),
        ([".", "--pin", "0,99"], "give S,A, two CPUs of"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "bench.builds", *args],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr
