"""The NATS JetStream backend beyond the contract suites (which run on it too): real
processes through the command line, retried sends, a server restart, doctor."""

from __future__ import annotations

import contextlib
import gc
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ralph_mail import MessageBus, create_team
from tests.helpers.backends import fresh_nats, start_nats
from tests.helpers.processes import BOUND_S, Processes, cli_env, wait_until


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


#: A consumer that handles each message (records its id), then commits; it is told
#: through argv[3] to die (kill -9 itself) right after handling message number N.
CONSUMER = """
import os, signal, sys
from ralph_mail import MessageBus
bus = MessageBus("demo", "w", sys.argv[1], backend=sys.argv[2])
die_after, handled = int(sys.argv[3]), 0
with open(sys.argv[4], "a") as seen:
    while handled < 50:
        for message in bus.wait_for_messages(5, consume=False):
            seen.write(message.id + "\\n")
            seen.flush()
            handled += 1
            if handled == die_after:
                os.kill(os.getpid(), signal.SIGKILL)  # handled, not yet committed
            bus.commit(message)
"""


def test_a_consumer_killed_between_handling_and_committing_gets_it_again(
    home: Path, tmp_path: Path, procs: Processes
) -> None:
    """kill -9 after handling, before committing: once its lease lapses, the next
    consumer gets that message again (at least once), and ids make it handled once.
    Commits are stored in the background: the last ones before a kill -9 may not be,
    so the next consumer may start a few messages earlier, never later."""
    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    lead = MessageBus("demo", "lead", home, backend=url)
    sent = [lead.send("w", "text", f"job {n}").id for n in range(50)]
    seen = tmp_path / "seen"
    env = cli_env(home, RALPH_NATS_LEASE_S="1")
    first = procs.python(CONSUMER, str(home), url, "20", str(seen), env=env)
    assert first.wait(timeout=BOUND_S) == -9
    deadline = time.monotonic() + BOUND_S
    while lead.store.consumer("w") is not None:  # its lease lapses (1 s here, 10 s by default)
        assert time.monotonic() < deadline, "the killed consumer's lease never lapsed"
        time.sleep(0.05)
    second = procs.python(CONSUMER, str(home), url, "0", str(seen), env=env)
    second.stdin.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + BOUND_S
    while len(set(seen.read_text().split())) < 50:
        assert time.monotonic() < deadline and second.poll() in (None, 0), second.stderr.read()  # type: ignore[union-attr]
        time.sleep(0.05)
    handled = seen.read_text().split()
    assert handled[:20] == sent[:20] and handled[20] in sent[:20]  # the 20th comes again
    assert list(dict.fromkeys(handled)) == sent  # by id: each once, in order
    lead.close()


def test_every_acknowledged_send_is_delivered_once_across_a_server_restart(
    home: Path, tmp_path: Path
) -> None:
    """A sender retries each send under its id until the server acknowledges it while
    the server is stopped and started again mid-stream; the consumer gets every
    acknowledged message exactly once, in order."""
    from ralph_mail.errors import MailError

    server, url = start_nats(tmp_path / "js")
    port = int(url.rsplit(":", 1)[1])
    try:
        create_team("demo", ["lead", "w"], home=home, backend=url)
        lead = MessageBus("demo", "lead", home, backend=url)
        w = MessageBus("demo", "w", home, backend=url)
        acknowledged: list[str] = []
        received: list[str] = []
        for n in range(60):
            if n == 30:  # mid-stream: the server goes away and comes back
                server.terminate()
                server.wait(timeout=BOUND_S)
                server, _ = start_nats(tmp_path / "js", port)
            message_id = f"{n:012x}"
            deadline = time.monotonic() + BOUND_S
            while True:
                try:
                    acknowledged.append(lead.send("w", "text", f"m{n}", id=message_id).id)
                    break
                except MailError:
                    assert time.monotonic() < deadline, "the client never reconnected"
            if n % 7 == 0:
                received += [m.id for m in w.poll()]
        received += [m.id for m in w.poll()]
        assert received == acknowledged == [f"{n:012x}" for n in range(60)]
        lead.close()
        w.close()
    finally:
        server.terminate()
        server.wait(timeout=BOUND_S)


