"""Entry point of the bench's worker processes: ``python -m bench.child ROLE SPEC_JSON``.

Roles:

* ``writer``: send ``n`` messages into one inbox as fast as it can, once the start
  gun fires, timing every send; prints ``ready``, then ``done START END`` (monotonic
  ns) and leaves the per-send latencies (ns, int64) in ``out``.
* ``waiter``: block on one wake-up mechanism and report, for each message, the time
  from just before the send to the moment the waiter had parsed it (CLOCK_MONOTONIC
  is system-wide, so the sender's and the waiter's clocks agree). Prints ``ready``,
  ``warm LAT`` for the first message, then ``lat [LAT, ...]``.

The protocol is lines on stdout, flushed at once: the parent reads them with bounded
waits (bench.procs). Kept dependency-light so that start-up is cheap.
"""

from __future__ import annotations

import ctypes
import os
import select
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any, Final

import orjson

from bench.common import CONTENT, METADATA

#: inotify_add_watch mask: a write to the watched file.
IN_MODIFY: Final = 0x00000002
#: Period of the original design's polling reader.
POLL_PERIOD_S: Final = 0.5


def say(*words: object) -> None:
    """Print one protocol line and flush it, because stdout is a pipe."""
    print(*words, flush=True)


def writer(spec: dict[str, Any]) -> None:
    """Send ``spec['n']`` messages after the start gun; time each send."""
    n, warm = int(spec["n"]), int(spec["warm"])
    send: Callable[[], object]
    if spec["kind"] == "ralph":
        from ralph_mail import MessageBus, MessageType

        bus = MessageBus(spec["team"], spec["agent"], home=spec["home"])
        to, text = spec["to"], MessageType.TEXT

        def send() -> object:
            return bus.send(to, text, CONTENT, metadata=METADATA)

    else:  # "flock": the anchor, a bare locked append of an orjson line
        import fcntl

        fd = os.open(spec["inbox"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        lock_fd = os.open(spec["lock"], os.O_RDWR | os.O_CREAT, 0o600)
        template = spec["template"]

        def send() -> object:
            line = orjson.dumps(template) + b"\n"
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                return os.write(fd, line)
            finally:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)

    for _ in range(warm):
        send()
    lat = array("q", bytes(8 * n))
    clock = time.perf_counter_ns
    say("ready")
    os.read(int(spec["gun"]), 1)  # blocks until the parent closes the write end
    start = time.monotonic_ns()
    for i in range(n):
        t0 = clock()
        send()
        lat[i] = clock() - t0
    end = time.monotonic_ns()
    with open(spec["out"], "wb") as f:
        lat.tofile(f)
    say("done", start, end)


class _Lines:
    """Read complete lines appended to a file or pipe since the last call."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.tail = b""

    def read(self) -> list[bytes]:
        chunks = [self.tail]
        while True:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            if len(chunk) < 1 << 20:
                break
        data = b"".join(chunks)
        *lines, self.tail = data.split(b"\n")
        return lines


def waiter(spec: dict[str, Any]) -> None:
    """Wait for ``spec['n']`` messages with one mechanism; report their latencies."""
    kind, total, timeout = spec["kind"], int(spec["n"]), float(spec["timeout"])
    lats: list[int] = []
    warmed = [False]
    deadline = time.monotonic() + timeout

    def record(stamps: list[int]) -> None:
        now = time.monotonic_ns()
        for t in stamps:
            if warmed[0]:
                lats.append(now - t)
            else:
                warmed[0] = True
                say("warm", now - t)

    def stamps_of(lines: list[bytes]) -> list[int]:
        return [int(orjson.loads(line)["content"]) for line in lines if line]

    def done() -> bool:
        return len(lats) + 1 >= total or time.monotonic() > deadline

    if kind == "ralph":
        from ralph_mail import MessageBus

        bus = MessageBus(spec["team"], spec["agent"], home=spec["home"])
        say("ready")
        while not done():
            msgs = bus.wait_for_messages(timeout=max(0.01, deadline - time.monotonic()))
            record([int(m.content) for m in msgs])
        bus.close()
    elif kind == "pipe":
        lines = _Lines(int(spec["fd"]))
        say("ready")
        while not done():
            record(stamps_of(lines.read()))  # os.read blocks until the sender writes
    else:
        fd = os.open(spec["inbox"], os.O_RDONLY)
        lines = _Lines(fd)
        if kind == "inotify":
            libc = ctypes.CDLL(None, use_errno=True)
            ifd = libc.inotify_init1(os.O_CLOEXEC)
            if ifd < 0 or libc.inotify_add_watch(ifd, spec["inbox"].encode(), IN_MODIFY) < 0:
                raise OSError(ctypes.get_errno(), "inotify setup failed")
            say("ready")
            while not done():
                ready, _, _ = select.select([ifd], [], [], 1.0)
                if ready:
                    os.read(ifd, 65536)  # drain events: each is only a hint
                    record(stamps_of(lines.read()))
        elif kind == "poll500":
            say("ready")
            while not done():
                record(stamps_of(lines.read()))
                time.sleep(POLL_PERIOD_S)  # the mechanism under test, not synchronisation
        elif kind == "rustnotify":
            from watchfiles._rust_notify import RustNotify

            notify = RustNotify([spec["dir"]], False, False, 0, False, False)
            say("ready")
            while not done():
                # debounce 1 ms, step 1 ms: the lowest setting that does not spin a core
                if notify.watch(1, 1, 1000, None) != "timeout":
                    record(stamps_of(lines.read()))
            notify.close()
        elif kind == "watchfiles":
            import watchfiles

            say("ready")
            for _changes in watchfiles.watch(spec["dir"], raise_interrupt=False):
                record(stamps_of(lines.read()))
                if done():
                    break
        else:
            raise SystemExit(f"unknown waiter kind {kind!r}")
    say("lat", orjson.dumps(lats).decode())


def main(argv: list[str]) -> None:
    """Dispatch on the role named by the first argument."""
    role, spec = argv[0], orjson.loads(argv[1])
    {"writer": writer, "waiter": waiter}[role](spec)


if __name__ == "__main__":
    main(sys.argv[1:])
