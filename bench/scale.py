"""Many agents waiting on one host: idle CPU, wake-up latency and memory at N = 10, 100, 1,000.

Each N gets two hives (bench/hive.py) started side by side: N agents waiting in
``MessageBus.wait_for_messages`` (the default wait: the doorbell), and N processes each
blocked reading a FIFO, the kernel's floor for waking one of N processes, measured in
the same run so the machine's load weighs on both alike.

- Idle: once every agent got one message, the CPU of all N agents together in % of one
  core (from /proc/<pid>/schedstat) and how often they woke (voluntary context switches,
  per agent per minute), over two windows of `IDLE_S`: the first right after the mail
  (each agent's safety poll still stretching: it re-reads after 1 s and 6 s), the
  second from `SETTLE_S` on, once it re-reads every 30 s (an agent left waiting).
- Wake-up: one message at a time to one agent after another, in a shuffled order,
  alternating with a write into one FIFO of the baseline; each agent reports its
  CLOCK_MONOTONIC minus the stamp taken just before the send. p50 and p99 of each, and
  the p99 beyond the baseline's.
- A wake-up after sleep, at the largest N: one more agent, alone in a hive of its own, is
  woken `COLD_SAMPLES` times, every `COLD_S`, and between two of its wake-ups the N
  agents are woken one after another, `GAP_S` apart, so each of them sleeps longer
  than it does. The lone agent's p50 is the single agent's floor for a wake-up from
  sleep, on a host as busy, in the same seconds: what each of many agents woken in
  turn waits for. (One agent woken every few ms keeps its caches warm; one that slept
  a second while others ran has lost them.)
- Memory: each agent's resident set (VmRSS) and its own part (private pages: the
  agents are forked from one process that imported ralph_mail, as the hive does).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Final

from bench.common import Row, Section, Sizes, Workspace, percentile, ralph
from bench.hive import Counters, Hive, counters, memory

#: The numbers of waiting agents each mode measures.
SCALE_SIZES: Final = {"full": (1, 10, 100, 1000), "quick": (1, 10, 100), "smoke": (1, 3)}
#: When the steady idle window starts after the mail (s): past the safety poll's stretch.
SETTLE_S: Final = {"full": 35.0, "quick": 35.0, "smoke": 0.4}
#: Each idle window (s): as long as the safety poll's longest interval, so every agent
#: re-reads about once in it whatever its phase.
IDLE_S: Final = {"full": 30.0, "quick": 30.0, "smoke": 0.2}
#: At least this many wake-up samples per N (rounds over the agents for a small N).
MIN_SAMPLES: Final = {"full": 300, "quick": 100, "smoke": 3}
#: The pause between two wake-ups (s), so one agent's wake-up does not queue behind another's.
GAP_S: Final = 0.004
#: How long the hives may take to start every agent (s): a thousand on a loaded machine.
START_S: Final = 600.0
#: At the largest N, a lone agent is woken every this many s, `COLD_SAMPLES` times, the N
#: agents woken one after another in between: each of them sleeps as long or longer, so
#: the lone one's wake-up is the single agent's floor for theirs.
COLD_S: Final = {"full": 1.5, "quick": 1.5, "smoke": 0.05}
COLD_SAMPLES: Final = {"full": 60, "quick": 10, "smoke": 2}


def run(sizes: Sizes, ws: Workspace) -> Section:
    """One row set per N: idle CPU, wake p50/p99 beside the pipe floor, memory; and at
    the largest N, its agents and a lone one woken after sleeping."""
    sec = Section("scale", "Agents waiting on one host (idle CPU, wake-up ms, memory)")
    rm = ralph()
    top = max(SCALE_SIZES[sizes.name])
    for n in SCALE_SIZES[sizes.name]:
        rows = _rows(sec, n, rm if isinstance(rm, str) else "ok")
        cold = None
        if n == top:
            slept = f"{COLD_S[sizes.name]:g} s"
            lone = sec.add(Row("wake_lone", f"1 agent alone, woken every {slept} between "
                                            f"the {n} agents' wake-ups", "ms", "lower",
                               status=rows[0].status, extra={"p99_ms": []},
                               note="figure = p50: the single agent's floor for a wake-up "
                                    "from sleep on a host as busy"))  # fmt: skip
            many = sec.add(Row(f"wake_{n}_slept", f"{n} agents waiting, woken in turn around "
                                                  "it (each asleep longer)", "ms", "lower",
                               anchor=lone.key, status=rows[0].status,
                               extra={"p99_ms": []}, note="figure = p50"))  # fmt: skip
            cold = lone, many
        if rows[0].status != "ok":
            continue
        try:
            _measure(n, sizes.name, ws, rows, cold)
        except Exception as exc:  # one N failing must not sink the others
            for row in (*rows, *(cold or ())):
                if not row.values:
                    row.status = f"failed: {type(exc).__name__}: {exc}"
    return sec


def _rows(sec: Section, n: int, status: str) -> tuple[Row, Row, Row, Row]:
    idle = Row(f"idle_{n}", f"{n} agents waiting, idle: CPU of all together", "% core",
               "lower", status=status,
               extra={"wakeups_per_agent_min": [], "first_30s_pct": [],
                      "first_30s_wakeups_per_agent_min": []},
               note="figure: from 35 s after the last mail; extra: wake-ups per agent per "
                    "minute, and both in the 30 s right after the mail")  # fmt: skip
    pipe = Row(f"pipe_{n}", f"{n} processes blocked on a FIFO: wake-up (floor)", "ms",
               "lower", status=status, extra={"p99_ms": []}, note="figure = p50")  # fmt: skip
    wake = Row(f"wake_{n}", f"{n} agents waiting: wake-up on a send", "ms", "lower",
               anchor=pipe.key, status=status,
               extra={"p99_ms": [], "p99_beyond_floor_ms": []},
               note="figure = p50; extra: p99, and p99 minus the floor's p99")  # fmt: skip
    rss = Row(f"rss_{n}", f"{n} agents waiting: memory per agent (RSS)", "MiB", "lower",
              status=status, extra={"private_mib": []},
              note="extra: private pages per agent (forked from one importer)")  # fmt: skip
    for row in (idle, pipe, wake, rss):
        sec.add(row)
    return idle, pipe, wake, rss


def _measure(
    n: int,
    mode: str,
    ws: Workspace,
    rows: tuple[Row, Row, Row, Row],
    cold: tuple[Row, Row] | None,
) -> None:
    rm = ralph()
    assert not isinstance(rm, str)
    idle, pipe, wake, rss = rows
    home = ws.fresh(f"scale{n}")
    fifos = ws.fresh(f"scale{n}-fifos")
    names = [f"a{i}" for i in range(n)]
    rm.create_team("scale", ["sender", "lone", *names], home=home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALPH_")}
    spec = {"kind": "ralph", "agents": names, "home": str(home), "team": "scale"}
    with (
        Hive(spec, env) as bees,
        Hive({"kind": "pipe", "agents": names, "fifos": str(fifos)}, env) as floor,
    ):
        pids = list(bees.ready(START_S).values())
        floor.ready(START_S)
        bus = rm.MessageBus("scale", "sender", home=home)
        try:
            for name in names:  # one message each: every agent has read and waits again
                bus.send(name, "text", str(time.monotonic_ns()))
            for _ in names:
                bees.latency(START_S)
            windows = []
            start = time.monotonic()
            for begin in (0.0, SETTLE_S[mode]):
                time.sleep(max(0.0, start + begin - time.monotonic()))  # quiet, not a sync
                before, t0 = counters(pids), time.monotonic()
                time.sleep(IDLE_S[mode])  # the measurement window itself
                windows.append(_idle(before, counters(pids), time.monotonic() - t0, n))
            (first_cpu, first_woke), (cpu, woke) = windows
            idle.values.append(cpu)
            idle.extra["wakeups_per_agent_min"].append(woke)
            idle.extra["first_30s_pct"].append(first_cpu)
            idle.extra["first_30s_wakeups_per_agent_min"].append(first_woke)
            sizes = [memory(p) for p in pids]
            rss.values.append(statistics.median(r for r, _ in sizes))
            rss.extra["private_mib"].append(statistics.median(p for _, p in sizes))
            ours, floors = _wake_ups(n, mode, bus, names, bees, floor, str(fifos))
            if cold is not None:
                with Hive(spec | {"agents": ["lone"]}, env) as alone:
                    pairs = _cold_wake_ups(mode, bus, names, (alone, bees))
                for row, woken in zip(cold, pairs, strict=True):
                    row.values.append(percentile(woken, 50))
                    row.extra["p99_ms"].append(percentile(woken, 99))
        finally:
            bus.close()
    wake.values.append(percentile(ours, 50))
    wake.extra["p99_ms"].append(percentile(ours, 99))
    pipe.values.append(percentile(floors, 50))
    pipe.extra["p99_ms"].append(percentile(floors, 99))
    wake.extra["p99_beyond_floor_ms"].append(percentile(ours, 99) - percentile(floors, 99))


def _idle(before: dict[int, Counters], after: dict[int, Counters], wall: float, n: int
          ) -> tuple[float, float]:  # fmt: skip
    """CPU of all agents in % of a core, and wake-ups per agent per minute."""
    both = [p for p in after if p in before]
    cpu = sum(after[p].cpu_ns - before[p].cpu_ns for p in both) / 1e9
    woke = sum(after[p].wakeups - before[p].wakeups for p in both)
    return cpu / wall * 100, woke / n / wall * 60


def _wake_ups(
    n: int, mode: str, bus: object, names: list[str], bees: Hive, floor: Hive, fifos: str
) -> tuple[list[float], list[float]]:
    """Wake one agent, then one FIFO reader, and so on; both latencies in ms."""
    rng = random.Random(30)
    rounds = max(1, -(-MIN_SAMPLES[mode] // n))
    ours: list[float] = []
    floors: list[float] = []
    for _ in range(rounds):
        order = list(range(n))
        rng.shuffle(order)
        for index in order:
            bus.send(names[index], "text", str(time.monotonic_ns()))  # type: ignore[attr-defined]
            ours.append(bees.latency(60.0)[1] / 1e6)
            time.sleep(GAP_S)  # pacing, not synchronisation
            floors.append(_ring(floor, fifos, index))
            time.sleep(GAP_S)
    return ours, floors


def _cold_wake_ups(
    mode: str, bus: object, names: list[str], hives: tuple[Hive, Hive]
) -> tuple[list[float], list[float]]:
    """Once the lone agent (the first hive) has read one message, wake it every
    `COLD_S`, `COLD_SAMPLES` times, the agents of ``names`` (the second) one after
    another in between; the lone one's latencies and theirs, in ms."""
    hives[0].ready(START_S)
    bus.send("lone", "text", str(time.monotonic_ns()))  # type: ignore[attr-defined]
    hives[0].latency(START_S)  # its first mail (copy-on-write faults) is not measured
    woken: tuple[list[float], list[float]] = ([], [])
    turn = 0
    for _ in range(COLD_SAMPLES[mode]):
        slept = time.monotonic() + COLD_S[mode]
        while True:
            last = time.monotonic() >= slept
            name, side = ("lone", 0) if last else (names[turn % len(names)], 1)
            bus.send(name, "text", str(time.monotonic_ns()))  # type: ignore[attr-defined]
            woken[side].append(hives[side].latency(60.0)[1] / 1e6)
            time.sleep(GAP_S)  # pacing, not synchronisation
            if last:
                break
            turn += 1
    return woken


def _ring(floor: Hive, fifos: str, index: int) -> float:
    """Write into FIFO ``index`` of the floor's hive; its reader's latency in ms."""
    stamp = time.monotonic_ns()
    fd = os.open(os.path.join(fifos, f"{index}.fifo"), os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, f"{stamp}\n".encode())
    finally:
        os.close(fd)
    return floor.latency(60.0)[1] / 1e6
