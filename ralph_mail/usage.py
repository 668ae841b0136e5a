"""What agents cost: the figures a job reports, the team's usage log, and its rollups.

A job of ``ralph-mail run`` reports what it cost in one of two ways, and the runner
records what it reports (a job that reports nothing costs nothing it knows of):

- Claude Code's ``--output-format json`` on standard output: one JSON object with
  ``"type": "result"``, its ``total_cost_usd``, its ``usage`` (``input_tokens``,
  ``output_tokens``, ``cache_read_input_tokens``, ``cache_creation_input_tokens``) and
  ``result``, the answer's text (`from_claude`); ``is_error`` makes the job a failure.
- any command: a JSON object ``{"input_tokens", "output_tokens", "cost_usd"}`` written to
  the file named by ``$RALPH_USAGE_FILE``, which the runner makes, empty, for each job
  (`children.report_file`, `read_report`). What is written there wins over standard output.

Each job's figures are one `Record` in the team log ``usage`` (append-only, one JSON
object a line, like the task log); `load` reads it, `rollup` sums it by agent or task,
`subtree_costs` adds each task's subtasks. The agent's spend is also kept per minute,
for the last day, in state ``spend.AGENT`` (`spend_in`): what a budget is checked
against, at the cost of one small read, whatever the log's length. Costs are summed in
millionths of a dollar, so that five jobs of $0.01 make $0.05 exactly.

Example:
    >>> from_claude('{"type": "result", "result": "42", "total_cost_usd": 0.01}').answer
    '42'
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ralph_mail import children, codec
from ralph_mail.message import format_ts

if TYPE_CHECKING:
    from ralph_mail.store.base import TeamStore

#: The team log the records go to, and the state prefix of each agent's spend.
LOG: Final = "usage"
SPEND: Final = "spend."
#: How far back the spend is kept (the longest budget window), in minutes.
KEPT_MINUTES: Final = 24 * 60
#: The most of a usage file read: a report is a few numbers.
REPORT_MAX_BYTES: Final = 64 * 1024
#: The environment variable that names a job's usage file.
USAGE_FILE_VAR: Final = "RALPH_USAGE_FILE"
_MICRO: Final = 1_000_000


@dataclass(frozen=True, slots=True)
class Usage:
    """What one job cost.

    Attributes:
        input_tokens: tokens read (the prompt).
        output_tokens: tokens written.
        cache_read_tokens: input tokens read from a prompt cache.
        cache_write_tokens: input tokens written to a prompt cache.
        cost_usd: what it cost, in US dollars.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: float = 0.0

    @property
    def micro_usd(self) -> int:
        """The cost in millionths of a dollar (what sums are made of)."""
        return round(self.cost_usd * _MICRO)

    def metadata(self) -> dict[str, str]:
        """The figures as a reply's or a task result's metadata."""
        return {"cost_usd": usd(self.cost_usd), "input_tokens": str(self.input_tokens),
                "output_tokens": str(self.output_tokens)}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cache_read_tokens": self.cache_read_tokens,
                "cache_write_tokens": self.cache_write_tokens,
                "cost_usd": self.cost_usd}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Reported:
    """What Claude Code's JSON output says: the cost, the answer, and the error when
    the run failed ("" when it did not)."""

    usage: Usage
    answer: str
    error: str = ""


def usd(amount: float) -> str:
    """A dollar amount as written in metadata and records: up to six decimals.

    >>> usd(0.05), usd(1.5), usd(0)
    ('0.05', '1.5', '0')
    """
    text = f"{amount:.6f}".rstrip("0").rstrip(".")
    return text or "0"


def _count(value: object, what: str) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (0 <= value < 2**53 and float(value).is_integer())
    ):
        raise ValueError(f"{what} {value!r} is not a whole number >= 0")
    return int(value)


def _dollars(value: object, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and 0 <= value < 1e9)
    ):
        raise ValueError(f"{what} {value!r} is not an amount >= 0")
    return float(value)


