"""Where an ask's time goes: one ask between two processes, step by step.

``python -m bench.askpath`` runs a replier process and asks it ``--asks`` times; both
processes stamp each step of the ask (``time.perf_counter_ns``, one clock for both) by
wrapping the store's calls, and the report is the median of each step, then the CPU
time an ask cost each process. The stamps cost a little, so the total is above the
benchmark's ask; the steps show where it goes.

``python -m bench.askpath --instructions`` counts instead the user-space instructions
an ask costs each side, with valgrind's callgrind (installed apart: ``apt-get install
valgrind``): the difference between runs of 100 and 400 asks, after 300 to warm up, so
start-up and the first calls (imports, the codec's switch to orjson) are left out. A
count does not move with the load of a shared machine, as a time does.

Examples::

    python -m bench.askpath                   # step medians over 2,000 asks
    python -m bench.askpath --asks 300
    python -m bench.askpath --instructions    # needs valgrind; about a minute
    RALPH_SPIN_US=0 python -m bench.askpath   # no wait spins before it sleeps
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

import orjson

from bench.ask import REPLIER
from bench.common import child_env, process_cpu_us

#: Wraps the store's calls in both processes to stamp each step (the file backend's).
STAMPS: Final = r"""
import atexit, os, time
import orjson
from ralph_mail.mailbox import consuming
from ralph_mail.store.files import bells, commits, inbox, logs
from ralph_mail.talk import ask as _ask
_stamps, _ns = [], time.perf_counter_ns

def _wrap(owner, name, tag):
    real = getattr(owner, name)
    def stamped(*args, **kwargs):
        _stamps.append((tag + "0", _ns()))
        try:
            return real(*args, **kwargs)
        finally:
            _stamps.append((tag + "1", _ns()))
    setattr(owner, name, stamped)

_wrap(logs.Logs, "append", "append")
_wrap(inbox, "ring", "ring")
_wrap(bells, "wait_readable", "wait")
_wrap(logs.Logs, "read", "read")
_wrap(logs.Logs, "save_cursor", "save")
_wrap(commits.Commits, "note_commit", "note")
_wrap(_ask, "_thread_of_request", "look")
_wrap(consuming.Consuming, "wait_for_messages", "handed")

def _dump():
    with open(os.environ["ASKPATH_OUT"] + f".{os.getpid()}", "wb") as out:
        out.write(orjson.dumps(_stamps))
atexit.register(_dump)
"""

#: The stamps of one ask, in order, each (side, stamp): a step is the time from one to
#: the next, the first such stamp of that side after the one before. A ring's write
#: wakes the other side before it returns, so a ring's step runs to the wake-up.
STEPS: Final = (
    ("asker", "ask0"),
    ("asker", "append0"),
    ("asker", "ring0"),
    ("replier", "wait1"),
    ("replier", "read1"),
    ("replier", "save0"),
    ("replier", "save1"),
    ("replier", "note1"),
    ("replier", "handed1"),
    ("replier", "look0"),
    ("replier", "look1"),
    ("replier", "append0"),
    ("replier", "ring0"),
    ("asker", "wait1"),
    ("asker", "read1"),
    ("asker", "save0"),
    ("asker", "save1"),
    ("asker", "note1"),
    ("asker", "ask1"),
)

NAMES: Final = (
    "asker: the request's envelope and the Gate",
    "asker: append to the replier's inbox",
    "asker: ring its doorbell; the replier wakes",
    "replier: read its inbox",
    "replier: decode the request, read again (nothing more)",
    "replier: save its cursor",
    "replier: note the commit's time (for receipts)",
    "replier: wait_for_messages returns",
    "replier: the handler calls reply",
    "replier: look at the request's thread",
    "replier: the reply's envelope and the Gate",
    "replier: append to the asker's inbox",
    "replier: ring its doorbell; the asker wakes",
    "asker: read its inbox",
    "asker: decode the reply, find the answer",
    "asker: save its cursor",
    "asker: note the commit's time",
    "asker: ask returns",
    "the whole ask",
)

#: The CPU time rows that follow the steps (user and system, over the asks counted).
CPU_NAMES: Final = ("asker: CPU time per ask", "replier: CPU time per ask")

#: Asks before the counted ones: the codec switches to orjson after 256 calls.
WARM: Final = 300
#: Presence's once-a-second note of activity, left out of an instruction count: under
#: valgrind a second holds a few asks, not thousands.
NO_TOUCH: Final = "import ralph_mail.mailbox.box as _box\n_box._TOUCH_EVERY_S = 1e9\n"


def _env(**more: str) -> dict[str, str]:
    """The children's environment: `child_env`, keeping ``$RALPH_SPIN_US`` if set."""
    spin = os.environ.get("RALPH_SPIN_US")
    return child_env({**({"RALPH_SPIN_US": spin} if spin is not None else {}), **more})


