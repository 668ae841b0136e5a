"""Ask round trip across processes: ``bus.ask`` in this process, answered by a replier in
another (wait for the request, reply), against the floor a user would compare it with:
a ping-pong over two pipes between the same two kinds of process.

Both sides run in the same repetition, one after the other, so outside load hits them
alike. The figure is one whole exchange as an agent sees it: the request written, the
replier woken and answering, the asker woken and parsing the reply.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Final

from bench.common import Row, Section, Sizes, Workspace, child_env, percentile, ralph

REPLIER: Final = """
import sys
from ralph_mail import MessageBus, MessageType
bus = MessageBus("ask", "replier", sys.argv[1])
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
                       "µs", "lower", extra={"p99": []}))  # fmt: skip
    ask = sec.add(Row("ask_roundtrip", "bus.ask -> reply from another process (p50)", "µs",
                      "lower", anchor=pipe.key, status="ok" if not isinstance(rm, str) else rm,
                      extra={"p99": []}))  # fmt: skip
    count = sizes.wake_n
    for _ in range(sizes.wake_reps):
        times = _pipe_round_trips(count)
        pipe.values.append(percentile(times, 50))
        pipe.extra["p99"].append(percentile(times, 99))
        if isinstance(rm, str):
            continue
        home = ws.fresh("ask")
        rm.create_team("ask", ["asker", "replier"], home=home)
        replier = subprocess.Popen(
            [sys.executable, "-c", REPLIER, str(home), str(count + 5)],
            stdout=subprocess.PIPE, env=child_env(),
        )  # fmt: skip
        try:
            assert replier.stdout is not None and replier.stdout.readline() == b"ready\n"
            bus = rm.MessageBus("ask", "asker", home=home)
            for _ in range(5):  # warm both sides up
                bus.ask("replier", "warm", timeout=30)
            times = []
            for n in range(count):
                t0 = time.perf_counter()
                bus.ask("replier", str(n), timeout=30)
                times.append((time.perf_counter() - t0) * 1e6)
            bus.close()
            ask.values.append(percentile(times, 50))
            ask.extra["p99"].append(percentile(times, 99))
        finally:
            replier.wait(timeout=60)
    return sec
