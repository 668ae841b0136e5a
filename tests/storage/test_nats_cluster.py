"""A team on a three-node JetStream cluster (streams and buckets at three replicas,
every write synced: `tests.helpers.cluster`) whose stream leader is killed -9 while a
sender sends, a reader reads, an ask waits for its answer and a `wait` waits: every
acknowledged send is delivered once, the ask and the wait end, and nothing hangs
(every child bounded, killed after the test whatever happens; the servers too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ralph_mail import create_team
from ralph_mail.store import backend
from ralph_mail.store.nats.push import Loop
from tests.helpers.cluster import Cluster, Server
from tests.helpers.processes import BOUND_S, Processes, cli_env, wait_until

#: Sends the sender makes; the leader is killed once a third of them are acknowledged.
SENDS = 300

SENDER = """
import sys
from ralph_mail import MessageBus
from ralph_mail.errors import MailError
bus = MessageBus("demo", "lead", sys.argv[1], backend=sys.argv[2])
for n in range(int(sys.argv[3])):
    try:
        sent = bus.send("r", "text", f"m{n}")
    except MailError as exc:  # not acknowledged: may or may not be delivered
        print("failed", n, exc, flush=True)
        continue
    print(sent.id, flush=True)
bus.close()
"""
READER = """
import sys, threading
from ralph_mail import MessageBus
from ralph_mail.store.outage import patient
bus = MessageBus("demo", "r", sys.argv[1], backend=sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with patient(stop=stop):
    while not stop.is_set():
        for message in bus.wait_for_messages(1.0, stop=stop):
            print(message.id, flush=True)
bus.close()
"""


class Lines:
    """A child's stdout lines, read as they come on a thread of their own."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.lines: list[str] = []
        self.at: list[float] = []  # when each came (monotonic)
        assert proc.stdout is not None
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
            self.lines.append(raw.decode().strip())
            self.at.append(time.monotonic())

    def done(self) -> None:
        self._thread.join(BOUND_S)


def _replicated(store, stream: str) -> str:  # type: ignore[no-untyped-def]
    """Wait until ``stream`` has three replicas, all current; return its leader's name."""
    leader = ""

    def current() -> bool:
        nonlocal leader
        info = store._api(f"STREAM.INFO.{stream}", {})
        assert info["config"]["num_replicas"] == 3, info["config"]
        cluster = info.get("cluster", {})
        leader = cluster.get("leader", "")
        replicas = cluster.get("replicas") or []
        return bool(leader) and sum(bool(r.get("current")) for r in replicas) == 2

    wait_until(current, f"{stream} to have three current replicas")
    return leader


def test_killing_the_stream_leader_mid_traffic_loses_no_acknowledged_send_and_hangs_nothing(
    home: Path,
    tmp_path: Path,
    servers: Callable[..., Server],
    procs: Processes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = Cluster(servers, tmp_path / "node.conf").start()
    for index in range(3):  # every write synced before it is acknowledged
        assert cluster.varz(index)["jetstream"]["config"]["sync_always"] is True  # type: ignore[index]
    url = cluster.url
    create_team("solo", ["lead"], home=home, backend=url)  # one replica, by default
    monkeypatch.setenv("RALPH_NATS_REPLICAS", "3")
    create_team("demo", ["lead", "w", "r", "idle"], home=home, backend=url)
    solo = backend(home, url).team_store("solo")
    assert solo._api(f"STREAM.INFO.{solo.stream}", {})["config"]["num_replicas"] == 1
    backend(home, url).remove_team("solo")  # (beside teams of other replicas)
    store = backend(home, url).team_store("demo")
    leader = _replicated(store, store.stream)
    _replicated(store, f"KV_{store.stream}")

    env = cli_env(home, RALPH_BACKEND=url, RALPH_TEAM="demo", RALPH_NATS_TIMEOUT_S="30")
    go = tmp_path / "go"  # the responder answers once it is there: after the kill
    python = [sys.executable, "-m", "ralph_mail"]
    answer = f'while [ ! -e {go} ]; do sleep 0.05; done; echo "answer: $(tail -n 1)"'
    children = {
        "run": [*python, "run", "--agent", "w", "--", "sh", "-c", answer],
        "wait": [*python, "wait", "--agent", "idle", "--timeout", str(BOUND_S)],
    }
    started = {name: subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name, argv in children.items()}  # fmt: skip
    procs.started += started.values()
    reader = procs.python(READER, str(home), url, env=env)
    read = Lines(reader)
    claimed = ("w", "idle", "r")
    wait_until(lambda: None not in map(store.consumer, claimed), "run, wait and reader to claim")
    asking = subprocess.Popen([*python, "ask", "w", "still there?", "--timeout", str(BOUND_S),
                               "--agent", "lead"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    procs.started.append(asking)
    wait_until(lambda: store.size("w") > 0, "the question to be sent")
    sender = procs.python(SENDER, str(home), url, str(SENDS), env=env)
    sent = Lines(sender)
    wait_until(lambda: len(sent.lines) >= SENDS // 3, "a third of the sends")

    # The stream's leader now (it may have moved since the team was made).
    leader = store._api(f"STREAM.INFO.{store.stream}", {})["cluster"]["leader"] or leader
    store.close()
    doomed = cluster.nodes[cluster.index_of(leader)]
    link = Loop.of(",".join([doomed.url, *(n.url for n in cluster.nodes if n is not doomed)]))
    assert link.nc.connected_url.port == doomed.port  # nats-py's, to the leader's server
    killed_at = time.monotonic()
    doomed.stop(signal.SIGKILL)
    go.touch()
    during = subprocess.run([*python, "send", "idle", "after the kill", "--agent", "lead"],
                            env=env, stdin=subprocess.DEVNULL, capture_output=True,
                            timeout=BOUND_S)  # fmt: skip
    assert during.returncode == 0, during.stderr

    wait_until(lambda: link.nc.is_connected and link.nc.connected_url.port != doomed.port,
               "nats-py to connect to another server")  # fmt: skip

    assert sender.wait(timeout=BOUND_S) == 0, sender.stderr.read()  # type: ignore[union-attr]
    assert link.run(link.js.account_info()).streams >= 2  # (the election over by now)
    sent.done()
    acked = [line for line in sent.lines if not line.startswith("failed")]
    assert any(at > killed_at for at in sent.at), "the sends ended before the kill"
    assert len(acked) >= SENDS // 3
    wait_until(lambda: set(acked) <= set(read.lines), "every acknowledged send to be read")
    assert asking.wait(timeout=BOUND_S) == 0, asking.stderr.read()  # type: ignore[union-attr]
    assert asking.stdout.read() == b"answer: still there?\n"  # type: ignore[union-attr]
    waiting = started["wait"]
    assert waiting.wait(timeout=BOUND_S) == 0, waiting.stderr.read()  # type: ignore[union-attr]
    assert b"after the kill" in waiting.stdout.read()  # type: ignore[union-attr]

    reader.stdin.close()  # type: ignore[union-attr]
    assert reader.wait(timeout=BOUND_S) == 0, reader.stderr.read()  # type: ignore[union-attr]
    read.done()
    assert len(read.lines) == len(set(read.lines)), "a message was delivered twice"
    unacked = set(read.lines) - set(acked)  # a send that failed may have been stored
    assert len(unacked) <= SENDS - len(acked)
    started["run"].send_signal(signal.SIGTERM)
    assert started["run"].wait(timeout=BOUND_S) == 0, started["run"].stderr.read()  # type: ignore[union-attr]
    assert os.path.exists(go)