def _ask(home: str, asks: int, *, prefix: str = "", wrap: tuple[str, ...] = (),
         stamped: bool = False) -> None:  # fmt: skip
    """Ask a replier (run under ``wrap``, with ``prefix`` run first) `WARM` + ``asks``
    times; ``stamped``: stamp the last ``asks`` (`STAMPS`) and note each side's CPU time."""
    replier = subprocess.Popen(
        [*wrap, sys.executable, "-c", prefix + REPLIER, home, str(WARM + asks), "ask",
         "replier"],
        stdout=subprocess.PIPE, env=_env(),
    )  # fmt: skip
    try:
        assert replier.stdout is not None and replier.stdout.readline() == b"ready\n"
        import ralph_mail

        bus = ralph_mail.MessageBus("ask", "asker", home)
        for _ in range(WARM):
            bus.ask("replier", "warm", timeout=300)
        stamps: list[tuple[str, int]] | None = None
        if stamped:
            namespace: dict[str, object] = {}
            exec(STAMPS, namespace)
            stamps = namespace["_stamps"]  # type: ignore[assignment]
        before = resource.getrusage(resource.RUSAGE_SELF)
        theirs = process_cpu_us(replier.pid) if stamped else 0.0
        for n in range(asks):
            if stamps is not None:
                stamps.append(("ask0", time.perf_counter_ns()))
            bus.ask("replier", str(n), timeout=300)
            if stamps is not None:
                stamps.append(("ask1", time.perf_counter_ns()))
        after = resource.getrusage(resource.RUSAGE_SELF)
        if stamped:  # the CPU time of each process over the asks counted
            cpu = [
                (_cpu(after) - _cpu(before)) / asks,
                (process_cpu_us(replier.pid) - theirs) / asks,
            ]
            Path(os.environ["ASKPATH_OUT"] + ".cpu").write_bytes(orjson.dumps(cpu))
        bus.close()
        replier.wait(timeout=600)
    finally:
        if replier.poll() is None:
            replier.kill()
            replier.wait()


def _cpu(usage: resource.struct_rusage) -> float:
    """User and system CPU time, in µs."""
    return (usage.ru_utime + usage.ru_stime) * 1e6


def trace(asks: int) -> list[tuple[str, float]]:
    """The median of each step over ``asks`` asks (µs), and the whole ask's last."""
    import ralph_mail

    with tempfile.TemporaryDirectory() as scratch:
        home = os.path.join(scratch, "home")
        ralph_mail.create_team("ask", ["asker", "replier"], home=home)
        out = os.path.join(scratch, "stamps")
        asker = subprocess.Popen(
            [sys.executable, "-m", "bench.askpath", "--child", "trace", home, str(asks)],
            env=_env(ASKPATH_OUT=out),
        )  # fmt: skip
        if asker.wait(timeout=600):
            raise SystemExit(f"askpath: the asking process failed (exit {asker.returncode})")
        runs = {path.name.rsplit(".", 1)[1]: orjson.loads(path.read_bytes())
                for path in Path(scratch).glob("stamps.*")}  # fmt: skip
    cpu = runs.pop("cpu")
    mine = runs.pop(str(asker.pid))
    [theirs] = runs.values()
    return [*_steps({"asker": mine, "replier": theirs}), *zip(CPU_NAMES, cpu, strict=True)]


