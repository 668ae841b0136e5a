"""Operations over the whole team at 10, 100 and 1,000 members: each should cost
O(members) with a small constant, so ten times the members costs at most ten times the time.

- ``team create``: `create_team` with N members (an inbox, a base record each).
- ``broadcast``: one message to the N-1 others, from the lead's warm bus.
- ``status`` and ``who``: ``ralph-mail presence`` and ``ralph-mail agents`` as processes
  (everyone's presence; the roster with presence), whole runs.
- a roster change: `update_team` giving one member a new description (the roster read,
  checked and rewritten atomically).
- ``top``'s first paint: from making the dashboard to its first screen (N agents, one
  message each), as bench/dashboard.py times it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Final

from bench.common import Row, Section, Sizes, Workspace, child_env, optional_module, ralph

#: Team sizes each mode measures.
MEMBER_SIZES: Final = {"full": (10, 100, 1000), "quick": (10, 100, 1000), "smoke": (3,)}
#: Repetitions of each timed case (the CLI cases start an interpreter each time).
REPS: Final = {"full": 5, "quick": 3, "smoke": 1}

CASES: Final = {
    "create": "team create",
    "broadcast": "broadcast from the lead",
    "status": "ralph-mail presence (everyone's presence), whole process",
    "who": "ralph-mail agents (the roster), whole process",
    "roster": "a roster change (update_team)",
    "top": "top: first paint",
}


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Each case at each team size; the rows of one case anchor on its smallest size."""
    sec = Section("members", "Operations over the whole team, by team size (ms)")
    rm = ralph()
    textual = optional_module("textual")
    counts = MEMBER_SIZES[sizes.name]
    for case, label in CASES.items():
        for n in counts:
            status = rm if isinstance(rm, str) else "ok"
            if case == "top" and isinstance(textual, str):
                status = textual
            sec.add(Row(f"{case}_{n}", f"{label}, {n:,} members", "ms", "lower", status=status,
                        anchor=None if n == counts[0] else f"{case}_{counts[0]}"))  # fmt: skip
    if isinstance(rm, str):
        return sec
    for n in counts:
        try:
            _measure(n, REPS[sizes.name], ws, sec)
        except Exception as exc:  # one size failing must not sink the others
            for case in CASES:
                row = sec.row(f"{case}_{n}")
                if row is not None and not row.values and row.status == "ok":
                    row.status = f"failed: {type(exc).__name__}: {exc}"
    return sec


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _measure(n: int, reps: int, ws: Workspace, sec: Section) -> None:
    rm = ralph()
    assert not isinstance(rm, str)
    names = ["lead", *(f"a{i}" for i in range(1, n))]

    def row(case: str) -> Row:
        found = sec.row(f"{case}_{n}")
        assert found is not None
        return found

    from ralph_mail.team import update_team

    rm.create_team("warm", ["a", "b"], home=ws.fresh(f"members{n}-warm"))  # imports done
    for rep in range(reps):
        home = ws.fresh(f"members{n}-{rep}")
        row("create").values.append(_timed(lambda home=home: rm.create_team("t", names, home=home)))
    bus = rm.MessageBus("t", "lead", home=home)
    try:
        bus.broadcast("warm-up")  # the lead's descriptors are open, as in a running lead
        for _ in range(reps):
            row("broadcast").values.append(_timed(lambda: bus.broadcast("tests are green")))
    finally:
        bus.close()
    for case, command in (("status", "presence"), ("who", "agents")):
        argv = [sys.executable, "-m", "ralph_mail", command, "--team", "t", "--home", str(home)]
        for _ in range(reps):
            t0 = time.perf_counter()
            done = subprocess.run(argv, capture_output=True, env=child_env(), timeout=300)
            elapsed = (time.perf_counter() - t0) * 1e3
            if done.returncode != 0:
                raise RuntimeError(f"{command}: {done.stderr.decode(errors='replace')[-300:]}")
            row(case).values.append(elapsed)
    for rep in range(reps):
        change = lambda rep=rep: update_team(  # noqa: E731
            "t", home, member=names[-1], description=f"take {rep}"
        )
        row("roster").values.append(_timed(change))
    if row("top").status == "ok":
        row("top").values.extend(_first_paints(str(home), reps))


def _first_paints(home: str, reps: int) -> list[float]:
    from ralph_mail.dashboard import Dashboard

    async def first() -> float:
        t0 = time.perf_counter()
        app = Dashboard("t", home)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause()
            return (time.perf_counter() - t0) * 1e3

    return [asyncio.run(first()) for _ in range(reps)]
