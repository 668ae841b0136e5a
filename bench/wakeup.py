"""Wake-up latency across processes: send -> woken, parsed message in another process.

One waiter process per mechanism (bench.child waiter). The parent sends one message
every ~5 ms (jittered, so the send never locks in phase with a poller's period) and
stamps each with CLOCK_MONOTONIC just before the send; the waiter subtracts that from
its own clock once it has parsed the message. So the figure includes the send, the
kernel's wake-up, the mechanism's own delay and the read: all that a user waits for.

Idle CPU is measured for all waiters over the same window, while nothing is sent,
from /proc/<pid>/stat (all threads, including ones that ended).
"""

from __future__ import annotations

import fcntl
import os
import random
import time
from collections.abc import Callable
from typing import Any, Final

import orjson

from bench.common import Row, Section, Sizes, Workspace, message_dict, percentile, ralph
from bench.procs import Child, cpu_between, running

#: Mean gap between two sends; long enough that a 1 ms-step watcher settles between.
GAP_S: Final = 0.005
#: Each gap is drawn uniformly from GAP_S ± JITTER_S.
JITTER_S: Final = 0.001

MECHANISMS: Final = {
    "pipe": "pipe, blocking read (kernel floor)",
    "inotify": "raw inotify via ctypes (file floor)",
    "ralph": "ralph_mail wait_for_messages",
    "rustnotify": "watchfiles RustNotify, step 1 ms (bare)",
    "watchfiles": "watchfiles.watch, defaults",
    "poll500": "poll every 500 ms (original design)",
}
ANCHOR: Final = "inotify"


class _Waiter:
    """One mechanism: its child process and the parent's way to send it a message."""

    def __init__(self, ws: Workspace, kind: str, total: int, timeout: float) -> None:
        self.kind = kind
        self.close_fns: list[Callable[[], None]] = []
        spec: dict[str, Any] = {"kind": kind, "n": total, "timeout": timeout}
        pass_fds: list[int] = []
        d = ws.fresh(f"wake-{kind}")
        self.send: Callable[[int], object]
        if kind == "ralph":
            rm = ralph()
            assert not isinstance(rm, str)
            rm.create_team("wake", ["waiter", "sender"], home=d)
            bus = rm.MessageBus("wake", "sender", home=d)
            text = rm.MessageType.TEXT
            self.send = lambda t: bus.send("waiter", text, str(t))
            self.close_fns.append(bus.close)
            spec.update(home=str(d), team="wake", agent="waiter")
        else:
            template = message_dict(0, ws.template())

            def encode(t: int) -> bytes:
                template["content"] = str(t)
                return orjson.dumps(template) + b"\n"

            if kind == "pipe":
                r, w = os.pipe()
                pass_fds.append(r)
                spec["fd"] = r
                self.send = lambda t: os.write(w, encode(t))
                self.close_fns += [lambda: os.close(r), lambda: os.close(w)]
            else:
                inbox = d / "waiter.jsonl"
                fd = os.open(inbox, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                lock = os.open(d / "waiter.lock", os.O_RDWR | os.O_CREAT, 0o600)

                def send(t: int) -> None:
                    line = encode(t)
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    try:
                        os.write(fd, line)
                    finally:
                        fcntl.flock(lock, fcntl.LOCK_UN)

                self.send = send
                self.close_fns += [lambda: os.close(fd), lambda: os.close(lock)]
                spec.update(inbox=str(inbox), dir=str(d))
        self.child = Child(["waiter", orjson.dumps(spec).decode()], pass_fds)

    def close(self) -> None:
        for fn in self.close_fns:
            fn()


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Measure every mechanism: idle CPU together, then latency one after another."""
    sec = Section("wakeup", "Wake-up latency across processes (ms)")
    rm = ralph()
    rows: dict[str, Row] = {}
    for kind, label in MECHANISMS.items():
        status = rm if (kind == "ralph" and isinstance(rm, str)) else "ok"
        rows[kind] = sec.add(
            Row(
                kind,
                label,
                "ms",
                "lower",
                anchor=None if kind == ANCHOR else ANCHOR,
                status=status,
                extra={"p99_ms": [], "max_ms": [], "idle_cpu_pct": [], "warm_ms": []},
                note="figure = p50; extra: p99, max, idle CPU % of one core",
            )
        )
    kinds = [k for k, r in rows.items() if r.status == "ok"]
    total = 1 + sizes.wake_reps * sizes.wake_n
    timeout = 120.0 + total * GAP_S * 4
    waiters: list[_Waiter] = []
    try:
        with running([]) as kids:
            for kind in kinds:
                waiters.append(_Waiter(ws, kind, total, timeout))
                kids.append(waiters[-1].child)
            for w in waiters:
                w.child.expect("ready")
            for w in waiters:  # one message each, so every waiter is settled in its wait
                w.send(time.monotonic_ns())
                warm = w.child.expect("warm", timeout)  # (a bound for a stalled child only)
                rows[w.kind].extra["warm_ms"].append(int(warm) / 1e6)
            cpu0 = [w.child.cpu_sample() for w in waiters]
            t0 = time.monotonic()
            time.sleep(sizes.idle_s)  # the measurement window itself, not synchronisation
            wall = time.monotonic() - t0
            for w, c0 in zip(waiters, cpu0, strict=True):
                pct = cpu_between(c0, w.child.cpu_sample()) / wall * 100.0
                rows[w.kind].extra["idle_cpu_pct"].append(pct)
            for w in waiters:
                try:
                    lats = _drive(w, total - 1, timeout)
                except Exception as exc:  # one broken mechanism must not sink the others
                    rows[w.kind].status = f"failed: {type(exc).__name__}: {exc}"
                    continue
                _record(rows[w.kind], lats, sizes.wake_reps)
                sec.samples[w.kind] = [x / 1e6 for x in lats]
    except Exception as exc:
        for kind in kinds:
            if not rows[kind].values:
                rows[kind].status = f"failed: {type(exc).__name__}: {exc}"
    finally:
        for w in waiters:
            w.close()
    return sec


def _drive(w: _Waiter, count: int, timeout: float) -> list[int]:
    """Send ``count`` stamped messages at the jittered cadence; collect the latencies."""
    rng = random.Random(4)
    due = time.monotonic()
    for _ in range(count):
        due += rng.uniform(GAP_S - JITTER_S, GAP_S + JITTER_S)
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # pacing the sender, not waiting for anyone
        w.send(time.monotonic_ns())
    lats: list[int] = orjson.loads(w.child.expect("lat", timeout))
    if len(lats) != count:
        raise RuntimeError(f"{w.kind}: {len(lats)} of {count} messages arrived")
    return lats


def _record(row: Row, lats: list[int], reps: int) -> None:
    """Split the run into ``reps`` equal chunks: one p50/p99/max per repetition."""
    size = len(lats) // reps
    for i in range(reps):
        chunk = lats[i * size : (i + 1) * size]
        row.values.append(percentile(chunk, 50) / 1e6)
        row.extra["p99_ms"].append(percentile(chunk, 99) / 1e6)
        row.extra["max_ms"].append(max(chunk) / 1e6)
