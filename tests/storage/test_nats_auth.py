"""The NATS server enforces the team's policy (``ralph-mail nats config``): a real
nats-server started with the authorization block the command writes, each agent
connecting with its own credentials (``RALPH_NATS_CREDS``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.helpers.processes import BOUND_S, ralph, wait_until

pytest.importorskip("nats")

TEAM = "sealed"
#: The team's inbox subjects: ``ralph.<team in hex>.in.<agent>``.
PREFIX = f"ralph.{TEAM.encode().hex()}"


class Secured(NamedTuple):
    home: Path
    url: str
    creds: Path  # the folder of the agents' credentials files
    server: subprocess.Popen[bytes]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _serve(conf: Path, port: int) -> subprocess.Popen[bytes]:
    """``nats-server -c conf``, once it accepts connections."""
    binary = shutil.which("nats-server") or str(Path(sys.executable).with_name("nats-server"))
    server = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + BOUND_S
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server
        assert server.poll() is None, "nats-server exited"
        assert time.monotonic() < deadline, "nats-server did not start"
        time.sleep(0.02)


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    server.wait(timeout=BOUND_S)


def _ok(done: subprocess.CompletedProcess[bytes]) -> str:
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


@contextlib.contextmanager
def _secured_team(root: Path) -> Iterator[Secured]:
    """A team writer/archive/lead with ``deny writer archive`` and a channel of all,
    made on an open server; then the server started again with the block that
    ``ralph-mail nats config`` wrote included."""
    home, port = root / "home", _free_port()
    url = f"nats://127.0.0.1:{port}"
    base = f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{root / "js"}" }}\n'
    (root / "open.conf").write_text(base)
    env = {"RALPH_BACKEND": url}
    server = _serve(root / "open.conf", port)
    try:
        _ok(ralph(home, "team", "create", TEAM, "--member", "lead", "--member", "writer",
                  "--member", "archive", **env))  # fmt: skip
        as_lead = ("--team", TEAM, "--agent", "lead")
        _ok(ralph(home, "policy", "deny", "writer", "archive", *as_lead, **env))
        _ok(ralph(home, "channel", "create", "general", "--all", *as_lead, **env))
        said = _ok(ralph(home, "nats", "config", *as_lead, **env))
    finally:
        _stop(server)
    block = home / "nats" / f"{TEAM}.auth.conf"
    assert f"wrote {block}" in said and "nats-server --signal reload=PID" in said
    # (nats-server takes an include relative to the file that includes it)
    (root / "server.conf").write_text(base + f'include "{block.relative_to(root)}"\n')
    server = _serve(root / "server.conf", port)
    try:
        yield Secured(home, url, home / "nats" / "creds" / TEAM, server)
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    with _secured_team(tmp_path_factory.mktemp("natsauth")) as team:
        yield team


def as_agent(secured: Secured, agent: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``ralph-mail ARGS --team sealed --agent AGENT`` with the agent's own credentials."""
    return ralph(secured.home, *args, "--team", TEAM, "--agent", agent,
                 RALPH_BACKEND=secured.url,
                 RALPH_NATS_CREDS=str(secured.creds / f"{agent}.creds"))  # fmt: skip


def test_the_credentials_are_the_agents_own_and_private(secured: Secured) -> None:
    for agent in ("lead", "writer", "archive"):
        path = secured.creds / f"{agent}.creds"
        assert path.stat().st_mode & 0o777 == 0o600
        assert json.loads(path.read_text())["user"] == f"{agent}@{TEAM}"
    block = (secured.home / "nats" / f"{TEAM}.auth.conf").stat()
    assert block.st_mode & 0o777 == 0o600


def _raw(
    secured: Secured, agent: str, refused: list[str], listen: str = "", stored: str = ""
) -> tuple[list[str], int]:
    """As a raw nats-py client holding ``agent``'s credentials: a publish to each of
    ``refused``, a subscription to ``listen``, a JetStream publish to ``stored``; what
    the server said of the first two (one error each, in order), and the last's ack."""
    import nats

    login = json.loads((secured.creds / f"{agent}.creds").read_text())

    async def run() -> tuple[list[str], int]:
        errors: asyncio.Queue[str] = asyncio.Queue()

        async def on_error(exc: Exception) -> None:
            errors.put_nowait(str(exc).lower())

        nc = await nats.connect(secured.url, user=login["user"], password=login["password"],
                                error_cb=on_error, allow_reconnect=False)  # fmt: skip
        said = []
        try:
            for subject in refused:
                await nc.publish(subject, b"sneaked in")
                said.append(await asyncio.wait_for(errors.get(), BOUND_S))
            if listen:
                await nc.subscribe(listen)
                said.append(await asyncio.wait_for(errors.get(), BOUND_S))
            seq = 0
            if stored:
                seq = (await nc.jetstream(timeout=BOUND_S).publish(stored, b"raw line")).seq
            return said, seq
        finally:
            await nc.close()

    return asyncio.run(run())


