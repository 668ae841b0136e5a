"""How the time a lock is held sets the tail latency of 16 writers on this machine.

Sixteen processes append to one file under a bare ``fcntl.flock`` (the anchor of the
many-writers bench), with a busy spin of 0, 2, 5 and 10 µs added inside the lock. On a
machine with fewer cores than writers, a holder preempted inside the lock stalls every
other writer, and the longer the hold the likelier that is: this shows by how much, with
nothing of ralph_mail in the way.

    python bench/hold_time.py            # 16 writers x 5,000 appends per hold time
    python bench/hold_time.py --smoke    # a few appends, to check that it runs
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

WRITERS = 16
HOLDS_US = (0, 2, 5, 10)
LINE = b"x" * 200 + b"\n"


def child(hold_us: float, count: int, path: str, gun: int) -> None:
    """Append ``count`` lines, spinning ``hold_us`` inside the lock; print p50, p99, max."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    clock = time.perf_counter_ns
    latencies = array("q")
    print("ready", flush=True)
    os.read(gun, 1)  # blocks until the parent closes the pipe: everyone starts together
    for _ in range(count):
        start = clock()
        fcntl.flock(fd, fcntl.LOCK_EX)
        until = clock() + int(hold_us * 1000)
        while clock() < until:
            pass
        os.write(fd, LINE)
        fcntl.flock(fd, fcntl.LOCK_UN)
        latencies.append(clock() - start)
    ordered = sorted(latencies)
    print(ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.99)], ordered[-1], flush=True)


def run(count: int) -> list[tuple[int, float, float, float]]:
    """(hold µs, median of the writers' p99 µs, max ms, aggregate appends/s) per hold."""
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for hold in HOLDS_US:
            path = str(Path(scratch) / f"inbox-{hold}")
            read_end, write_end = os.pipe()
            writers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        str(hold),
                        str(count),
                        path,
                        str(read_end),
                    ],
                    stdout=subprocess.PIPE,
                    pass_fds=(read_end,),
                )
                for _ in range(WRITERS)
            ]
            try:
                for writer in writers:
                    assert writer.stdout is not None and writer.stdout.readline() == b"ready\n"
                started = time.perf_counter()
                os.close(write_end)
                stats = []
                for writer in writers:
                    assert writer.stdout is not None
                    stats.append([int(x) for x in writer.stdout.readline().split()])
                elapsed = time.perf_counter() - started
            finally:
                for writer in writers:
                    if writer.poll() is None:
                        writer.kill()
                    writer.wait(timeout=60)
                    if writer.stdout is not None:
                        writer.stdout.close()
                os.close(read_end)
            p99 = sorted(s[1] for s in stats)[len(stats) // 2] / 1e3
            results.append((hold, p99, max(s[2] for s in stats) / 1e6, WRITERS * count / elapsed))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few appends per writer")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        hold, count, path, gun = args.child
        child(float(hold), int(count), path, int(gun))
        return
    print("| time added inside the lock | p99 send latency | max | aggregate |")
    print("|---|---|---|---|")
    for hold, p99, worst, rate in run(20 if args.smoke else 5000):
        print(f"| {hold} µs | {p99:,.0f} µs | {worst:.1f} ms | {rate:,.0f} msg/s |")


if __name__ == "__main__":
    main()
