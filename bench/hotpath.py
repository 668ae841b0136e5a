"""The hot path over a long life: the cost of send and ask as a team's history grows, and
the memory and descriptors of a long-lived asker and responder.

* Send and ask in a team with little history (``growth_small`` messages, 10 threads)
  against one with much (``growth_big`` messages, ``growth_threads`` threads), both made
  through the library itself (every message indexed as a send indexes it), timed
  alternately in one run. A send's cost is its own (thread CPU time, the best of a few
  batches), beside a raw O_APPEND write and litequeue's put measured the same way (CPU
  time is what the load of a shared machine moves least); an ask's is its round trip to
  a replier process (p50), the asks to the two teams taking turns.
* A long-lived asker and responder, two processes, through ``rss_asks`` asks: the
  resident memory and the open descriptors of each at 1,000, 10,000 and 100,000 asks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Final

import orjson

from bench.ask import start_replier
from bench.common import (
    CONTENT,
    METADATA,
    Row,
    Section,
    Sizes,
    Workspace,
    child_env,
    message_dict,
    ralph,
)
from bench.common import percentile as pct
from bench.peers import PEERS, open_peer

#: Sends per timed batch, and batches per repetition (the best batch is kept).
SEND_BATCH: Final = 2_000
SEND_BATCHES: Final = 5
#: Asks per repetition of the ask rows.
ASKS: Final = 300
#: Where the long-lived pair reports its memory.
MARKS: Final = (1_000, 10_000, 100_000)

LONG_ASKER: Final = """
import os, sys, orjson
from ralph_mail import MessageBus
home, total, responder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
marks = set(orjson.loads(sys.argv[4]))

def status(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))

bus = MessageBus("long", "asker", home)
for n in range(1, total + 1):
    bus.ask("replier", f"question {n}", timeout=60)
    if n in marks:
        mine, theirs = status(os.getpid()), status(responder)
        print(orjson.dumps({"asks": n, "asker": mine, "responder": theirs}).decode(), flush=True)
bus.ask("replier", "that was all", timeout=60)  # the responder, measured alive, may go
"""


def _history(rm: ModuleType, home: Path, messages: int, threads: int) -> None:
    """A team whose history holds ``messages`` messages, ``threads`` of them threads (a
    request answered), made through the library."""
    rm.create_team("grow", ["sender", "reader", "asker", "replier"], home=home)
    sender = rm.MessageBus("grow", "sender", home=home)
    asker = rm.MessageBus("grow", "asker", home=home)
    replier = rm.MessageBus("grow", "replier", home=home)
    for n in range(threads):
        asker.send("replier", "request", f"thread {n}")
        for message in replier.poll():
            replier.reply(message, "answered")
    asker.poll()
    text = rm.MessageType.TEXT
    for _ in range(max(0, messages - 2 * threads)):
        sender.send("reader", text, CONTENT, metadata=METADATA)
    for bus in (sender, asker, replier):
        bus.close()


def _send_cost(rm: ModuleType, home: Path) -> float:
    """µs of thread CPU time per send into the team at ``home``: the best of a few batches."""
    bus = rm.MessageBus("grow", "sender", home=home)
    text, clock = rm.MessageType.TEXT, time.thread_time
    best = float("inf")
    try:
        for _ in range(SEND_BATCHES):
            t0 = clock()
            for _ in range(SEND_BATCH):
                bus.send("reader", text, CONTENT, metadata=METADATA)
            best = min(best, (clock() - t0) / SEND_BATCH * 1e6)
    finally:
        bus.close()
    return best


def _cpu_per_call(call: Callable[[], object]) -> float:
    """µs of thread CPU time per ``call()``: the best of `SEND_BATCHES` batches."""
    clock, best = time.thread_time, float("inf")
    for _ in range(SEND_BATCHES):
        t0 = clock()
        for _ in range(SEND_BATCH):
            call()
        best = min(best, (clock() - t0) / SEND_BATCH * 1e6)
    return best


def _exchange_cpu(rm: ModuleType, ws: Workspace, count: int) -> dict[str, float]:
    """µs of thread CPU time per phase of an ask's exchange run in one process, nobody
    waiting: the request sent, read by the replier, answered, the answer read (each
    consumed). What a round trip between two processes costs beyond this is waking up,
    and code run after a sleep on a core the other process used."""
    home = ws.fresh("exchange")
    rm.create_team("exchange", ["asker", "replier"], home=home)
    asker = rm.MessageBus("exchange", "asker", home=home)
    replier = rm.MessageBus("exchange", "replier", home=home)
    clock = time.thread_time
    phases = dict.fromkeys(("request", "read", "reply", "answer"), 0.0)
    try:
        for n in range(count + count // 10):
            t0 = clock()
            asker.send("replier", rm.MessageType.REQUEST, CONTENT)
            t1 = clock()
            (request,) = replier.poll()
            t2 = clock()
            replier.reply(request, CONTENT)
            t3 = clock()
            (_answer,) = asker.poll()
            t4 = clock()
            if n >= count // 10:  # the first tenth warms up
                for phase, spent in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3),
                                        strict=True):  # fmt: skip
                    phases[phase] += spent
    finally:
        asker.close()
        replier.close()
    return {phase: spent / count * 1e6 for phase, spent in phases.items()}


def _anchors_cpu(ws: Workspace, raw: Row, peer: Row) -> None:
    """The send's anchors in the same CPU time: a raw O_APPEND write of a line as long,
    and litequeue's put of the same message (when installed)."""
    path = ws.fresh("raw-cpu") / "inbox.jsonl"
    line = ws.line()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        raw.values.append(_cpu_per_call(lambda: os.write(fd, line)))
    finally:
        os.close(fd)
    litequeue = next(p for p in PEERS if p.key == "litequeue")
    opened = open_peer(litequeue, ws.fresh("litequeue-cpu"))
    if isinstance(opened, str):
        peer.status = opened
        return
    put, close = opened
    message = message_dict(0, ws.template())
    try:
        peer.values.append(_cpu_per_call(lambda: put(message)))
    finally:
        close()


