"""The NATS backend when the server, the network or another client misbehaves. Each test
drives a real nats-server: the test run's own (`fresh_nats`), or children of its own,
started and killed by pid, every wait bounded, killed and reaped whatever happens
(`servers`)."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, create_team
from ralph_mail.store import backend
from tests.helpers.backends import fresh_nats
from tests.helpers.cluster import Cluster, Server
from tests.helpers.processes import BOUND_S, Processes, cli_env, wait_until


def cli(
    home: Path, url: str, *args: str, stdout: int = subprocess.PIPE, **env: str
) -> subprocess.CompletedProcess[bytes]:
    """``ralph-mail ARGS`` on ``url`` as a member of team demo, bounded."""
    environment = cli_env(home, RALPH_BACKEND=url, RALPH_TEAM="demo", **env)
    return subprocess.run([sys.executable, "-m", "ralph_mail", *args], env=environment,
                          stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE,
                          timeout=BOUND_S)  # fmt: skip


def one_line(done: subprocess.CompletedProcess[bytes], code: int, *words: str) -> str:
    """Check that ``done`` exited ``code`` with one error line holding ``words`` and no
    traceback; return the line."""
    err = done.stderr.decode()
    assert done.returncode == code and "Traceback" not in err, (done.returncode, err)
    assert err.count("\n") == 1 and err.startswith("ralph-mail: error: "), err
    for word in words:
        assert word in err, err
    return err


def only_notes(done: subprocess.CompletedProcess[bytes]) -> bool:
    """Whether ``done`` wrote nothing on stderr but notes (an offline recipient...)."""
    return all(line.startswith(b"ralph-mail: note: ") for line in done.stderr.splitlines())


def team_of(home: Path, url: str, *members: str) -> None:
    create_team("demo", list(members or ("lead", "w")), home=home, backend=url)


def store_of(home: Path, url: str):  # type: ignore[no-untyped-def]
    """The NATS store of team demo (its round trips, for a test to poke at)."""
    return backend(home, url).team_store("demo")


def with_jobs(home: Path, count: int) -> str:
    """A fresh server's team demo with ``count`` messages in w's inbox; its URL."""
    url = fresh_nats()
    team_of(home, url)
    with MessageBus("demo", "lead", home, backend=url) as lead:
        for n in range(count):
            lead.send("w", "text", f"job {n}")
    return url


# -- an inbox emptied under its readers -----------------------------------------------


def _empty(store, subject: str, how: str) -> None:  # type: ignore[no-untyped-def]
    """Empty ``subject`` the way an operator's stream settings or tools would."""
    from ralph_mail.store.nats.stream import TeamStream

    if how == "purge":  # nats stream purge --subject
        assert store._api(f"STREAM.PURGE.{store.stream}", {"filter": subject}).get("success")
        return
    config = store._api(f"STREAM.INFO.{store.stream}", {})["config"]
    short = {"max_age": int(0.3e9), "duplicate_window": int(0.3e9)}
    limits = {"max_age": short, "max_msgs": {"max_msgs": 1}}[how]
    assert "error" not in store._api(f"STREAM.UPDATE.{store.stream}", config | limits)
    if how == "max_msgs":  # one message more anywhere: the inbox's go
        lead = store._subject("lead")
        store._acked(lead, b"x", {"Ralph-Offset": "0", "Ralph-N": "1", "Nats-Msg-Id": "x"})
    wait_until(lambda: TeamStream._get(store, subject) is None, f"{how} to empty it")
    assert "error" not in store._api(f"STREAM.UPDATE.{store.stream}", config)