def test_backend_is_an_option_of_every_command(tmp_path: Path) -> None:
    """--backend URL before or after the command selects the server; after '--' it is
    the runner's command's own."""
    from ralph_mail.cli.app import _backend_option

    url = fresh_nats()
    env = cli_env(tmp_path)
    made = cli(env, "--backend", url, "team", "create", "demo", "--member", "lead")
    assert made.returncode == 0, made.stderr
    listed = cli(env, "team", "list", f"--backend={url}")
    assert listed.returncode == 0 and b"demo" in listed.stdout
    assert b"demo" not in cli(env, "team", "list").stdout  # files: no such team there
    assert _backend_option(["run", "--", "tool", "--backend", "x"]) == [
        "run", "--", "tool", "--backend", "x"]  # fmt: skip


#: Sends and reads, then says which of nats-py and asyncio it imported.
ONE_OFF = """
import sys
from ralph_mail import MessageBus
lead = MessageBus("demo", "lead", sys.argv[1], backend=sys.argv[2])
lead.send("w", "text", "hello")
w = MessageBus("demo", "w", sys.argv[1], backend=sys.argv[2])
print([m.content for m in w.poll()], "nats" in sys.modules, "asyncio" in sys.modules)
w.close()
lead.close()
"""


def test_a_one_off_command_talks_to_the_server_without_nats_py(home: Path) -> None:
    """Sends, reads and the bucket's keys go over natswire: a command that does not
    wait never imports nats-py (nor asyncio), and starts the sooner for it."""
    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    done = subprocess.run([sys.executable, "-c", ONE_OFF, str(home), url], capture_output=True,
                          text=True, timeout=BOUND_S)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['hello']", "False", "False"]


def test_a_server_never_reached_is_said_at_once(tmp_path: Path) -> None:
    """No server at the URL: one line naming it and the fix, exit 2, no waiting for a
    server to come back (that is for one that was there)."""
    env = cli_env(tmp_path, RALPH_BACKEND="nats://127.0.0.1:1")
    sent = cli(env, "send", "w", "hello", "--team", "demo", "--agent", "lead")
    assert sent.returncode == 2
    assert sent.stderr.startswith(b"ralph-mail: error: cannot reach the NATS server at "
                                  b"nats://127.0.0.1:1")  # fmt: skip
    assert b"start it (nats-server -js)" in sent.stderr and sent.stderr.count(b"\n") == 1


def test_a_forked_child_makes_none_of_its_parents_background_writes(home: Path) -> None:
    """Index entries and cursors still being written when a process forks stay the
    parent's: the child's close does not wait for them, nor write them again."""
    import os

    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    lead = MessageBus("demo", "lead", home, backend=url)
    for n in range(20):
        lead.send("w", "text", f"before {n}")  # each leaves index entries to write
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports by its exit status
        code = 1
        try:
            mine = MessageBus("demo", "lead", home, backend=url)
            mine.send("w", "text", "from the child")
            mine.close()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + BOUND_S
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0:
        assert time.monotonic() < deadline, "the child never finished"
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    lead.close()
    pair = MessageBus("demo", "w", home, backend=url).history("lead", 100)
    assert [m.content for m in pair] == [f"before {n}" for n in range(20)] + ["from the child"]


def test_a_waiter_whose_consumer_the_server_forgot_makes_it_again(home: Path) -> None:
    """A waiter's consumer lives in the server's memory: gone (a restart, an idle hour),
    the wait returns for a read, and the next one is woken by the next line again."""
    from ralph_mail.store import backend

    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    store = backend(home, url).team_store("demo")
    lead = MessageBus("demo", "lead", home, backend=url)
    waiter = store.waiter(["w"])
    try:
        gone = store._api(f"CONSUMER.DELETE.{store.stream}.{waiter._name}", {})  # type: ignore[attr-defined]
        assert gone.get("success"), gone
        assert waiter.wait(BOUND_S)  # it found its consumer gone: look again
        lead.send("w", "text", "after")
        assert waiter.wait(BOUND_S)
        assert [m.content for m in MessageBus("demo", "w", home, backend=url).poll()] == ["after"]
    finally:
        waiter.close()
        lead.close()
        store.close()


