"""Helpers of the fault suite: sizes, figures, and the checks every scenario shares.

Each scenario runs at a default size that keeps the normal test run short, and again at
full size under the ``stress`` marker (``pytest -m stress``). The figures each test adds
(messages sent, kills, injected faults, bad inputs tried, messages lost) are printed at
the end of the run by the hook in conftest.py.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import orjson
import pytest

#: The two sizes of every scenario: ``default`` runs always, ``full`` with ``-m stress``.
SCALES = [
    pytest.param("default", id="default"),
    pytest.param("full", id="full", marks=pytest.mark.stress),
]

FIGURES: Counter[str] = Counter()
FIGURE_NAMES = ("messages", "kills", "faults", "inputs", "lost")


def pick(scale: str, default: int, full: int) -> int:
    """The size for ``scale``."""
    return full if scale == "full" else default


def record(**figures: int) -> None:
    """Add to the run's figures: messages, kills, faults, inputs, lost."""
    for name, value in figures.items():
        assert name in FIGURE_NAMES, name
        FIGURES[name] += value


def summary() -> list[str]:
    """The figures as lines for the end of the test run (empty when no fault test ran)."""
    if not FIGURES:
        return []
    parts = ", ".join(f"{name} {FIGURES[name]:,}" for name in FIGURE_NAMES)
    return [f"fault suite: {parts}"]


def body_sizes(rng: random.Random, count: int, largest: int) -> list[int]:
    """Body sizes from 10 bytes to ``largest``: log-uniform up to 8 KiB, and 2 % log-uniform
    above, so large lines are frequent enough to overlap, without gigabytes of mail."""
    sizes = []
    for _ in range(count):
        low, high = (8192, largest) if rng.random() < 0.02 else (10, 8192)
        sizes.append(int(math.exp(rng.uniform(math.log(low), math.log(high)))))
    return sizes


def lines_of(path: Path) -> list[bytes]:
    """The newline-terminated lines of a file (a last unterminated piece is dropped)."""
    data = path.read_bytes()
    return data.split(b"\n")[:-1]


def dead_letters(team_root: Path, agent: str) -> list[dict[str, object]]:
    """The dead-letter records of ``agent``'s inbox."""
    path = team_root / "deadletters" / f"{agent}.jsonl"
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` with (mode, size, mtime_ns): to prove nothing was written."""
    found = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        found[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def counts(items: Iterable[str]) -> Counter[str]:
    """How many times each item appears."""
    return Counter(items)