def test_the_server_refuses_a_raw_publish_into_a_denied_inbox(secured: Secured) -> None:
    """writer's credentials cannot put anything into archive's inbox, nor listen to
    it; its own inbox (and what the policy allows) takes a JetStream publish."""
    said, seq = _raw(secured, "writer", [f"{PREFIX}.in.archive"], f"{PREFIX}.in.archive",
                     f"{PREFIX}.in.writer")  # fmt: skip
    assert said[0].startswith("nats: permissions violation for publish")
    assert f'"{PREFIX}.in.archive"' in said[0]
    assert said[1].startswith("nats: permissions violation for subscription")
    assert seq > 0
    shown = _ok(as_agent(secured, "archive", "tail", "archive", "-n", "5"))
    assert "sneaked in" not in shown
    # The raw line in writer's inbox: writer may not remove it (no member may remove a
    # message of the stream); the lead sets it aside by reading it.
    jammed = as_agent(secured, "writer", "read")
    assert jammed.returncode == 4 and b"ralph-mail tail writer --agent LEAD" in jammed.stderr
    _ok(as_agent(secured, "lead", "tail", "writer"))
    assert "raw line" not in _ok(as_agent(secured, "writer", "read"))


def test_a_member_may_not_rewrite_what_is_not_its_own(secured: Secured) -> None:
    """The policy, the roster (its public keys), another member's cursor, claim,
    presence or commit times, a team's stream: refused by the server to archive's raw
    client."""
    kv, stream = f"$KV.RALPH_{TEAM.encode().hex()}", f"RALPH_{TEAM.encode().hex()}"
    subjects = [f"{kv}.state.policy", f"{kv}.roster", f"{kv}.cursor.writer", f"{kv}.claim.writer",
                f"{kv}.presence.writer", f"{PREFIX}.ct.writer",
                f"$JS.API.STREAM.PURGE.{stream}", f"$JS.API.STREAM.DELETE.{stream}",
                f"$JS.API.STREAM.MSG.DELETE.{stream}", f"$JS.API.CONSUMER.DURABLE.CREATE."
                f"{stream}.mine"]  # fmt: skip
    said, _ = _raw(secured, "archive", subjects)
    for subject, error in zip(subjects, said, strict=True):
        assert error == f'nats: permissions violation for publish to "{subject.lower()}"'


def test_ralph_mail_refuses_first_with_exit_4(secured: Secured) -> None:
    done = as_agent(secured, "writer", "send", "archive", "hi")
    assert done.returncode == 4
    assert b"writer may not contact archive" in done.stderr
    assert b"Traceback" not in done.stderr


def test_a_team_works_under_its_agents_own_credentials(secured: Secured) -> None:
    """Sends, reads (cursor commits), presence, channels, an ask answered, as each
    agent with its own user: the permissions are not so tight they break the store."""
    sent = _ok(as_agent(secured, "writer", "send", "lead", "draft ready")).strip()
    shown = _ok(as_agent(secured, "lead", "read"))
    assert "draft ready" in shown and sent in shown
    assert "draft ready" not in _ok(as_agent(secured, "lead", "read"))  # committed
    _ok(as_agent(secured, "lead", "reply", sent, "thanks"))
    assert "thanks" in _ok(as_agent(secured, "writer", "read"))
    _ok(as_agent(secured, "archive", "send", "writer", "filed it"))
    assert "filed it" in _ok(as_agent(secured, "writer", "read"))
    for agent in ("writer", "archive"):
        _ok(as_agent(secured, agent, "presence", "working"))
    assert "working" in _ok(as_agent(secured, "lead", "presence"))
    _ok(as_agent(secured, "writer", "channel", "post", "general", "standup: on the draft"))
    assert "on the draft" in _ok(as_agent(secured, "archive", "channel", "read", "general"))
    asking = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "ask", "writer", "how far?", "--timeout", "50",
         "--team", TEAM, "--agent", "lead"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=_env(secured, "lead"),
    )  # fmt: skip
    try:
        waited = _ok(as_agent(secured, "writer", "wait", "--timeout", "50", "--json"))
        question = json.loads(waited.splitlines()[0])
        assert question["content"] == "how far?"
        _ok(as_agent(secured, "writer", "reply", question["id"], "half way"))
        out, err = asking.communicate(timeout=BOUND_S)
    finally:
        if asking.poll() is None:
            asking.kill()
            asking.communicate(timeout=BOUND_S)
    assert asking.returncode == 0, err.decode()
    assert b"half way" in out


