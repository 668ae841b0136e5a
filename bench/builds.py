"""Builds compared wake-up by wake-up: agents of each build waiting side by side.

``python -m bench.builds TREE[:N[/K]] ...`` starts, for each TREE (a checkout of
the project; ``git worktree add --detach DIR COMMIT`` makes one for another commit, and
``.`` is this one), a sender and N agents (default 1) waiting in ``wait_for_messages``,
all importing ralph_mail from that tree, the agents forked from one process by
`bench.hive` as in `bench.scale`. It then sends to one agent of each build in turn, 4 ms
apart, each build first every other time, until each build got ``--samples`` wake-ups;
each agent reports its CLOCK_MONOTONIC minus the stamp taken just before the send. One
run of the ``scale`` section moves by a quarter from the next on a shared machine;
builds measured in the same seconds, interleaved, can be compared.

``/K`` wakes that build only every K-th round (``--samples`` counts the rounds), so each
of its agents sleeps as long as one of K times as many agents woken every round would:
``.:1000 .:1/1000`` sets a thousand agents beside one agent woken as rarely as each of
them, in the same seconds; ``.:1`` beside both is one agent woken every round.

Two things beside the build move a wake-up, and the options hold them still:

- ``--busy-us U``: each agent spends U µs of CPU on every message before it waits again,
  as an agent that does something with its mail does. An agent that does nothing
  blocks again within microseconds, and on a small virtual machine how long it runs
  then moves where the kernel runs its next wake-up (docs/performance.md).
- ``--pin S,A``: the senders run on CPU S and the agents on CPU A, so the kernel has no
  CPU to choose: what is left is each build's own path.

Examples::

    git worktree add --detach /tmp/old 165c11d
    python -m bench.builds /tmp/old . --samples 4000
    python -m bench.builds /tmp/old . --busy-us 50
    python -m bench.builds /tmp/old . --pin 0,0
    python -m bench.builds /tmp/old:1000 .:1000 --samples 3000
    python -m bench.builds .:1000 .:1 .:1/200 --samples 20000
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from bench.common import percentile

#: The directory ``-m bench.builds`` runs from (the sides find the package there).
ROOT: Final = Path(__file__).resolve().parent.parent
#: The pause between two wake-ups (s), as `bench.scale` takes.
GAP_S: Final = 0.004
#: How long a build's agents may take to start, or to read their first message (s).
START_S: Final = 600.0


def _side(tree: str, n: int, busy_us: int, pin: tuple[int, int] | None) -> None:
    """One build: a sender and a hive of ``n`` agents (`bench.hive`); a line on stdin (an
    agent's index) sends to that agent, and its latency in ns comes back on stdout."""
    sys.path.insert(0, tree)  # before the checkout this runs from
    import ralph_mail
    from bench.hive import Hive
    from ralph_mail import MessageBus, create_team

    if not Path(ralph_mail.__file__ or "").is_relative_to(tree):
        raise SystemExit(f"ralph_mail came from {ralph_mail.__file__}, not from {tree}")
    if pin is not None:
        os.sched_setaffinity(0, {pin[0]})
    home = tempfile.mkdtemp(prefix="ralph-builds-")
    names = [f"a{i}" for i in range(n)]
    create_team("builds", ["sender", *names], home=home)
    spec = {"kind": "ralph", "agents": names, "home": home, "team": "builds", "tree": tree,
            "busy_us": busy_us, "cpu": None if pin is None else pin[1]}  # fmt: skip
    try:
        with Hive(spec) as hive:
            hive.ready(START_S)
            bus = MessageBus("builds", "sender", home=home)
            for name in names:  # one message each: every agent has read once and waits again
                bus.send(name, "text", str(time.monotonic_ns()))
                hive.latency(START_S)
            print("ready", flush=True)
            for command in sys.stdin:
                bus.send(names[int(command)], "text", str(time.monotonic_ns()))
                print(hive.latency(60.0)[1], flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def compare(
    builds: list[tuple[str, int, int]], samples: int, busy_us: int, pin: tuple[int, int] | None
) -> list[list[float]]:
    """The wake-up latencies (ms) of each build, interleaved as the module says."""
    command = [sys.executable, "-m", "bench.builds", "--side"]
    sides = [
        subprocess.Popen(
            [*command, tree, str(n), str(busy_us), "" if pin is None else f"{pin[0]},{pin[1]}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for tree, n, _ in builds
    ]
    try:
        for side in sides:
            assert side.stdout is not None
            if side.stdout.readline().strip() != "ready":
                raise SystemExit("a build's agents did not start: see the error above")
        rng = random.Random(30)
        orders = [list(range(n)) for _, n, _ in builds]
        latencies: list[list[float]] = [[] for _ in builds]
        for k in range(samples):
            for j in range(len(builds)) if k % 2 else reversed(range(len(builds))):
                side, order, every = sides[j], orders[j], builds[j][2]
                if k % every:
                    continue
                woken = len(latencies[j])
                if woken % len(order) == 0:
                    rng.shuffle(order)
                assert side.stdin is not None and side.stdout is not None
                side.stdin.write(f"{order[woken % len(order)]}\n")
                side.stdin.flush()
                line = side.stdout.readline()
                if not line:
                    raise SystemExit(f"the side of {builds[j][0]} stopped: see its error above")
                latencies[j].append(int(line) / 1e6)
                time.sleep(GAP_S)  # pacing, not synchronisation
        return latencies
    finally:
        for side in sides:
            if side.stdin is not None:
                side.stdin.close()
            side.wait(timeout=120)


def _build(value: str) -> tuple[str, int, int]:
    tree, _, rest = value.rpartition(":") if ":" in value else (value, "", "1")
    count, _, every = rest.partition("/")
    if not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r}: N after the ':' is a count of agents, 1 or more"
        )
    if every and (not every.isdigit() or int(every) < 1):
        raise argparse.ArgumentTypeError(
            f"{value!r}: K after the '/' is how many rounds pass between two wake-ups, 1 or more"
        )
    if not (Path(tree) / "ralph_mail" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(
            f"{tree!r} is not a checkout of ralph_mail (no ralph_mail/__init__.py): "
            "make one with 'git worktree add --detach DIR COMMIT'"
        )
    return str(Path(tree).resolve()), int(count), int(every or 1)


def _pin(value: str) -> tuple[int, int]:
    sender, _, agents = value.partition(",")
    cpus = os.sched_getaffinity(0)
    if not (sender.isdigit() and agents.isdigit() and {int(sender), int(agents)} <= cpus):
        raise argparse.ArgumentTypeError(f"{value!r}: give S,A, two CPUs of {sorted(cpus)}")
    return int(sender), int(agents)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.builds", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("builds", nargs="*", type=_build, metavar="TREE[:N[/K]]",
                        help="a checkout of the project, its waiting agents, and how many "
                             "rounds pass between two of its wake-ups")  # fmt: skip
    parser.add_argument("--samples", type=int, default=3_000,
                        help="rounds; each wakes each build without /K (default 3000)")  # fmt: skip
    parser.add_argument("--busy-us", type=int, default=0,
                        help="CPU µs each agent spends on a message (default 0)")  # fmt: skip
    parser.add_argument("--pin", type=_pin, help="S,A: the senders on CPU S, the agents on A")
    parser.add_argument("--side", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        tree, n, busy, pin = args.side
        _side(tree, int(n), int(busy), _pin(pin) if pin else None)
        return 0
    if not args.builds:
        parser.error("give at least one TREE, e.g. 'python -m bench.builds /tmp/old .'")
    if args.samples < 1 or args.busy_us < 0:
        parser.error(
            f"--samples {args.samples} --busy-us {args.busy_us}: give 1 or more, 0 or more"
        )
    names = [f"{tree}:{n}" + (f"/{every}" if every > 1 else "") for tree, n, every in args.builds]
    width = max(map(len, names))
    for name, ms in zip(
        names, compare(args.builds, args.samples, args.busy_us, args.pin), strict=True
    ):
        p50, p90, p99 = (percentile(ms, q) for q in (50, 90, 99))
        print(f"{name:<{width}}  p50 {p50:.3f} ms  p90 {p90:.3f} ms  p99 {p99:.3f} ms  "
              f"({len(ms)} wake-ups)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
