"""Ask round trip across processes: ``bus.ask`` in this process, answered by a replier in
another (wait for the request, reply), against the floors a user would compare it with:
a ping-pong over two pipes between the same two kinds of process, and the floor of a
file mailbox: each process appends a line to the other's file and wakes on inotify.

Both sides run in the same repetition, one after the other, so outside load hits them
alike. The figure is one whole exchange as an agent sees it: the request written, the
replier woken and answering, the asker woken and parsing the reply.

The peer row is MCP Agent Mail, the closest system users pick today, doing the same
exchange with its own tools (send, fetch, reply, fetch) in an environment of its own
(``--peer-venv``; see `bench.agent_mail_driver`), polling every 10 ms as its agents do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import ModuleType
from typing import Final

from bench import peer_venv
from bench.common import Row, Section, Sizes, Workspace, child_env, percentile, ralph

#: How often MCP Agent Mail's agents look at their inboxes in the peer row (s).
PEER_POLL_S: Final = 0.01

REPLIER: Final = """
import sys
from ralph_mail import MessageBus, MessageType
bus = MessageBus(sys.argv[3], sys.argv[4], sys.argv[1])
bus.set_presence("idle")
print("ready", flush=True)
answered, total = 0, int(sys.argv[2])
while answered < total:
    for message in bus.wait_for_messages(timeout=30):
        if message.type == MessageType.REQUEST:
            bus.reply(message, message.content)
            answered += 1
"""

ECHO: Final = """
import os, sys
rd, wr = int(sys.argv[1]), int(sys.argv[2])
while True:
    data = os.read(rd, 64)
    if not data:
        break
    os.write(wr, data)
"""


INOTIFY_ECHO: Final = """
import ctypes, os, select, sys
inbox, outbox = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
watch = libc.inotify_init1(os.O_CLOEXEC)
if watch < 0 or libc.inotify_add_watch(watch, inbox.encode(), 0x2) < 0:  # IN_MODIFY
    raise OSError(ctypes.get_errno(), "inotify setup failed")
reader = os.open(inbox, os.O_RDONLY)
writer = os.open(outbox, os.O_WRONLY | os.O_APPEND)
poller = select.poll()
poller.register(watch, select.POLLIN)
print("ready", flush=True)
while True:
    poller.poll()
    os.read(watch, 4096)  # the events are a hint: read what is new
    line = os.read(reader, 65536)
    if line == b"stop\\n":
        break
    if line:
        os.write(writer, line)