@pytest.mark.parametrize("how", ["purge", "max_age", "max_msgs"])
def test_an_inbox_emptied_by_the_streams_limits_goes_on_past_its_readers_cursor(
    home: Path, how: str
) -> None:
    """An inbox the stream's limits or a purge emptied does not start again at offset 0,
    below its reader's cursor: what is sent afterwards is read, waited on and tailed,
    and its offsets and ordinals go on growing."""
    url = fresh_nats()
    team_of(home, url)
    store = store_of(home, url)
    with MessageBus("demo", "lead", home, backend=url) as lead:
        with MessageBus("demo", "w", home, backend=url) as w:
            for n in range(3):
                lead.send("w", "text", f"before {n}")
            assert [m.content for m in w.poll()] == [f"before {n}" for n in range(3)]
            floor = store.load_cursor("w").floor
            _empty(store, store._subject("w"), how)
            lead.send("w", "text", "after 0")
            assert [m.content for m in w.wait_for_messages(BOUND_S)] == ["after 0"]
            lead.send("w", "text", "after 1")
        with MessageBus("demo", "w", home, backend=url) as again:  # a new process's view
            assert [m.content for m in again.poll()] == ["after 1"]
    lines, end = store.read_tail("w", 5)
    assert [orjson.loads(line)["content"] for line in lines] == ["after 0", "after 1"]
    assert end > floor and store.size("w") == end
    store.close()


def test_a_cursor_past_the_end_of_its_inbox_is_repaired_not_trusted(home: Path) -> None:
    """A cursor above the end (its inbox was made again, its key edited) would skip
    every later message: the inbox is read again from its start instead (at least
    once), and the cursor saved back within it."""
    url = fresh_nats()
    team_of(home, url)
    store = store_of(home, url)
    with MessageBus("demo", "lead", home, backend=url) as lead:
        lead.send("w", "text", "one")
        store._kv_write("cursor.w", orjson.dumps({"floor": 10**12, "acked": []}))
        lead.send("w", "text", "two")
    with MessageBus("demo", "w", home, backend=url) as w:
        assert [m.content for m in w.poll()] == ["one", "two"]
    assert store.load_cursor("w").floor == store.size("w")
    store.close()


# -- reads that cannot save their cursor ----------------------------------------------


class Relay:
    """A TCP relay between clients and a server that cuts the network when a client
    publishes to a subject starting with ``cut`` for the ``after``-th time: it closes
    that connection without passing the publish on, and every later one at once."""

    def __init__(self, port: int, cut: bytes, after: int) -> None:
        self.port_to, self.cut, self.after = port, cut, after
        self.seen = 0
        self.down = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down.is_set():
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self.port_to))
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, watched: bool) -> None:
        tail = b""
        try:
            while data := source.recv(1 << 16):
                if watched:
                    self.seen += (tail + data).count(self.cut) - tail.count(self.cut)
                    tail = (tail + data)[-len(self.cut) :]
                    if self.seen >= self.after:
                        self.down.set()
                if self.down.is_set():
                    break
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            end.close()

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def test_a_read_whose_cursor_cannot_be_saved_prints_nothing_and_says_so(
    home: Path, servers: Callable[..., Server]
) -> None:
    """The cursor is saved before anything is printed: when the network goes as it is
    saved, read prints nothing, says so in one line (exit 2), and the messages stay
    unread for the next read, which prints them once."""
    server = servers("-js").start()
    team_of(home, server.url)
    with MessageBus("demo", "lead", home, backend=server.url) as lead:
        sent = [lead.send("w", "text", f"m{n}").id for n in range(3)]
    stream = f"RALPH_{b'demo'.hex()}"
    # The read writes the cursor twice: as the inbox's new consumer, then as it consumes.
    relay = Relay(server.port, f"PUB $KV.{stream}.cursor.".encode(), after=2)
    try:
        cut = cli(home, f"nats://127.0.0.1:{relay.port}", "read", "--agent", "w",
                  RALPH_NATS_TIMEOUT_S="2", RALPH_NATS_LEASE_S="1")  # fmt: skip
    finally:
        relay.close()
    assert relay.down.is_set() and cut.stdout == b""
    one_line(cut, 2, "could not consume the messages", "nothing was shown")
    wait_until(lambda: store_of(home, server.url).consumer("w") is None, "the lease to lapse")
    read = cli(home, server.url, "read", "--agent", "w", "--json")
    assert read.returncode == 0, read.stderr
    assert [orjson.loads(line)["id"] for line in read.stdout.splitlines()] == sent
    assert cli(home, server.url, "read", "--agent", "w").stdout == b""