def _steps(sides: dict[str, list[list[object]]]) -> list[tuple[str, float]]:
    """Each step's median over the asks, then the whole ask's (µs)."""
    events = sorted(
        (int(str(t)), side, str(tag)) for side, stamps in sides.items() for tag, t in stamps
    )
    starts = [i for i, (_, side, tag) in enumerate(events) if (side, tag) == ("asker", "ask0")]
    gaps: list[list[float]] = [[] for _ in NAMES]
    for first, after in zip(starts, [*starts[1:], len(events)], strict=True):
        one, times, at = events[first:after], [], 0
        for side, tag in STEPS:
            at = next((i for i in range(at, len(one)) if one[i][1:] == (side, tag)), -1)
            if at < 0:
                break
            times.append(one[at][0])
        if len(times) == len(STEPS):
            for gap, start, end in zip(gaps, times, times[1:], strict=False):
                gap.append((end - start) / 1000)
            gaps[-1].append((times[-1] - times[0]) / 1000)
    if not gaps[-1]:
        raise SystemExit("askpath: no ask had every step stamped")
    return [(name, statistics.median(gap)) for name, gap in zip(NAMES, gaps, strict=True)]


def instructions() -> tuple[int, int]:
    """User-space instructions per ask: (asker, replier), by callgrind."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("askpath: valgrind is not installed: apt-get install valgrind")
    import ralph_mail

    counts = []
    for side in ("asker", "replier"):
        totals = []
        for asks in (100, 400):
            with tempfile.TemporaryDirectory() as scratch:
                home = os.path.join(scratch, "home")
                ralph_mail.create_team("ask", ["asker", "replier"], home=home)
                out = os.path.join(scratch, "callgrind.%p")
                wrap = (valgrind, "--tool=callgrind", "-q", f"--callgrind-out-file={out}")
                if side == "asker":
                    command = [*wrap, sys.executable, "-m", "bench.askpath", "--child", "plain",
                               home, str(asks)]  # fmt: skip
                else:
                    command = [sys.executable, "-m", "bench.askpath", "--child", "valgrind",
                               home, str(asks), orjson.dumps(wrap).decode()]  # fmt: skip
                subprocess.run(command, env=_env(), check=True, timeout=1800)
                [found] = Path(scratch).glob("callgrind.*")
                totals.append(_total(found))
        counts.append((totals[1] - totals[0]) // 300)
    return counts[0], counts[1]


def _total(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise SystemExit(f"askpath: no totals in {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.askpath", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--asks", type=int, default=2_000, help="asks to stamp (default 2,000)")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per ask with callgrind instead")  # fmt: skip
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # a process of a run: trace, plain (under valgrind) or valgrind
        mode, home, asks, *wrap = args.child  # wrap: the replier's valgrind, as JSON
        if mode == "trace":
            _ask(home, int(asks), prefix=STAMPS, stamped=True)
        else:
            exec(NO_TOUCH, {})
            _ask(
                home, int(asks), prefix=NO_TOUCH, wrap=tuple(orjson.loads(wrap[0]) if wrap else ())
            )
        return 0
    if args.asks < 1:
        parser.error(f"--asks {args.asks}: give at least 1")
    if args.instructions:
        asker, replier = instructions()
        print(f"instructions per ask: asker {asker:,}, replier {replier:,}")
        return 0
    rows = trace(args.asks)
    width = max(len(name) for name, _ in rows)
    for name, micros in rows:
        print(f"{name:<{width}}  {micros:8.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