def _ask_p50s(rm: ModuleType, homes: list[Path], count: int) -> list[float]:
    """The p50 round trip, µs, of ``count`` asks to a replier process in each team of
    ``homes``, the asks taking turns between the teams so that both meet the same load."""
    repliers = [start_replier(home, count + 5, "grow") for home in homes]
    buses = []
    try:
        buses = [rm.MessageBus("grow", "asker", home=home) for home in homes]
        for bus in buses:
            for _ in range(5):
                bus.ask("replier", "warm", timeout=30)
        times: list[list[float]] = [[] for _ in homes]
        for n in range(count):
            for bus, taken in zip(buses, times, strict=True):
                t0 = time.perf_counter()
                bus.ask("replier", str(n), timeout=30)
                taken.append((time.perf_counter() - t0) * 1e6)
        return [pct(taken, 50) for taken in times]
    finally:
        for bus in buses:
            bus.close()
        for replier in repliers:
            replier.wait(timeout=60)


def _long_lived(rm: ModuleType, ws: Workspace, asks: int, sec: Section) -> None:
    """RSS and descriptors of a long-lived asker and responder through ``asks`` asks."""
    home = ws.fresh("long")
    rm.create_team("long", ["asker", "replier"], home=home)
    marks = [mark for mark in MARKS if mark <= asks] or [asks]
    rows = {
        mark: sec.add(Row(f"rss_{mark}", f"long-lived asker: memory after {mark:,} asks", "MiB",
                          "lower", anchor=f"rss_{marks[0]}" if mark != marks[0] else None,
                          extra={"responder_mib": [], "asker_fds": [], "responder_fds": []}))
        for mark in marks
    }  # fmt: skip
    replier = start_replier(home, asks + 1, "long")
    try:
        asker = subprocess.run(
            [sys.executable, "-c", LONG_ASKER, str(home), str(asks), str(replier.pid),
             orjson.dumps(marks).decode()],
            capture_output=True, env=child_env(), timeout=max(600.0, asks / 50),
        )  # fmt: skip
        if asker.returncode != 0:
            for row in rows.values():
                row.status = f"failed: {asker.stderr.decode().strip()[-300:]}"
            return
        for line in asker.stdout.splitlines():
            found = orjson.loads(line)
            row = rows[found["asks"]]
            row.values.append(found["asker"][0])
            row.extra["asker_fds"].append(found["asker"][1])
            row.extra["responder_mib"].append(found["responder"][0])
            row.extra["responder_fds"].append(found["responder"][1])
    finally:
        replier.wait(timeout=60)


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Send and ask at small and big history; memory of a long-lived pair."""
    sec = Section("hotpath", "The hot path over a long life: history, memory, descriptors")
    rm = ralph()
    status = rm if isinstance(rm, str) else "ok"
    small_label = f"{sizes.growth_small:,} messages, 10 threads"
    big_label = f"{sizes.growth_big:,} messages, {sizes.growth_threads:,} threads"
    send_small = sec.add(Row("send_small", f"send (CPU µs) in a team of {small_label}", "µs",
                             "lower", status=status))  # fmt: skip
    send_big = sec.add(Row("send_big", f"send (CPU µs) in a team of {big_label}", "µs", "lower",
                           anchor=send_small.key, status=status))  # fmt: skip
    raw = sec.add(Row("raw_cpu", "raw os.write of a line as long, O_APPEND (CPU µs)", "µs",
                      "lower"))  # fmt: skip
    peer = sec.add(Row("litequeue_cpu", "litequeue LiteQueue.put of the same message (CPU µs)",
                       "µs", "lower"))  # fmt: skip
    ask_small = sec.add(Row("ask_small", f"ask round trip (p50) in a team of {small_label}",
                            "µs", "lower", status=status))  # fmt: skip
    ask_big = sec.add(Row("ask_big", f"ask round trip (p50) in a team of {big_label}", "µs",
                          "lower", anchor=ask_small.key, status=status))  # fmt: skip
    exchange = sec.add(Row("exchange_cpu", "an ask's exchange in one process, nobody waiting "
                           "(CPU µs)", "µs", "lower", status=status,
                           extra={"request_us": [], "read_us": [], "reply_us": [], "answer_us": []},
                           note="extra: each phase: request, read, reply, answer"))  # fmt: skip
    if isinstance(rm, str):
        return sec
    homes = []
    for messages, threads in ((sizes.growth_small, 10), (sizes.growth_big, sizes.growth_threads)):
        home = ws.fresh(f"grow-{messages}")
        _history(rm, home, messages, threads)
        homes.append(home)
    for _ in range(sizes.reps):
        for row, home in zip((send_small, send_big), homes, strict=True):
            row.values.append(_send_cost(rm, home))
        _anchors_cpu(ws, raw, peer)
        p50s = _ask_p50s(rm, homes, ASKS if sizes.name != "smoke" else 5)
        for row, p50 in zip((ask_small, ask_big), p50s, strict=True):
            row.values.append(p50)
        phases = _exchange_cpu(rm, ws, SEND_BATCH if sizes.name != "smoke" else 10)
        exchange.values.append(sum(phases.values()))
        for phase, spent in phases.items():
            exchange.extra[f"{phase}_us"].append(spent)
    _long_lived(rm, ws, sizes.rss_asks, sec)
    return sec