def _env(secured: Secured, agent: str) -> dict[str, str]:
    from tests.helpers.processes import cli_env

    return cli_env(secured.home, RALPH_BACKEND=secured.url,
                   RALPH_NATS_CREDS=str(secured.creds / f"{agent}.creds"))  # fmt: skip


def test_an_answer_into_a_denied_inbox_is_refused_by_the_server(secured: Secured) -> None:
    """An answer into an inbox the policy denies: archive asks writer, which may not
    contact archive; its reply is refused by the server (without --answers), exit 4,
    one line."""
    asked = _ok(as_agent(secured, "archive", "send", "writer", "which file?")).strip()
    assert "which file?" in _ok(as_agent(secured, "writer", "read"))
    done = as_agent(secured, "writer", "reply", asked, "the big one")
    assert done.returncode == 4, done.stderr.decode()
    assert b"Permissions Violation" in done.stderr and b"nats config" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and b"Traceback" not in done.stderr


@pytest.mark.parametrize("case", ["missing", "garbled", "wrong password"])
def test_credentials_that_do_not_log_in_are_one_line_and_exit_2(
    secured: Secured, tmp_path: Path, case: str
) -> None:
    creds = tmp_path / "writer.creds"
    if case == "garbled":
        creds.write_text("user=writer\n")
    elif case == "wrong password":
        creds.write_text(json.dumps({"user": f"writer@{TEAM}", "password": "guess"}))
    done = ralph(secured.home, "read", "--team", TEAM, "--agent", "writer",
                 RALPH_BACKEND=secured.url, RALPH_NATS_CREDS=str(creds))  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0]
    expected = "refused the login" if case == "wrong password" else "RALPH_NATS_CREDS="
    assert expected in lines[0]


def test_writing_it_again_keeps_the_passwords(secured: Secured) -> None:
    """After a policy change the block is written again: every agent's password stays
    (its credentials file goes on working), its permissions follow the policy."""
    before = (secured.creds / "writer.creds").read_bytes()
    out = secured.home / "again.conf"
    _ok(as_agent(secured, "lead", "nats", "config", "--out", str(out)))
    assert (secured.creds / "writer.creds").read_bytes() == before
    assert json.loads(before)["password"] in out.read_text()
    assert f"{PREFIX}.in.archive" not in _allowed(out, "writer")
    _ok(as_agent(secured, "lead", "nats", "config", "--out", str(out), "--answers"))
    assert f"{PREFIX}.in.archive" in _allowed(out, "writer")  # (archive may contact it)
    refused = as_agent(secured, "writer", "nats", "config", "--out", str(out))
    assert refused.returncode == 4  # the lead's act


def _allowed(block: Path, agent: str) -> list[str]:
    """What ``agent`` may publish to, as the block says."""
    text = block.read_text()
    users = json.loads(text[text.index("users = ") + len("users = ") : text.rindex("}")])
    found = next(u for u in users if u["user"] == f"{agent}@{TEAM}")
    return list(found["permissions"]["publish"]["allow"])


def test_reach_follows_the_policy_the_managers_and_the_answers(tmp_path: Path) -> None:
    """Whose inboxes each agent may write to: itself and whom the policy lets it
    contact; a manager also whom its reports may reach (it releases what it approves);
    with ``answers``, also whoever may contact it."""
    from ralph_mail.govern.policy import Policy as Rules
    from ralph_mail.govern.policy import Rule, reach
    from ralph_mail.team import change_roster, create_team, load_team

    team = create_team("r", ["lead", "boss", "writer", "archive"], tmp_path / "home")
    change_roster(team, member="writer", manager="boss")
    team = load_team("r", tmp_path / "home")
    rules = Rules((Rule("writer", "archive", "deny"), Rule("boss", "archive", "deny"),
                   Rule("archive", "*", "deny")))  # fmt: skip
    found = reach(rules, team)
    assert found["writer"] == {"writer", "lead", "boss"}
    assert found["boss"] == {"boss", "lead", "writer"}
    assert found["archive"] == {"archive"}
    assert reach(rules, team, answers=True)["archive"] == {"archive", "lead"}
    assert reach(rules, team, answers=True)["writer"] == {"writer", "lead", "boss"}