def from_report(document: object) -> Usage:
    """The `Usage` in a usage file's object (``input_tokens``, ``output_tokens``,
    ``cost_usd``; the cache counts too); `ValueError` naming what is wrong."""
    if not isinstance(document, dict):
        raise ValueError("it is not a JSON object")
    known = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")
    counts = {key: _count(document.get(key, 0), key) for key in known}
    return Usage(**counts, cost_usd=_dollars(document.get("cost_usd", 0), "cost_usd"))


def from_claude(stdout: str) -> Reported | None:
    """What Claude Code's ``--output-format json`` printed, or None when ``stdout`` is
    not that (then it is the answer as it is)."""
    text = stdout.strip()
    if not (text.startswith("{") and text.endswith("}") and '"result"' in text):
        return None
    try:
        document = codec.loads(text)
    except codec.DecodeError:
        return None
    if not isinstance(document, dict) or document.get("type") != "result":
        return None
    counts = document.get("usage")
    counts = counts if isinstance(counts, dict) else {}
    try:
        spent = Usage(_count(counts.get("input_tokens", 0), "input_tokens"),
                      _count(counts.get("output_tokens", 0), "output_tokens"),
                      _count(counts.get("cache_read_input_tokens", 0), "cache reads"),
                      _count(counts.get("cache_creation_input_tokens", 0), "cache writes"),
                      _dollars(document.get("total_cost_usd", 0), "total_cost_usd"))  # fmt: skip
    except ValueError:
        return None
    answer = document.get("result")
    answer = answer if isinstance(answer, str) else ""
    error = ""
    if document.get("is_error") is True:
        error = answer or f"claude stopped: {document.get('subtype', 'error')}"
    return Reported(spent, answer, error)


def read_report(path: Path) -> Usage | None:
    """What a job wrote to its usage file: None when it wrote nothing; `ValueError`
    naming the problem when it wrote something else than a report."""
    data = children.read_back(path, REPORT_MAX_BYTES)
    if not data.strip():
        return None
    if len(data) > REPORT_MAX_BYTES:
        raise ValueError(f"it is over {REPORT_MAX_BYTES:,} bytes")
    try:
        return from_report(codec.loads(data))
    except codec.DecodeError:
        raise ValueError("it is not JSON") from None


# -- the log -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """One job's cost, as the team's usage log keeps it.

    Attributes:
        ts: when it was recorded (UTC ISO-8601).
        agent: whose job (who pays).
        usage: what it cost.
        pattern: ``ask``, ``delegate`` or ``mention``.
        message: the id of the request it answered.
        requester: who asked.
        task: the task it worked on, for a delegation (else None).
    """

    ts: str
    agent: str
    usage: Usage
    pattern: str = ""
    message: str = ""
    requester: str = ""
    task: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as the log and ``usage --json`` write it (without its task when
        it has none)."""
        found: dict[str, Any] = {"ts": self.ts, "agent": self.agent, **self.usage.to_dict(),
                                 "pattern": self.pattern, "message": self.message,
                                 "requester": self.requester}  # fmt: skip
        if self.task is not None:
            found["task"] = self.task
        return found