def _trips(monkeypatch: pytest.MonkeyPatch, pulled: Callable[[], object]) -> list[str]:
    """The subjects of the requests this thread makes from now on (`Wire.request`, a
    publish whose answer is read later: `Wire.send`, `Wire.many`, a pull asked for:
    `Wire._pull`), and "pull" where it first waits for
    a pull's line (`Wire.pulled`); ``pulled()`` is called on another thread then."""
    from ralph_mail.store.nats.wire import Wire

    trips: list[str] = []
    me = threading.get_ident()
    for name in ("request", "send", "many", "_pull", "pulled"):
        made = getattr(Wire, name)

        def counted(wire: Wire, ask: object, *args: object, _made: Any = made,
                    _name: str = name, **kw: Any) -> Any:  # fmt: skip
            if threading.get_ident() == me:
                if _name == "pulled":
                    if "pull" not in trips:
                        trips.append("pull")
                        threading.Thread(target=pulled).start()  # (stored as it waits)
                else:
                    trips.append(ask if isinstance(ask, str) else "many")
            return _made(wire, ask, *args, **kw)

        monkeypatch.setattr(Wire, name, counted)
    return trips


def test_a_wait_woken_by_the_last_line_reads_it_without_asking_the_server_again(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pull that woke a wait brought the line, and said nothing follows it: the read
    after it costs no round trip, and neither does the look for more: the one request
    after the pull is the commit (sent, its answer read later; the inbox's start comes
    from the bucket's watch, which runs from a process's few first looks on). A `poll`
    after it still asks the server, and gets a line another thread stored since."""
    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    with MessageBus("demo", "lead", home, backend=url) as lead, \
            MessageBus("demo", "w", home, backend=url) as bus:  # fmt: skip
        bus.poll()  # (an empty inbox: the first look is the server's)
        # The bucket's watch running (started by a process's first few looks, on a
        # thread of its own): until it is, a look at the inbox's start asks the server.
        store: Any = bus.store
        wait_until(lambda: store.load_presence("w") and store._cache is not None, "the watch")
        trips = _trips(monkeypatch, lambda: lead.send("w", "text", "hi"))
        assert [m.content for m in bus.wait_for_messages(BOUND_S)] == ["hi"]
        after = trips[trips.index("pull") + 2 :]  # (the pull marked, then made)
        assert not [s for s in after if "DIRECT.GET" in s or s == "many"], trips
        assert [s for s in after if ".cursor." in s] == [s for s in after if "$KV." in s], trips
        assert len([s for s in after if ".cursor." in s]) == 1, trips
        sending = threading.Thread(target=lead.send, args=("w", "text", "next"))
        sending.start()  # (another thread: this one has made no round trip since)
        sending.join(BOUND_S)
        del trips[:]
        assert [m.content for m in bus.poll()] == ["next"]
        assert trips[0].startswith("$JS.API.DIRECT.GET."), trips  # poll asks the server


@pytest.mark.parametrize("batch", [16, 1], ids=["pull-standing", "pull-ended"])
def test_a_wait_after_lines_read_without_it_is_woken_by_news_alone(
    home: Path, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """Lines that came while nobody waited are read, not pulled. The next wait skips
    them without returning, and is woken by the line sent while it waits, which it
    brings: no read of the inbox after the pull. Its standing pull brought them as they
    came, and it drops them; or its pull had ended (here after one line), its consumer
    is behind by the others, and it starts its consumer again after them."""
    from ralph_mail.store.nats import waiter

    monkeypatch.setattr(waiter, "PULL_BATCH", batch)
    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    with MessageBus("demo", "lead", home, backend=url) as lead, \
            MessageBus("demo", "w", home, backend=url) as bus:  # fmt: skip
        assert bus.wait_for_messages(0.05) == []  # (its waiter made: from the end on)
        for n in range(3):
            lead.send("w", "text", f"while away {n}")
        assert [m.content for m in bus.poll()] == [f"while away {n}" for n in range(3)]
        store: Any = bus.store  # (its bucket's watch running: see the test above)
        wait_until(lambda: store.load_presence("w") and store._cache is not None, "the watch")
        trips = _trips(monkeypatch, lambda: lead.send("w", "text", "news"))
        assert [m.content for m in bus.wait_for_messages(BOUND_S)] == ["news"]
        assert "DIRECT.GET" in trips[0], trips  # (not caught up: it read before waiting)
        after = trips[trips.index("pull") + 1 :]
        assert not [s for s in after if "DIRECT.GET" in s or s == "many"], trips
        made_again = [s for s in after if "CONSUMER.CREATE" in s]
        assert bool(made_again) == (batch == 1), trips  # (caught up at once)


def test_a_wait_whose_consumer_is_caught_up_pulls_first(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait after one that the pull woke (its consumer where the reading stopped)
    makes no read before it pulls: the pull brings at once what came since, so mail sent
    while nobody waited is returned at once all the same."""
    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    with MessageBus("demo", "lead", home, backend=url) as lead, \
            MessageBus("demo", "w", home, backend=url) as bus:  # fmt: skip
        assert bus.wait_for_messages(0.05) == []
        sending = threading.Timer(0.05, lead.send, args=("w", "text", "first"))
        sending.start()  # (while it waits: the pull brings it)
        assert [m.content for m in bus.wait_for_messages(BOUND_S)] == ["first"]
        sending.join(BOUND_S)
        store: Any = bus.store  # (its bucket's watch running: see the test above)
        wait_until(lambda: store.load_presence("w") and store._cache is not None, "the watch")
        lead.send("w", "text", "while away")
        trips = _trips(monkeypatch, lambda: None)
        assert [m.content for m in bus.wait_for_messages(BOUND_S)] == ["while away"]
        assert trips[0] == "pull", trips  # (no read first: its pull stands, and brings it)
        assert not [s for s in trips if "DIRECT.GET" in s], trips
        trips = _trips(monkeypatch, lambda: lead.send("w", "text", "news"))
        assert [m.content for m in bus.wait_for_messages(BOUND_S)] == ["news"]
        assert trips[0] == "pull" and not [s for s in trips if "DIRECT.GET" in s], trips


def test_standing_pulls_hold_no_more_than_a_batch_and_nothing_once_closed(home: Path) -> None:
    """A waiter's pull stands on its thread's connection: what comes for it while the
    thread makes other requests is held there, a batch at most (`PULL_BATCH`), and a
    waiter closed leaves nothing behind, however many came and went."""
    from ralph_mail.store import backend
    from ralph_mail.store.nats.stream import PULL_BATCH
    from ralph_mail.store.nats.wire import Wire

    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    store = backend(home, url).team_store("demo")
    wire = Wire.for_thread(url)
    before = set(wire._pulls)  # (those of buses other tests left open)
    with MessageBus("demo", "lead", home, backend=url) as lead:
        for n in range(40):
            waiter = store.waiter(["w"])
            assert not waiter.wait(0.01)  # (its pull stands from here on)
            lead.send("w", "text", f"{n}")  # (this thread: held while the send's ack comes)
            assert waiter.wait(BOUND_S)
            waiter.close()
        assert set(wire._pulls) == before
        waiter = store.waiter(["w"])
        try:
            assert not waiter.wait(0.01)
            for n in range(3 * PULL_BATCH):
                lead.send("w", "text", f"more {n}")
            held = wire._pulls[waiter._name].held
            assert 0 < len(held) <= PULL_BATCH
        finally:
            waiter.close()
    assert set(wire._pulls) == before and set(wire._pulled_by.values()) <= before
    del waiter  # dropped without a close: its pull is forgotten all the same
    waiter = store.waiter(["w"])
    assert not waiter.wait(0.01) and waiter._name in wire._pulls
    name = waiter._name
    del waiter
    gc.collect()
    assert name not in wire._pulls
    store.close()


@contextlib.contextmanager
def _waiting_on_w(home: Path) -> Iterator[tuple[str, Any, Any]]:
    """Team "demo" (lead, w) on a fresh server, a store of it and a waiter on w's inbox:
    ``(url, store, waiter)``, both closed after."""
    from ralph_mail.store import backend

    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    store = backend(home, url).team_store("demo")
    waiter = store.waiter(["w"])
    try:
        yield url, store, waiter
    finally:
        waiter.close()
        store.close()


def test_a_wait_in_another_thread_than_the_last_starts_its_consumer_again(home: Path) -> None:
    """A line that came while the waiter's pull stood on another thread's connection
    went there: a wait in this thread makes the consumer again and returns at once (for
    a read of what came), and the waits after it are woken by this thread's pull."""
    from ralph_mail.store.nats.wire import Wire

    wires: list[Wire] = []
    with _waiting_on_w(home) as (url, _, waiter), \
            MessageBus("demo", "lead", home, backend=url) as lead:  # fmt: skip
        elsewhere = threading.Thread(
            target=lambda: (waiter.wait(0.01), wires.append(Wire.for_thread(url)))
        )
        elsewhere.start()  # (its pull stands on that thread's connection)
        elsewhere.join(BOUND_S)
        first = waiter._name
        assert first in wires[0]._pulls
        lead.send("w", "text", "while it stood there")
        assert waiter.wait(BOUND_S)  # at once, for a read
        assert waiter._name != first and first not in wires[0]._pulls
        sending = threading.Timer(0.05, lead.send, args=("w", "text", "news"))
        sending.start()
        assert waiter.wait(BOUND_S)
        sending.join(BOUND_S)
        assert waiter._name in Wire.for_thread(url)._pulls


def test_a_standing_pull_whose_connection_broke_wakes_its_waiter(home: Path) -> None:
    """A line the server sent to a standing pull as its connection broke is lost to it
    (its consumer counts it delivered, with no acks): so a wait after the break makes its
    consumer again and returns at once, for a read that finds what came."""
    from ralph_mail.store.nats.wire import Wire

    with _waiting_on_w(home) as (url, store, waiter), \
            MessageBus("demo", "lead", home, backend=url) as lead:  # fmt: skip
        assert not waiter.wait(0.01)  # (its pull stands)
        Wire.for_thread(url).close()  # (as a request that met a broken one does)
        elsewhere = threading.Thread(target=lead.send, args=("w", "text", "meanwhile"))
        elsewhere.start()  # (another thread's connection: this one stays closed)
        elsewhere.join(BOUND_S)
        first = waiter._name
        assert waiter.wait(BOUND_S)
        assert waiter._name != first
        data, _ = store.read("w", 0)
        assert b"meanwhile" in data


def test_what_a_store_keeps_of_the_lines_it_met_is_bounded(home: Path) -> None:
    """A long-lived store keeps, of each subject, the stream sequences of the newest
    offsets it met (`SEQS_KEPT`) and the newest lines its waiters pulled (`KEPT_LINES`,
    `KEPT_BYTES`): no more, however many messages it handles."""
    from ralph_mail.store.nats.stream import KEPT_BYTES, KEPT_LINES, SEQS_KEPT

    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    with MessageBus("demo", "lead", home, backend=url) as lead, \
            MessageBus("demo", "w", home, backend=url) as w:  # fmt: skip
        for n in range(3 * SEQS_KEPT):
            lead.send("w", "text", f"{n}")
        assert len(w.poll()) == 3 * SEQS_KEPT
        for text in [*map(str, range(KEPT_LINES + 8)), *(f"{n}" * (KEPT_BYTES // 3)
                                                       for n in range(4))]:  # fmt: skip
            sending = threading.Timer(0.005, lead.send, args=("w", "text", text))
            sending.start()  # (while it waits: the line comes with the pull, and is kept)
            assert [m.content for m in w.wait_for_messages(BOUND_S)] == [text]
            sending.join(BOUND_S)
        stores: list[Any] = [lead.store, w.store]
        assert all(len(known) <= SEQS_KEPT for s in stores for known in s._seqs.values())
        kept = [(lines, s._kept_bytes[subject]) for s in stores
                for subject, lines in s._kept.items()]  # fmt: skip
        assert kept and all(len(lines) <= KEPT_LINES for lines, _ in kept)
        sizes = [sum(len(line) for line, _, _ in lines.values()) for lines, _ in kept]
        assert all(size <= KEPT_BYTES for size in sizes)
        assert sizes == [counted for _, counted in kept]  # (the count kept as it goes)


def test_lines_read_by_another_thread_wake_a_waiter(home: Path) -> None:
    """What a waiter skips is what its own thread read: a line another thread of the
    process read (a history, a page) is still news to it."""
    with _waiting_on_w(home) as (url, store, waiter):
        with MessageBus("demo", "lead", home, backend=url) as lead:
            lead.send("w", "text", "hi")
        read: list[bytes] = []
        reading = threading.Thread(target=lambda: read.append(store.read("w", 0)[0]))
        reading.start()
        reading.join(BOUND_S)
        assert read and b'"hi"' in read[0]
        assert waiter.wait(BOUND_S)


def test_background_writes_queued_meanwhile_go_in_one_write(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Index entries and commit times queued while the background thread is busy go out
    together: one write, each index's entries in one message (here the pair's three). A
    write that failed is
    made again, each message alone; nothing is lost either way."""
    from ralph_mail.errors import StoreError
    from ralph_mail.store.nats import background
    from ralph_mail.store.nats.wire import Wire

    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    batches: list[list[str]] = []
    made = Wire.publish_all

    def recorded(wire: Wire, posts: list[Any], **kw: Any) -> Any:
        batches.append([subject for subject, _, _ in posts])
        if len(batches) == 1:
            raise StoreError("the write failed")  # (each is published again, alone)
        return made(wire, posts, **kw)

    monkeypatch.setattr(Wire, "publish_all", recorded)
    pair = ".ix." + b"pair+lead+w".hex()
    with MessageBus("demo", "lead", home, backend=url) as lead, \
            MessageBus("demo", "w", home, backend=url) as w:  # fmt: skip
        sent = []
        for round in range(2):
            busy = threading.Event()
            background.later(busy.wait, BOUND_S)  # (the thread held: the writes queue)
            sent += [lead.send("w", "text", f"{round}.{n}") for n in range(3)]
            del batches[round:]
            busy.set()
            background.flush()
            assert len(batches) == round + 1, batches  # (lead's store: one write)
            assert len([s for s in batches[round] if s.endswith(pair)]) == 1, batches
        assert [m.content for m in w.poll()] == [m.content for m in sent]
        assert [m.id for m in w.history("lead", 10)] == [m.id for m in sent]
        background.flush()
        assert lead.receipts(sent[-1])[0].consumed_at is not None


def test_background_writes_are_spaced_and_a_flush_does_not_wait(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first background write after a quiet spell goes at once; those that come
    within `SPACING_S` of it wait and go together; a flush sends them without waiting
    for the spacing (here one long enough to fail the test if it did)."""
    from ralph_mail.store.nats import background
    from ralph_mail.store.nats.wire import Wire

    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    made, writes = Wire.publish_all, queue.SimpleQueue[list[str]]()

    def recorded(wire: Wire, posts: list[Any], **kw: Any) -> Any:
        done = made(wire, posts, **kw)
        writes.put([subject for subject, _, _ in posts])
        return done

    monkeypatch.setattr(Wire, "publish_all", recorded)
    pair = ".ix." + b"pair+lead+w".hex()
    with MessageBus("demo", "lead", home, backend=url) as lead, \
            MessageBus("demo", "w", home, backend=url) as w:  # fmt: skip
        background.flush()  # (what opening the buses wrote; then a quiet thread)
        monkeypatch.setattr(background, "_BACKGROUND", background._Background())
        monkeypatch.setattr(background, "SPACING_S", 4 * BOUND_S)
        while not writes.empty():
            writes.get()
        sent = [lead.send("w", "text", "first")]
        assert any(s.endswith(pair) for s in writes.get(timeout=BOUND_S))  # at once
        sent += [lead.send("w", "text", f"then {n}") for n in range(3)]
        assert writes.empty()  # (held: the spacing is long)
        background.flush()
        assert writes.qsize() == 1, "the three sends' entries, in one write"
        assert [m.id for m in w.history("lead", 10)] == [m.id for m in sent]


def test_history_is_the_last_messages_while_background_writes_lag(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each store batches its index entries while the background thread is busy, so a
    pair's index gets [L1 L2] after [W1], [W2 W3] after [L3]: its tail is put back in
    the order the lines were stored in (each message gives its entries' stream
    sequences in a header), and history is still the last messages, from a lagging
    thread as from a quick one."""
    from ralph_mail.store.nats.stream import TeamStream

    made = TeamStream._acked_all

    def lagging(store: TeamStream, posts: list[Any]) -> None:
        time.sleep(0.03)  # (a loaded machine: the entries queue up meanwhile)
        made(store, posts)

    monkeypatch.setattr(TeamStream, "_acked_all", lagging)
    url = fresh_nats()
    create_team("demo", ["lead", "w", "other"], home=home, backend=url)
    with MessageBus("demo", "lead", home, backend=url) as lead, \
            MessageBus("demo", "w", home, backend=url) as w, \
            MessageBus("demo", "other", home, backend=url) as other:  # fmt: skip
        for n in range(5):
            lead.send("w", "text", f"L{n}")
            w.send("lead", "text", f"W{n}")
            other.send("lead", "text", "noise")
        assert [m.content for m in lead.history("w", 4)] == ["L3", "W3", "L4", "W4"]
        assert [m.content for m in w.history("lead", 2)] == ["L4", "W4"]


def test_a_watch_whose_consumer_went_silent_starts_again(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bucket's watch hears the server's heartbeats; its consumer gone without a
    reconnect (its server killed, on a cluster), it starts again after three missed, and
    sees the changes made since."""
    from ralph_mail.store import backend
    from ralph_mail.store.nats.push import Keys

    monkeypatch.setattr(Keys, "HEARTBEAT_S", 0.2)
    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    store, other = (backend(home, url).team_store("demo") for _ in range(2))
    try:
        wait_until(lambda: store.state_version("x") is None and store._keys is not None,
                   "the watch to start")  # fmt: skip
        keys = store._keys
        assert keys is not None
        first = keys._consumer
        assert store._api(f"CONSUMER.DELETE.KV_{store.stream}.{first}", {}).get("success")
        other.save_state("x", b"after")
        wait_until(lambda: store.state_version("x") is not None, "the watch to see it")
        assert keys._consumer != first
    finally:
        store.close()
        other.close()


def test_a_message_over_the_servers_max_payload_is_one_clear_error(home: Path) -> None:
    """The bus takes lines up to 1 MiB and a NATS server's max_payload is 1 MiB with the
    headers: the few lines in between are refused, named, and nothing is stored."""
    from ralph_mail.errors import StoreError

    url = fresh_nats()
    create_team("demo", ["lead", "w"], home=home, backend=url)
    lead = MessageBus("demo", "lead", home, backend=url)
    try:
        with pytest.raises(StoreError, match=r"max_payload .*: send less, or raise max_payload"):
            lead.send("w", "text", "x" * (1024 * 1024 - 200))
        lead.send("w", "text", "small")
        assert [m.content for m in MessageBus("demo", "w", home, backend=url).poll()] == ["small"]
    finally:
        lead.close()


def test_team_log_records_naming_one_message_are_all_kept(home: Path) -> None:
    """A team log's records are not sends: two naming the same message id (a held message,
    then its approval) are both stored, so an approved message is delivered on NATS."""
    from ralph_mail.govern.policy import Policy, Rule

    url = fresh_nats()
    create_team("demo", ["lead", "a", "b"], home=home, backend=url)
    with (
        MessageBus("demo", "lead", home, backend=url) as lead,
        MessageBus("demo", "a", home, backend=url) as a,
        MessageBus("demo", "b", home, backend=url) as b,
    ):
        lead.store.log_append("probe", b'{"held":{"id":"0123456789ab"}}\n')
        lead.store.log_append("probe", b'{"decided":"x","id":"0123456789ab"}\n')
        assert len(lead.store.log_read("probe").splitlines()) == 2
        lead.store.save_state("policy", Policy((Rule("a", "b", "allow", True),)).to_json())
        kept = a.send("b", "text", "may I?")
        assert lead.approve(kept.id).decision is True
        assert [m.id for m in b.poll()] == [kept.id]


def test_a_stream_the_server_is_still_removing_is_made_once_it_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JetStream's 'error creating store for stream' (a team deleted and made again at
    once) is tried again until it passes, and so is a write that no server answers for
    (a stream just made in a cluster, its leader being elected); any other error, or
    one that lasts past its bound, is raised."""
    import asyncio

    from nats.js.errors import ServerError

    from ralph_mail.store.nats import backend

    calls: list[int] = []

    async def busy_twice() -> str:
        calls.append(1)
        if len(calls) <= 2:
            raise ServerError(code=500, err_code=10049, description="error creating store")
        return "made"

    assert asyncio.run(backend._made(busy_twice)) == "made" and len(calls) == 3

    async def other() -> str:
        raise ServerError(code=500, err_code=10071, description="wrong last sequence")

    with pytest.raises(ServerError):
        asyncio.run(backend._made(other))
    monkeypatch.setattr(backend, "_STORE_BUSY_S", 0.05)

    async def always() -> str:
        raise ServerError(code=500, err_code=10049, description="error creating store")

    with pytest.raises(ServerError):
        asyncio.run(backend._made(always))

    # A write into a stream just made in a cluster, whose leader is being elected: no
    # server answers for it (nothing was stored), tried again until one does.
    from nats.js.errors import NoStreamResponseError

    calls.clear()

    async def no_leader_twice() -> str:
        calls.append(1)
        if len(calls) <= 2:
            raise NoStreamResponseError
        return "stored"

    assert asyncio.run(backend._made(no_leader_twice)) == "stored" and len(calls) == 3
    monkeypatch.setattr(backend, "_NO_LEADER_S", 0.05)

    async def no_leader() -> str:
        raise NoStreamResponseError

    with pytest.raises(NoStreamResponseError):
        asyncio.run(backend._made(no_leader))