def test_the_bucket_watch_runs_under_a_members_credentials(secured: Secured) -> None:
    """nats-py's connection (the bucket's watch: an ephemeral consumer pushed to an
    inbox) logs in with the same credentials and is let do what it needs."""
    code = (
        "import sys, time\n"
        "from ralph_mail.bus import MessageBus\n"
        f"bus = MessageBus({TEAM!r}, 'writer')\n"
        "deadline = time.monotonic() + 50\n"
        "while bus.store._keys is None and time.monotonic() < deadline:\n"
        "    bus.store.load_presence('lead')\n"
        "    time.sleep(0.05)\n"
        "print('watched' if bus.store._keys is not None else 'not watched')\n"
        "bus.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          env=_env(secured, "writer"), timeout=BOUND_S)  # fmt: skip
    assert done.stdout.decode().strip() == "watched", done.stderr.decode()


def test_a_member_makes_no_durable_consumer(secured: Secured) -> None:
    """The consumer API a member may use makes ephemeral consumers only: one asked for
    with a durable name is refused by the server (it would outlive its maker)."""
    import nats

    login = json.loads((secured.creds / "archive.creds").read_text())
    stream = f"RALPH_{TEAM.encode().hex()}"
    config = {"durable_name": "mine", "ack_policy": "none", "filter_subject": f"{PREFIX}.>"}

    async def run() -> dict[str, object]:
        nc = await nats.connect(secured.url, user=login["user"], password=login["password"])
        try:
            request = json.dumps({"stream_name": stream, "config": config}).encode()
            answer = await nc.request(f"$JS.API.CONSUMER.CREATE.{stream}", request, BOUND_S)
            return dict(json.loads(answer.data))
        finally:
            await nc.close()

    error = asyncio.run(run()).get("error")
    assert isinstance(error, dict) and error["err_code"] == 10020  # (ephemeral expected)


def test_a_member_creates_no_team(secured: Secured) -> None:
    """Creating a team (nats-py's requests: refused, unanswered) is the lead's user's:
    a member's is one line, exit 4, once the request's bound passed."""
    done = ralph(secured.home, "team", "create", "other", "--member", "writer",
                 RALPH_BACKEND=secured.url, RALPH_NATS_TIMEOUT_S="1",
                 RALPH_NATS_CREDS=str(secured.creds / "writer.creds"))  # fmt: skip
    assert done.returncode == 4, done.stderr.decode()
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "permissions violation" in lines[0].lower()


def test_nats_config_needs_a_nats_backend(tmp_path: Path) -> None:
    done = ralph(tmp_path / "home", "nats", "config", "--team", "t", "--agent", "lead",
                 RALPH_BACKEND="")  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.decode().count("\n") == 1 and b"NATS backend" in done.stderr


def test_a_policy_change_holds_on_the_server_once_written_and_reloaded(tmp_path: Path) -> None:
    """The documented steps: change the policy, write the block again, reload the
    server (SIGHUP): writer's send to archive, refused by the server's permissions
    before (exit 4, though the Gate lets it through), is stored after."""
    with _secured_team(tmp_path) as team:
        _ok(as_agent(team, "lead", "policy", "remove", "writer", "archive"))
        before = as_agent(team, "writer", "send", "archive", "hi")
        assert before.returncode == 4 and b"Permissions Violation" in before.stderr
        _ok(as_agent(team, "lead", "nats", "config"))
        team.server.send_signal(signal.SIGHUP)
        sent: list[str] = []

        def delivered() -> bool:
            done = as_agent(team, "writer", "send", "archive", "hi")
            assert done.returncode in (0, 4), done.stderr.decode()  # (4: not yet reloaded)
            sent.extend([done.stdout.decode().strip()] if done.returncode == 0 else [])
            return bool(sent)

        wait_until(delivered, "the server to reload its permissions")
        assert sent[0] in _ok(as_agent(team, "archive", "read"))


def test_a_responder_answers_asks_and_tasks_under_its_own_credentials(secured: Secured) -> None:
    """``ralph-mail run`` as writer (its claim, cursor, presence, waits, replies and
    task results, all as writer's user) answers the lead's ask and delegation."""
    runner = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "run", "--team", TEAM, "--agent", "writer",
         "--", "tr", "a-z", "A-Z"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(secured, "writer"),
    )  # fmt: skip
    try:
        wait_until(lambda: _presence(secured, "writer") == "idle", "writer's runner to start")
        asked = as_agent(secured, "lead", "ask", "writer", "ping", "--timeout", "50")
        assert "PING" in _ok(asked)
        done = as_agent(secured, "lead", "delegate", "writer", "do it", "--wait", "50")
        assert "DO IT" in _ok(done)
    finally:
        runner.terminate()
        _, err = runner.communicate(timeout=BOUND_S)
    assert runner.returncode == 0, err.decode()


def _presence(secured: Secured, agent: str) -> str:
    shown = _ok(as_agent(secured, "lead", "presence", "--json"))
    return next(str(json.loads(line)["presence"]) for line in shown.splitlines()
                if json.loads(line)["name"] == agent)  # fmt: skip
