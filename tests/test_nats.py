"""The NATS JetStream backend beyond the contract suites (which run on it too): real
processes through the command line, retried sends, a server restart, doctor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import BOUND_S, Processes, cli_env, fresh_nats, start_nats

from ralph_mail import MessageBus, create_team


def nats_env(home: Path, url: str, **extra: str) -> dict[str, str]:
    env = cli_env(home, RALPH_BACKEND=url, RALPH_TEAM="demo", **extra)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return env


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "ralph_mail", *args], env=env,
                          capture_output=True, timeout=BOUND_S)  # fmt: skip


def test_a_runner_answers_an_ask_and_a_delegation_over_nats(
    tmp_path: Path, procs: Processes
) -> None:
    """Every process reaches the team through the server alone: the homes differ."""
    url = fresh_nats()
    lead_env = nats_env(tmp_path / "host-a", url, RALPH_AGENT="lead")
    assert cli(lead_env, "team", "create", "demo", "--member", "lead", "--member", "w"
               ).returncode == 0  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "run", "--agent", "w", "--", "sh", "-c",
         'echo "$RALPH_PATTERN: $(tail -n 1)"'],
        env=nats_env(tmp_path / "host-b", url), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    procs.started.append(worker)
    assert worker.stderr is not None and b"answers with" in worker.stderr.readline()
    asked = cli(lead_env, "ask", "w", "ready?", "--timeout", "30")
    assert asked.returncode == 0 and asked.stdout == b"ask: ready?\n", asked.stderr
    given = cli(lead_env, "delegate", "w", "ship it", "--wait", "30")
    assert given.returncode == 0 and given.stdout == b"delegate: ship it\n", given.stderr
    tasks = cli(lead_env, "tasks")
    assert b"ship it" in tasks.stdout and b"completed" in tasks.stdout


def test_a_send_retried_under_its_id_is_stored_once(home: Path) -> None:
    """Nats-Msg-Id: the same id sent again (a retry after a timeout) is stored once and
    the retry learns where the first one is."""
    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    lead, w = (
        MessageBus("demo", "lead", home, backend=url),
        MessageBus("demo", "w", home, backend=url),
    )
    first = lead.send("w", "text", "once", id="0123456789ab")
    again = lead.send("w", "text", "once", id="0123456789ab")
    assert again.ts == first.ts
    assert [m.content for m in w.poll()] == ["once"]
    lead.close()
    w.close()


def test_a_server_restart_is_survived(home: Path, tmp_path: Path) -> None:
    """Messages stored before the server stopped are read after it restarts, once each
    and in order; the clients reconnect by themselves."""
    server, url = start_nats(tmp_path / "js")
    try:
        create_team("demo", ["lead", "w"], home=home, backend=url)
        lead = MessageBus("demo", "lead", home, backend=url)
        w = MessageBus("demo", "w", home, backend=url)
        for n in range(5):
            lead.send("w", "text", f"before {n}")
        assert [m.content for m in w.poll()][:2] == ["before 0", "before 1"]
        server.terminate()
        server.wait(timeout=BOUND_S)
        server, _ = start_nats(tmp_path / "js", int(url.rsplit(":", 1)[1]))
        for n in range(5):
            lead.send("w", "text", f"after {n}")
        assert [m.content for m in w.poll()] == [f"after {n}" for n in range(5)]
        lead.close()
        w.close()
    finally:
        server.terminate()
        server.wait(timeout=BOUND_S)


def test_doctor_checks_the_server(tmp_path: Path) -> None:
    """doctor says whether the server answers with JetStream, and how each team's stream
    keeps its messages; an unreachable server is one failure, exit 3."""
    url = fresh_nats()
    env = nats_env(tmp_path, url)
    assert cli(env, "team", "create", "demo", "--member", "lead").returncode == 0
    done = cli(env, "doctor")
    assert done.returncode == 0, done.stdout
    assert b"JetStream on" in done.stdout and b"team 'demo': stream" in done.stdout
    gone = cli(nats_env(tmp_path, "nats://127.0.0.1:1"), "doctor")
    assert gone.returncode == 3 and b"cannot reach the NATS server" in gone.stdout