def test_a_read_whose_output_fails_consumes_nothing(home: Path) -> None:
    """Consumed before printing, and given back when the printing fails: a reader gone
    before the first line leaves every message unread, and no receipt says they were
    consumed then."""
    from ralph_mail.message import format_ts

    url = fresh_nats()
    team_of(home, url)
    with MessageBus("demo", "lead", home, backend=url) as lead:
        sent = [lead.send("w", "text", f"m{n}").id for n in range(3)]
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader left
        try:
            gone = cli(home, url, "read", "--agent", "w", stdout=write_end)
        finally:
            os.close(write_end)
        assert gone.returncode == 141, gone.stderr
        assert {receipt.state for receipt in map(lead.receipt, sent)} == {"stored"}
        after = format_ts(time.time_ns() // 1000)
        read = cli(home, url, "read", "--agent", "w", "--json")
        assert [orjson.loads(line)["id"] for line in read.stdout.splitlines()] == sent
        consumed = [lead.receipt(message).consumed_at for message in sent]
        assert all(at is not None and at > after for at in consumed), (after, consumed)


# -- a consumer paused past its lease -------------------------------------------------

#: Peeks, says so, waits for a word on stdin (the test pauses it meanwhile), then tries to
#: commit what it peeked and to peek again, saying how each went.
PAUSED = """
import sys
from ralph_mail import MessageBus
from ralph_mail.errors import ClaimLost
bus = MessageBus("demo", "w", sys.argv[1], backend=sys.argv[2])
peeked = bus.peek()
print("peeked", len(peeked), flush=True)
sys.stdin.readline()
for attempt in ("commit", "peek"):
    try:
        if attempt == "commit":
            bus.commit(peeked[-1])
        else:
            print("handed", len(bus.peek()), flush=True)
            continue
    except ClaimLost as exc:
        print(attempt, "fenced:", exc, flush=True)
"""


def test_a_stale_holder_does_not_renew_over_another_claim_of_the_same_revision(
    home: Path,
) -> None:
    """A team deleted and made again numbers its writes from 1 again, so the revision a
    stale holder renews its claim over can be another process's claim. The renewal
    looks at the key first: the stale holder loses its claim, and the other keeps it."""
    from ralph_mail.errors import ClaimLost

    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    stale = store_of(home, url)
    stale.claim("w")
    other = orjson.dumps({"pid": 1, "host": "elsewhere", "until": time.time() + BOUND_S})
    revision = stale._kv_write("claim.w", other)  # (the other's claim, as a new team's)
    stale._claims["w"] = revision  # (the stale holder's revision is the same number)
    try:
        assert not stale._confirm("w")
        assert stale.consumer("w") == 1
        with pytest.raises(ClaimLost, match="taken by pid 1 on elsewhere"):
            stale.hold("w")
    finally:
        stale.close()


def test_a_consumer_paused_past_its_lease_is_fenced_off(home: Path, procs: Processes) -> None:
    """A consumer stopped (SIGSTOP, a long pause) until its claim lapsed, whose inbox a
    successor took and consumed meanwhile, gets a clear error when it resumes: it
    neither hands the messages out again nor moves the cursor back."""
    url = with_jobs(home, 3)
    paused = procs.python(PAUSED, str(home), url, env=cli_env(home, RALPH_NATS_LEASE_S="1"))
    assert paused.stdout is not None and paused.stdin is not None
    assert paused.stdout.readline() == b"peeked 3\n"
    paused.send_signal(signal.SIGSTOP)
    try:
        store = store_of(home, url)
        deadline = time.monotonic() + BOUND_S
        while (holder := store.consumer("w")) is not None:  # the paused one's lease lapsing
            assert time.monotonic() < deadline, (
                f"the claim of w is still held by pid {holder} (the paused consumer is pid "
                f"{paused.pid}): {store._kv_entry('claim.w')}"
            )
            time.sleep(0.02)
        successor = MessageBus("demo", "w", home, backend=url)
        assert [m.content for m in successor.poll()] == [f"job {n}" for n in range(3)]
        floor = store.load_cursor("w").floor
    finally:
        paused.send_signal(signal.SIGCONT)
    paused.stdin.write(b"go\n")
    paused.stdin.close()
    out = paused.stdout.read().decode()
    assert paused.wait(timeout=BOUND_S) == 0, paused.stderr.read()  # type: ignore[union-attr]
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["commit fenced", "peek fenced"], out
    assert "no longer consumes the inbox of 'w'" in lines[0]
    assert store.load_cursor("w").floor == floor  # the successor's, not moved back
    successor.close()
    store.close()


def test_a_commit_refused_after_it_was_sent_fences_the_next_read(home: Path) -> None:
    """A commit sends its cursor and goes on. When a successor wrote the cursor meanwhile
    (taking over a claim its holder still thought sure: another host's clock ahead),
    the write is refused: the holder's next read raises ClaimLost and hands out
    nothing, and the successor's cursor stays."""
    from ralph_mail.errors import ClaimLost, InboxBusy

    url = with_jobs(home, 3)
    bus, store = MessageBus("demo", "w", home, backend=url), store_of(home, url)
    try:
        first = bus.peek()[0]
        claim = {"pid": 1, "host": "elsewhere", "until": time.time() + BOUND_S}
        store._kv_write("claim.w", orjson.dumps(claim))  # (the successor's claim, and
        _, revision = store._kv_entry("cursor.w")  # its cursor, written as it claimed)
        successor = orjson.dumps({"floor": 0, "acked": [], "by": "elsewhere:1"})
        assert store._kv_write("cursor.w", successor, last=revision) is not None
        bus.commit(first)  # (sent: its refusal is not waited for)
        with pytest.raises(ClaimLost, match="moved by another consumer"):
            bus.peek()
        with pytest.raises(InboxBusy, match="consumed by pid 1 on elsewhere"):
            bus.poll()
        assert store.load_cursor("w").floor == 0
    finally:
        bus.close()
        store.close()


def test_a_commit_whose_answer_went_with_its_connection_is_made_again(home: Path) -> None:
    """The connection broke before the commit's answer came: whether it was stored is
    not known, so the cursor is written again (over the revision it had, or found to be
    its own), and waited for."""
    from ralph_mail.store.nats.wire import Wire

    url = with_jobs(home, 2)
    bus, store = MessageBus("demo", "w", home, backend=url), store_of(home, url)
    try:
        first, second = bus.peek()
        bus.commit(first)
        Wire.for_thread(url).close()  # (its answer never comes now)
        bus.store.settle_cursor("w")
        assert bus.store._sent == {}
        assert store.load_cursor("w").floor > 0
        assert [m.id for m in bus.peek()] == [second.id]
    finally:
        bus.close()
        store.close()


def test_a_commit_time_stored_before_its_cursor_says_the_line_was_consumed(
    home: Path,
) -> None:
    """A commit's time goes out in the background once its cursor was sent, and may be
    stored first: `consumed`, what a receipt's wait looks at when woken by it, takes the
    last commit too (never more than one ahead of the cursor)."""
    from ralph_mail.store.base import Cursor
    from ralph_mail.store.nats.background import flush

    url = with_jobs(home, 2)
    store = store_of(home, url)
    try:
        second = len(store.read("w", 0)[0].split(b"\n")[0]) + 1
        store.note_commit("w", Cursor(0), Cursor(second))  # (its cursor not stored yet)
        flush()
        assert store.load_cursor("w") == Cursor(0)
        assert store.consumed("w", 0) and not store.consumed("w", second)
    finally:
        store.close()


# -- clear errors -----------------------------------------------------------------------


def test_a_server_without_jetstream_is_one_line_naming_it_for_every_command(
    home: Path, servers: Callable[..., Server]
) -> None:
    """No JetStream: every command says so in one line with how to turn it on (-js),
    doctor included; none prints a traceback."""
    server = servers().start()
    for args in (["team", "create", "demo", "--member", "lead"], ["team", "list"],
                 ["send", "lead", "hi", "--agent", "w"], ["read", "--agent", "w"],
                 ["wait", "--agent", "w", "--timeout", "1"], ["tail", "lead"],
                 ["search", "hi"], ["status", "busy", "--agent", "w"], ["gc"]):  # fmt: skip
        one_line(cli(home, server.url, *args), 2, "JetStream off", "-js")
    doctor = cli(home, server.url, "doctor")
    assert doctor.returncode == 3 and doctor.stderr == b"", doctor.stderr
    assert doctor.stdout.splitlines()[0].startswith(b"FAIL  the NATS server at")
    assert b"JetStream off" in doctor.stdout and b"-js" in doctor.stdout


@pytest.mark.parametrize("url", ["nats://127.0.0.1:abc", "nats://::::"])
@pytest.mark.parametrize("command", ["send", "wait", "read", "doctor", "team"])
def test_a_backend_url_that_is_no_url_is_one_line(home: Path, url: str, command: str) -> None:
    """A port that is no number, a host that is no host: exit 2, one line, at once."""
    args = {"send": ["send", "w", "hi", "--agent", "lead"], "wait": ["wait", "--agent", "w"],
            "read": ["read", "--agent", "w"], "doctor": ["doctor"],
            "team": ["team", "list"]}[command]  # fmt: skip
    one_line(cli(home, url, *args), 2, f"invalid NATS URL {url!r}", "nats://HOST:PORT")


@pytest.mark.parametrize("url", ["nats://127.0.0.1:4222,,127.0.0.1:4223",
                                 "nats://127.0.0.1:4222,127.0.0.1:abc"])  # fmt: skip
def test_a_cluster_url_with_a_bad_server_is_one_line(home: Path, url: str) -> None:
    one_line(cli(home, url, "send", "w", "hi", "--agent", "lead"), 2, "invalid NATS URL")


@pytest.mark.parametrize("replicas", ["0", "6", "three", "-1"])
def test_a_replica_count_that_is_none_is_one_line_and_makes_no_team(
    home: Path, replicas: str
) -> None:
    url = fresh_nats()
    made = cli(home, url, "team", "create", "demo", "--member", "lead",
               RALPH_NATS_REPLICAS=replicas)  # fmt: skip
    one_line(made, 2, f"invalid RALPH_NATS_REPLICAS={replicas!r}", "1 to 5")
    assert cli(home, url, "team", "list").stdout.strip() == b""


@pytest.mark.parametrize("url", ["nats:/127.0.0.1:4222", "ws://127.0.0.1:4222"])
def test_doctor_refuses_a_mistyped_backend_as_every_command_does(home: Path, url: str) -> None:
    """doctor does not check the file home instead and call it healthy."""
    done = cli(home, url, "doctor")
    one_line(done, 2, f"unknown backend {url!r}")
    assert done.stdout == b""


def test_a_refused_login_is_named_at_once_and_tried_once(
    home: Path, servers: Callable[..., Server]
) -> None:
    """No user, a wrong password: one line naming the authorization failure and how to
    log in, the password not shown; each command tries once (the server saw one
    attempt each), rather than retrying for 10 s and calling the server unreachable."""
    server = servers("-js", "--user", "bob", "--pass", "secret").start()
    wrong = [server.url, f"nats://bob:wrong@127.0.0.1:{server.port}"]
    runs = 0
    for url in wrong:
        for args in (["send", "w", "hi", "--agent", "lead"], ["read", "--agent", "w"]):
            line = one_line(cli(home, url, *args), 2, "refused the login",
                            "Authorization Violation", "nats://USER:PASS@HOST:PORT")  # fmt: skip
            assert "wrong" not in line
            runs += 1
        doctor = cli(home, url, "doctor")
        assert doctor.returncode == 3 and b"refused the login" in doctor.stdout
        runs += 1
    assert server.log.read_text().count("authentication error") == runs
    right = f"nats://bob:secret@127.0.0.1:{server.port}"
    assert cli(home, right, "team", "create", "demo", "--member", "w").returncode == 0


# -- what other clients leave in the team's stream and bucket -------------------------

#: Every command a member runs, for the keys and lines below.
COMMANDS = (["send", "w", "hello", "--agent", "lead"], ["read", "--agent", "w"],
            ["wait", "--agent", "w", "--timeout", "0.5"], ["tail", "w"], ["search", "hello"],
            ["history", "w", "--agent", "lead"], ["status", "busy", "--agent", "w"],
            ["gc"])  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value", "refused"),
    [("cursor.w", b"garbage", ("read", "wait", "gc")),
     ("cursor.w", b'{"floor": "x", "acked": 3}', ("read", "wait", "gc")),
     ("claim.w", b'{"pid": "x", "until": "soon"}', ()),
     ("base.w", b"abc", ())],
)  # fmt: skip
def test_a_bucket_key_of_the_wrong_shape_is_refused_or_repaired_in_one_line(
    home: Path, key: str, value: bytes, refused: tuple[str, ...]
) -> None:
    """A cursor, claim or inbox-start key written by hand: no command prints a
    traceback; a damaged cursor is refused in one line naming its key and fix (nobody
    can say what was consumed), a claim counts as lapsed and is taken over, a start
    counts as 0; doctor finds each."""
    url = fresh_nats()
    team_of(home, url)
    store = store_of(home, url)
    store._kv_write(key, value)
    doctor = cli(home, url, "doctor", "--team", "demo")
    found = [line for line in doctor.stdout.decode().splitlines() if key in line]
    assert len(found) == 1 and found[0].startswith("FAIL" if refused else "WARN"), found
    assert doctor.returncode == (3 if refused else 0), doctor.stdout
    for args in COMMANDS:
        done = cli(home, url, *args)
        if args[0] in refused:
            one_line(done, 2, "damaged", key, "nats kv del")
        else:
            assert done.returncode in (0, 1) and only_notes(done), (args, done.stderr)
    store.close()


