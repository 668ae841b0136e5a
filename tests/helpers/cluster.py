"""nats-servers that a test starts and kills itself: one `Server` (a child of the test,
one port and one store directory across its restarts), or a `Cluster` of three with
JetStream, routed to each other on loopback, each syncing every write to disk
(``sync_interval: always``, as docs/backends.md advises for a cluster). Every wait is
bounded; the ``servers`` fixture (tests/conftest.py) kills whatever a test started,
whatever happens."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.helpers.processes import BOUND_S, wait_until

BINARY = shutil.which("nats-server") or str(Path(sys.executable).with_name("nats-server"))
#: What each node of a `Cluster` reads besides its command line: every write synced to
#: disk before it is acknowledged (the default syncs every 2 minutes, and a node killed
#: meanwhile can lose writes the cluster acknowledged: Jepsen, NATS 2.12.1).
CLUSTER_CONFIG = "jetstream {\n  sync_interval: always\n}\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """A nats-server child of one test: one port and one store directory across its
    restarts, started and stopped by pid; its log in ``log``."""

    def __init__(self, store: Path, options: tuple[str, ...]) -> None:
        self.store, self.options = store, options
        self.port = free_port()
        self.log = store.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> Server:
        self.proc = subprocess.Popen(
            [BINARY, "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store),
             "-l", str(self.log), *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + BOUND_S
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            assert self.proc.poll() is None, f"nats-server exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.02)

    def stop(self, how: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(how)
            self.proc.wait(timeout=BOUND_S)


class Cluster:
    """Three nats-servers with JetStream, ``n0`` to ``n2``, in one cluster on loopback
    (each routed to the others, each with a monitoring port), started by `start`."""

    def __init__(self, servers: Callable[..., Server], config: Path) -> None:
        config.write_text(CLUSTER_CONFIG)
        routes = [f"nats://127.0.0.1:{free_port()}" for _ in range(3)]
        self.monitors = [free_port() for _ in range(3)]
        self.nodes = [servers("-js", "-c", str(config), "-n", f"n{i}", "--cluster_name", "c",
                              "--cluster", routes[i], "--routes", ",".join(routes), "-m",
                              str(self.monitors[i])) for i in range(3)]  # fmt: skip

    @property
    def url(self) -> str:
        """The backend URL naming all three: ``nats://h:p,h:p,h:p``."""
        return ",".join(node.url for node in self.nodes)

    def start(self) -> Cluster:
        """Start the three, and return once JetStream has a meta leader."""
        from ralph_mail.store.nats.wire import Wire

        for node in self.nodes:
            node.start()

        def ready() -> bool:
            try:
                answer = Wire(self.nodes[0].url).request("$JS.API.INFO", b"", timeout=2.0)
            except (OSError, TimeoutError):
                return False
            return answer[0].status is None and "error" not in json.loads(answer[0].data)

        wait_until(ready, "the cluster's JetStream to elect a meta leader")
        return self

    def varz(self, index: int) -> dict[str, object]:
        """Node ``index``'s /varz (its configuration as it runs)."""
        where = f"http://127.0.0.1:{self.monitors[index]}/varz"
        with urllib.request.urlopen(where, timeout=BOUND_S) as answer:
            found: dict[str, object] = json.load(answer)
            return found

    def index_of(self, name: str) -> int:
        """The node whose ``server_name`` is ``name`` (``n1`` is 1)."""
        return int(name.removeprefix("n"))