def record(store: TeamStore, entry: Record) -> None:
    """Append ``entry`` to the usage log, then add it to its agent's spend."""
    store.log_append(LOG, codec.dumps_line(entry.to_dict()))
    minute = str(int(_seconds(entry.ts) // 60))
    cost = entry.usage.micro_usd

    def add(raw: bytes | None) -> bytes:
        buckets = _buckets(raw)
        oldest = int(minute) - KEPT_MINUTES
        kept = {key: value for key, value in buckets.items() if int(key) > oldest}
        kept[minute] = kept.get(minute, 0) + cost
        return codec.dumps({"m": kept})

    if cost:
        store.update_state(f"{SPEND}{entry.agent}", add)


def _seconds(ts: str) -> float:
    from ralph_mail.message import parse_ts

    return parse_ts(ts)


def _buckets(raw: bytes | None) -> dict[str, int]:
    """The minute buckets of a spend state (a damaged one: none, a cache of the log)."""
    try:
        found = codec.loads(raw) if raw else {}
        buckets = found.get("m", {}) if isinstance(found, dict) else {}
        return {str(int(k)): int(v) for k, v in buckets.items()}
    except (codec.DecodeError, AttributeError, TypeError, ValueError):
        return {}


def spend_in(store: TeamStore, agent: str, window_s: float,
             now: float | None = None) -> tuple[int, list[tuple[int, int]]]:  # fmt: skip
    """What ``agent`` spent in the last ``window_s`` seconds (to the minute), in
    millionths of a dollar, and the minutes it was spent in with their amounts, oldest
    first (minutes since the epoch)."""
    current = int((time.time() if now is None else now) // 60)
    first = current - int(window_s // 60) + 1
    buckets = _buckets(store.load_state(f"{SPEND}{agent}"))
    inside = sorted((int(k), v) for k, v in buckets.items() if first <= int(k) <= current)
    return sum(v for _, v in inside), inside


def load(store: TeamStore, since: str | None = None) -> list[Record]:
    """The usage log's records (those from ``since`` on, a ts), oldest first; lines that
    do not parse are skipped."""
    found = []
    for line in store.log_read(LOG).splitlines():
        try:
            item = codec.loads(line)
            ts = str(item["ts"])
            if since is not None and ts < since:
                continue
            task = item.get("task")
            found.append(Record(ts, str(item["agent"]), from_report(item),
                                str(item.get("pattern", "")), str(item.get("message", "")),
                                str(item.get("requester", "")),
                                str(task) if task is not None else None))  # fmt: skip
        except (codec.DecodeError, KeyError, TypeError, ValueError):
            continue
    return found


# -- rollups -------------------------------------------------------------------------------


@dataclass
class Total:
    """A rollup's row: ``key`` (an agent, or a task id: "" for jobs of no task), how
    many ``jobs``, their tokens and their cost (in millionths of a dollar)."""

    key: str
    jobs: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    micro_usd: int = 0
    agents: list[str] = field(default_factory=list)

    @property
    def cost_usd(self) -> float:
        return self.micro_usd / _MICRO

    def to_dict(self, by: str) -> dict[str, Any]:
        found: dict[str, Any] = {by: self.key or None, "jobs": self.jobs,
                                 "input_tokens": self.input_tokens,
                                 "output_tokens": self.output_tokens,
                                 "cost_usd": self.cost_usd}  # fmt: skip
        if by == "task":
            found["agents"] = self.agents
        return found


def rollup(records: list[Record], by: str = "agent") -> list[Total]:
    """The records summed by ``by`` (``agent`` or ``task``), costliest first."""
    totals: dict[str, Total] = {}
    for entry in records:
        key = entry.agent if by == "agent" else entry.task or ""
        total = totals.get(key)
        if total is None:
            total = totals[key] = Total(key)
        total.jobs += 1
        total.input_tokens += entry.usage.input_tokens
        total.output_tokens += entry.usage.output_tokens
        total.micro_usd += entry.usage.micro_usd
        if entry.agent not in total.agents:
            total.agents.append(entry.agent)
    return sorted(totals.values(), key=lambda t: (-t.micro_usd, t.key))


def task_costs(records: list[Record]) -> dict[str, int]:
    """Each task's own cost (its jobs'), in millionths of a dollar."""
    costs: dict[str, int] = {}
    for entry in records:
        if entry.task is not None:
            costs[entry.task] = costs.get(entry.task, 0) + entry.usage.micro_usd
    return costs


def subtree_costs(own: Mapping[str, int], parents: Mapping[str, str | None]) -> dict[str, int]:
    """Each task's cost with all its subtasks' (``parents``: task -> its parent), in
    millionths of a dollar: every cost is added to its task and to each task above it,
    once, however the parents are tangled.

    >>> subtree_costs({"a": 1, "b": 2, "c": 4}, {"a": None, "b": "a", "c": "b"})
    {'a': 7, 'b': 6, 'c': 4}
    """
    totals = {task: 0 for task in parents}
    for task, cost in own.items():
        seen: set[str] = set()
        at: str | None = task
        while at is not None and at in totals and at not in seen:
            seen.add(at)
            totals[at] += cost
            at = parents.get(at)
    return totals


def now_ts() -> str:
    """The time now, as records carry it."""
    return format_ts(time.time_ns() // 1000)