def test_lines_published_into_an_inbox_without_the_stores_headers_are_set_aside(
    home: Path,
) -> None:
    """A raw 'nats pub' into an inbox (no headers, an offset that is no number) or into
    a conversation's index: no command prints a traceback; the messages around them are
    delivered once, in order; the inbox's foreign lines are kept as dead letters; doctor
    finds them."""
    url = fresh_nats()
    team_of(home, url)
    store = store_of(home, url)
    subject = store._subject("w")
    with MessageBus("demo", "lead", home, backend=url) as lead:
        first = lead.send("w", "text", "first").id
        store._acked(subject, b"raw, no headers")
        assert b"ends in a message published without" in cli(home, url, "doctor").stdout
        store._acked(subject, b"raw, bad offset", {"Ralph-Offset": "x", "Ralph-N": "1"})
        store._acked(store._subject("ix:pair+lead+w"), b"no entry\n[1, 2]")
        for args in COMMANDS:
            done = cli(home, url, *args)
            assert done.returncode in (0, 1) and only_notes(done), (args, done.stderr)
        last = lead.send("w", "text", "last").id
    read = cli(home, url, "read", "--agent", "w", "--json")
    ids = [orjson.loads(line)["id"] for line in read.stdout.splitlines()]
    assert read.returncode == 0 and first not in ids and ids[-1] == last  # first: read above
    letters = store.dead_letters("w")
    assert sorted(letter["line"] for letter in letters) == ["raw, bad offset", "raw, no headers"]
    assert b"2 dead letter(s) of 'w'" in cli(home, url, "doctor").stdout
    store.close()