"""


#: The least a Python file mailbox does for an ask, one side of it (see `_python_round_trips`):
#: woken by its doorbell (a FIFO), it reads what is new in its inbox, parses it, moves its
#: cursor, and answers (``sys.argv``: the directory, my name, the other's; "stop" ends it).
PYTHON_MAILBOX: Final = """
import fcntl, os, select, struct, sys, time, zlib
import orjson
d, me, other = sys.argv[1], sys.argv[2], sys.argv[3]
O = os.O_NONBLOCK | os.O_CLOEXEC
bell = os.open(f"{d}/{me}.bell", os.O_RDONLY | O)
keep = os.open(f"{d}/{me}.bell", os.O_WRONLY | O)  # so that a FIFO with no writer never ends
ring = None
inbox = os.open(f"{d}/{me}.jsonl", os.O_RDONLY)
theirs = os.open(f"{d}/{other}.jsonl", os.O_WRONLY | os.O_APPEND)
index = os.open(f"{d}/{me}+{other}.idx", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
cursor = os.open(f"{d}/{me}.cursor", os.O_RDWR | os.O_CREAT, 0o600)
poller = select.poll()
poller.register(bell, select.POLLIN)
head = struct.pack("<2s64s", b"\\xa5\\x5a", other.encode())
ids, prefixes, offset = [], {}, 0

def send(kind, content, reply_to):
    global ring
    if not ids:
        drawn = os.urandom(6 * 64).hex()
        ids.extend(drawn[at : at + 12] for at in range(0, len(drawn), 12))
    envelope = {"id": ids.pop(), "from": me, "to": other, "type": kind, "content": content,
                "metadata": {}, "reply_to": reply_to, "ts": ""}
    encoded = orjson.dumps(envelope)[:-3]
    fcntl.flock(theirs, fcntl.LOCK_EX)
    try:
        at = os.fstat(theirs).st_size
        second, fraction = divmod(time.time_ns() // 1000, 1_000_000)
        if second not in prefixes:
            prefixes[second] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        line = encoded + f'"{prefixes[second]}.{fraction:06d}Z"}}\\n'.encode()
        os.write(theirs, line)
    finally:
        fcntl.flock(theirs, fcntl.LOCK_UN)
    if ring is None:
        ring = os.open(f"{d}/{other}.bell", os.O_WRONLY | O)
    os.write(ring, b"\\0")
    body = head + struct.pack("<qI", at, len(line))
    os.write(index, body + struct.pack("<I", zlib.crc32(body)))
    return envelope["id"]

def receive():
    global offset
    while True:
        size = os.fstat(inbox).st_size
        if size > offset:
            data = os.pread(inbox, size - offset, offset)
            data = data[: data.rfind(b"\\n") + 1]  # whole lines: a write may be under way
            if data:
                offset += len(data)
                os.pwrite(cursor, struct.pack("<q", offset), 0)
                return [orjson.loads(line) for line in data.splitlines()]
        if not poller.poll(30_000):
            sys.exit(f"{me}: nothing came within 30 s")
        os.read(bell, 4096)

print("ready", flush=True)
if me == "asker":
    count = int(sys.argv[4])
    times = []
    for n in range(count + 5):
        t0 = time.perf_counter()
        asked = send("request", str(n), None)
        while not any(m["reply_to"] == asked for m in receive()):
            pass
        times.append((time.perf_counter() - t0) * 1e6)
    send("stop", "", None)
    print(" ".join(f"{t:.1f}" for t in times[5:]), flush=True)
else:
    while True:
        got = receive()
        if any(m["type"] == "stop" for m in got):
            break
        for m in got:
            send("reply", m["content"], m["id"])
"""


def _python_round_trips(ws: Workspace, count: int) -> list[float]:
    """Microseconds per ask of `PYTHON_MAILBOX`: two processes that do what a file mailbox
    must, in the fewest lines of Python, with no check of any kind: the floor an ask in
    Python can reach, between the file ping-pong and ralph_mail's ask."""
    d = ws.fresh("python-mailbox")
    for name in ("asker", "replier"):
        os.close(os.open(d / f"{name}.jsonl", os.O_WRONLY | os.O_CREAT, 0o600))
        os.mkfifo(d / f"{name}.bell", 0o600)
    replier = subprocess.Popen([sys.executable, "-c", PYTHON_MAILBOX, str(d), "replier",
                                "asker"], stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert replier.stdout is not None and replier.stdout.readline() == b"ready\n"
        command = [sys.executable, "-c", PYTHON_MAILBOX, str(d), "asker", "replier", str(count)]
        asker = subprocess.run(command, capture_output=True, check=True, timeout=120)
        lines = asker.stdout.decode().splitlines()
        return [float(t) for t in lines[1].split()]
    finally:
        try:
            replier.wait(timeout=30)  # the asker's "stop" ends it
        except subprocess.TimeoutExpired:  # the asker failed: it never came
            replier.kill()
            replier.wait()


def _inotify_round_trips(ws: Workspace, count: int) -> list[float]:
    """Microseconds per round trip of one JSON line through two files, each process
    appending to the other's and woken by inotify on its own: the floor of a file
    mailbox, with no lock, no encoding and no parsing."""
    import ctypes
    import select

    d = ws.fresh("inotify-pingpong")
    mine, theirs = d / "asker.jsonl", d / "replier.jsonl"
    for path in (mine, theirs):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    libc = ctypes.CDLL(None, use_errno=True)
    watch = libc.inotify_init1(os.O_CLOEXEC)
    if watch < 0 or libc.inotify_add_watch(watch, str(mine).encode(), 0x2) < 0:
        raise OSError(ctypes.get_errno(), "inotify setup failed")
    reader = os.open(mine, os.O_RDONLY)
    writer = os.open(theirs, os.O_WRONLY | os.O_APPEND)
    poller = select.poll()
    poller.register(watch, select.POLLIN)
    child = subprocess.Popen([sys.executable, "-c", INOTIFY_ECHO, str(theirs), str(mine)],
                             stdout=subprocess.PIPE)  # fmt: skip
    line = ws.line()
    times = []
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        for _ in range(count):
            t0 = time.perf_counter()
            os.write(writer, line)
            got = b""
            while not got:
                poller.poll()
                os.read(watch, 4096)
                got = os.read(reader, 65536)
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        os.write(writer, b"stop\n")
        child.wait(timeout=30)
        for fd in (reader, writer, watch):
            os.close(fd)
    return times


def start_replier(
    home: object, answers: int, team: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A `REPLIER` process answering ``answers`` requests in ``team`` at ``home``, once
    it is ready (``env``: more of its environment)."""
    replier = subprocess.Popen(
        [sys.executable, "-c", REPLIER, str(home), str(answers), team, "replier"],
        stdout=subprocess.PIPE, env=child_env(env),
    )  # fmt: skip
    assert replier.stdout is not None and replier.stdout.readline() == b"ready\n"
    return replier


def _pipe_round_trips(count: int) -> list[float]:
    """Microseconds per round trip of 16 bytes through an echoing child."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", ECHO, str(to_child_r), str(from_child_w)],
        pass_fds=(to_child_r, from_child_w),
    )
    os.close(to_child_r)
    os.close(from_child_w)
    times = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            os.write(to_child_w, b"0123456789abcdef")
            os.read(from_child_r, 64)
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        os.close(to_child_w)
        child.wait(timeout=30)
        os.close(from_child_r)
    return times


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Round trips of an ask against a pipe ping-pong, ``sizes.wake_n`` of each a rep."""
    sec = Section("ask", "Ask round trip across processes (µs)")
    rm = ralph()
    pipe = sec.add(Row("pipe_pingpong", "pipe ping-pong between two Python processes",
                       "µs", "lower", extra={"p99_us": []}))  # fmt: skip
    floor = sec.add(Row("inotify_pingpong", "file ping-pong: append + inotify wake, two "
                        "Python processes", "µs", "lower", extra={"p99_us": []}))  # fmt: skip
    least = sec.add(Row("python_ask_floor", "the least a Python file mailbox does for an ask "
                        "(lock, append, index, doorbell, read, parse, cursor; no check)", "µs",
                        "lower", anchor=floor.key, extra={"p99_us": []}))  # fmt: skip
    ask = sec.add(Row("ask_roundtrip", "bus.ask -> reply from another process (p50)", "µs",
                      "lower", anchor=pipe.key, status="ok" if not isinstance(rm, str) else rm,
                      extra={"p99_us": []}))  # fmt: skip
    still = sec.add(Row("ask_no_spin", "the same with RALPH_SPIN_US=0: each side sleeps at "
                        "once in every wait (p50)", "µs", "lower", anchor=pipe.key,
                        status=ask.status, extra={"p99_us": []}))  # fmt: skip
    count = sizes.wake_n
    for _ in range(sizes.wake_reps):
        times = _pipe_round_trips(count)
        pipe.values.append(percentile(times, 50))
        pipe.extra["p99_us"].append(percentile(times, 99))
        times = _inotify_round_trips(ws, count)
        floor.values.append(percentile(times, 50))
        floor.extra["p99_us"].append(percentile(times, 99))
        times = _python_round_trips(ws, count)
        least.values.append(percentile(times, 50))
        least.extra["p99_us"].append(percentile(times, 99))
        if isinstance(rm, str):
            continue
        for row, spin in ((ask, None), (still, "0")):
            times = _ask_round_trips(rm, ws, count, spin)
            row.values.append(percentile(times, 50))
            row.extra["p99_us"].append(percentile(times, 99))
    _peer(sec, sizes, ws)
    return sec


def _ask_round_trips(rm: ModuleType, ws: Workspace, count: int, spin: str | None) -> list[float]:
    """Microseconds per `bus.ask` to a replier process, both sides with
    ``RALPH_SPIN_US=spin`` (None: the default)."""
    home = ws.fresh("ask")
    rm.create_team("ask", ["asker", "replier"], home=home)
    env = {"RALPH_SPIN_US": spin} if spin is not None else {}
    replier = start_replier(home, count + 5, "ask", env)
    before = os.environ.pop("RALPH_SPIN_US", None)
    os.environ.update(env)  # read when the asker's waiter is made, at its first ask
    try:
        bus = rm.MessageBus("ask", "asker", home=home)
        for _ in range(5):  # warm both sides up
            bus.ask("replier", "warm", timeout=30)
        times = []
        for n in range(count):
            t0 = time.perf_counter()
            bus.ask("replier", str(n), timeout=30)
            times.append((time.perf_counter() - t0) * 1e6)
        bus.close()
        return times
    finally:
        os.environ.pop("RALPH_SPIN_US", None)
        if before is not None:
            os.environ["RALPH_SPIN_US"] = before
        replier.wait(timeout=60)


def _peer(sec: Section, sizes: Sizes, ws: Workspace) -> None:
    """MCP Agent Mail's send and round trip, in its own environment, once."""
    exe = peer_venv.python(ws.peer_venv)
    status = exe if isinstance(exe, str) else "ok"
    pipe = "pipe_pingpong"
    trip = sec.add(Row("agent_mail_roundtrip", "MCP Agent Mail: send -> fetch -> reply -> "
                       f"fetch, polling every {PEER_POLL_S * 1e3:g} ms (p50)", "µs", "lower",
                       anchor=pipe, status=status, extra={"p99_us": []}))  # fmt: skip
    send = sec.add(Row("agent_mail_send", "MCP Agent Mail: send_message (p50)", "µs", "lower",
                       anchor=pipe, status=status))  # fmt: skip
    if isinstance(exe, str):
        return
    result = peer_venv.drive(exe, ws.fresh("agent-mail"), sizes.peer_asks, PEER_POLL_S,
                             child_env())  # fmt: skip
    if isinstance(result, str):
        trip.status = send.status = result
        return
    trips = [ms * 1e3 for ms in result["round_trip_ms"]]
    trip.values.append(percentile(trips, 50))
    trip.extra["p99_us"].append(percentile(trips, 99))
    send.values.append(percentile([ms * 1e3 for ms in result["send_ms"]], 50))
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    trip.note = send.note = f"{versions}; one process, in-memory MCP transport"