# -- a server away, a leader lost -----------------------------------------------------


def _line_with(pipe: object, word: bytes, what: str) -> bytes:
    """What comes out of ``pipe`` (a child's stdout or stderr, read unbuffered) until
    ``word`` is in it, bounded."""
    fd, seen = pipe.fileno(), b""  # type: ignore[attr-defined]
    deadline = time.monotonic() + BOUND_S
    while word not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {what}: {seen!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 1 << 16)
            assert chunk, f"the process ended before {what}: {seen!r}"
            seen += chunk
    return seen


def test_run_wait_and_lead_outlast_a_server_away_past_the_one_off_bound(
    home: Path, servers: Callable[..., Server], procs: Processes
) -> None:
    """A server away longer than two of a one-off command's retry windows: `run`,
    `wait` and `lead` say so once (and once that it is back), keep trying, and once it
    is back `wait` gets the next message, `run` answers the next ask and the lead
    handles the next status update; a one-off command meanwhile fails in one line."""
    server = servers("-js").start()
    team_of(home, server.url, "lead", "w", "x")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = cli_env(home, RALPH_BACKEND=server.url, RALPH_TEAM="demo", RALPH_NATS_TIMEOUT_S="1",
                  PATH=path)  # fmt: skip
    python = [sys.executable, "-m", "ralph_mail"]
    waiting = subprocess.Popen([*python, "wait", "--agent", "x"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    running = subprocess.Popen([*python, "run", "--agent", "w", "--", "sh", "-c",
                                'echo "answer: $(tail -n 1)"'], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    leading = subprocess.Popen([*python, "lead", "--json"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)  # fmt: skip
    procs.started += [waiting, running, leading]
    _line_with(running.stderr, b"answers with sh", "the runner to start")
    store = store_of(home, server.url)
    wait_until(lambda: None not in (store.consumer("x"), store.consumer("lead")),
               "wait and the lead to claim their inboxes")  # fmt: skip
    store.close()
    server.stop(signal.SIGKILL)
    gone = cli(home, server.url, "send", "x", "hi", "--agent", "lead", RALPH_NATS_TIMEOUT_S="1")
    one_line(gone, 2, "cannot reach the NATS server")
    children = (("wait", waiting), ("run", running), ("lead", leading))
    said = {name: _line_with(child.stderr, b"is away", f"{name} to say the server is away")
            for name, child in children}  # fmt: skip
    time.sleep(3.0)  # the outage itself: past two 1 s retry windows of theirs
    assert waiting.poll() is None and running.poll() is None and leading.poll() is None
    server.start()
    sent = cli(home, server.url, "send", "x", "after", "--agent", "lead")
    assert sent.returncode == 0, sent.stderr
    assert waiting.wait(timeout=BOUND_S) == 0
    assert waiting.stdout is not None and b"after" in waiting.stdout.read()
    asked = cli(home, server.url, "ask", "w", "still there?", "--timeout", "30", "--agent",
                "lead")  # fmt: skip
    assert asked.returncode == 0 and asked.stdout == b"answer: still there?\n", asked.stderr
    assert cli(home, server.url, "status", "back at it", "--agent", "x").returncode == 0
    _line_with(leading.stdout, b"back at it", "the lead to handle a status update")
    for child in (running, leading):
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=BOUND_S) == 0
    assert waiting.stderr is not None and running.stderr is not None
    assert leading.stderr is not None
    said["wait"] += waiting.stderr.read()
    said["run"] += running.stderr.read()
    said["lead"] += leading.stderr.read()
    for name, err in said.items():  # once each: JetStream recovering is the same outage
        notes = [line.split(b" is ")[1][:4] for line in err.splitlines() if b"NATS" in line]
        assert b"Traceback" not in err and notes == [b"away", b"back"], (name, err)


def test_a_leader_lost_reads_as_unavailable_and_is_outlasted_never_as_no_team(
    home: Path, servers: Callable[..., Server]
) -> None:
    """On a cluster whose team streams have three replicas: a send while the stream's
    leader is killed and another elected goes through (it is tried again); with two of
    three nodes gone (no leader can be elected) a command says the server is
    unavailable, never that there is no team."""
    nodes = Cluster(servers, home.parent / "node.conf").start().nodes
    team_of(home, nodes[0].url)
    store = store_of(home, nodes[0].url)
    leaders: dict[str, str] = {}
    for stream in (store.stream, f"KV_{store.stream}"):
        config = store._api(f"STREAM.INFO.{stream}", {})["config"]
        assert "error" not in store._api(f"STREAM.UPDATE.{stream}", config | {"num_replicas": 3})

        def replicated(stream: str = stream) -> bool:
            cluster = store._api(f"STREAM.INFO.{stream}", {}).get("cluster", {})
            leaders[stream] = cluster.get("leader", "")
            current = [r for r in cluster.get("replicas") or [] if r.get("current")]
            return bool(leaders[stream]) and len(current) == 2

        wait_until(replicated, f"{stream} to have three current replicas")
    store.close()
    leader = int(leaders[store.stream][1:])
    client, other = (n for n in range(3) if n != leader)
    url = nodes[client].url
    nodes[leader].stop(signal.SIGKILL)
    # An election takes seconds (7 s on a small machine): within a bound of 30 s here.
    sent = cli(home, url, "send", "w", "during the election", "--agent", "lead",
               RALPH_NATS_TIMEOUT_S="30")  # fmt: skip
    assert sent.returncode == 0 and b"no team" not in sent.stderr, sent.stderr
    read = cli(home, url, "read", "--agent", "w", "--json", RALPH_NATS_TIMEOUT_S="30")
    assert read.returncode == 0, read.stderr
    assert [orjson.loads(line)["content"] for line in read.stdout.splitlines()] == [
        "during the election"]  # fmt: skip
    nodes[other].stop(signal.SIGKILL)
    for args in (["send", "w", "alone", "--agent", "lead"], ["read", "--agent", "w"]):
        done = cli(home, url, *args, RALPH_NATS_TIMEOUT_S="3")
        line = one_line(done, 2, "is unavailable")
        assert "no team" not in line


# -- what search and tail cost ----------------------------------------------------------


class RoundTrips:
    """Counts the round trips this process makes (`Wire.request`, `Wire.many`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from ralph_mail.store.nats.wire import Wire

        self.count = 0
        for name in ("request", "many"):
            made = getattr(Wire, name)

            def counted(*args: object, _made: Callable[..., object] = made, **kw: object) -> object:
                self.count += 1
                return _made(*args, **kw)

            monkeypatch.setattr(Wire, name, counted)


def _big_team(home: Path, url: str, agents: int) -> list[str]:
    names = [f"a{n}" for n in range(agents)]
    create_team("demo", ["lead", *names], home=home, backend=url)
    with MessageBus("demo", "lead", home, backend=url) as lead:
        for n in range(agents * 3):
            lead.send(names[n % agents], "text", f"note {n}")
    return names


@pytest.mark.parametrize("agents", [4, 24])
def test_a_search_reads_only_what_is_new_in_one_round_trip(
    home: Path, monkeypatch: pytest.MonkeyPatch, agents: int
) -> None:
    """The index persists in the home: a search in a new process reads nothing it
    indexed before; with nothing new it costs one round trip, whatever the team."""
    from ralph_mail.store.search import Query

    url = fresh_nats()
    _big_team(home, url, agents)
    first = store_of(home, url)
    assert len(first.search(Query("note", limit=1000))) == agents * 3
    first.close()
    trips = RoundTrips(monkeypatch)
    again = store_of(home, url)  # (as a new process: nothing in memory)
    assert again.search(Query("nowhere")) == []
    assert trips.count == 1
    with MessageBus("demo", "lead", home, backend=url) as lead:
        lead.send("a0", "text", "a new needle")
    trips.count = 0
    assert [orjson.loads(line)["content"] for line in again.search(Query("needle"))] == [
        "a new needle"]  # fmt: skip
    assert trips.count == 4  # what is new: the stream's end, inboxes, channels; the line
    again.close()


@pytest.mark.parametrize("agents", [4, 24])
def test_the_tails_of_every_inbox_cost_two_round_trips_whatever_the_team(
    home: Path, monkeypatch: pytest.MonkeyPatch, agents: int
) -> None:
    """tail --all reads each inbox's last lines, not the whole inbox, and all of them at
    once: two round trips for the team, as a rule."""
    url = fresh_nats()
    names = _big_team(home, url, agents)
    store = store_of(home, url)
    expected = [store._tail_of(store._subject(name), 2) for name in names]
    trips = RoundTrips(monkeypatch)
    assert store.read_tails(names, 2) == expected
    assert trips.count == 2
    store.close()


def test_a_claim_whose_cursor_could_not_be_written_writes_it_at_the_next_read(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cursor a new consumer writes as it claims (the fence) failing once leaves
    the claim taken: the next read writes it, and its commit is not taken for another
    consumer's."""
    from ralph_mail.errors import StoreError
    from ralph_mail.store.nats.claims import Claims

    url = fresh_nats()
    team_of(home, url)
    with MessageBus("demo", "lead", home, backend=url) as lead:
        lead.send("w", "text", "zero")
        assert cli(home, url, "read", "--agent", "w").returncode == 0  # (another process)
        lead.send("w", "text", "one")
    stamp, failed = Claims._stamp, []

    def once(self: Claims, agent: str) -> None:
        if not failed:
            failed.append(agent)
            raise StoreError("the network went")
        stamp(self, agent)

    monkeypatch.setattr(Claims, "_stamp", once)
    with MessageBus("demo", "w", home, backend=url) as w:
        with pytest.raises(StoreError, match="the network went"):
            w.poll()
        assert [m.content for m in w.poll()] == ["one"]
    with MessageBus("demo", "w", home, backend=url) as again:
        assert again.poll() == []
