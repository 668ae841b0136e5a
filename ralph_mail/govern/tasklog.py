"""The team's task log: who holds which task, in what state, folded from its events.

Every task given out in a team (a `MessageBus.delegate`, the lead's ``assign``) is an
event in the team log ``tasks`` (append-only, one JSON object a line): ``created``, then
``status`` changes, ``lease`` renewals, ``reassigned``, ``stalled`` (the delegator was
told of a lapsed lease) and ``notified`` (the delegator was sent its ``task_result``).
Reading folds the log; nothing is rewritten, so a crash leaves the log as it was before
or after one whole event. The acts that write it are `ralph_mail.talk.tasks`; it lives
here, with the rules, because the Gate checks answers against it: a ``task_result``
only from the task's assignee for its current assignment, a ``task_canceled`` only from
the agent that canceled it, a ``task_stalled`` only for a lease that lapsed.

The states are A2A 1.0's, so a gateway maps them one to one: ``submitted``, ``working``,
``input_required`` (the assignee asked its delegator something in the task's thread and
waits), then one outcome: ``completed``, ``failed``, ``canceled`` or ``rejected``. The
first outcome stands: a later one is ignored, and a result that comes after it is kept
as ``late``. Logs written before those names read as they are now: ``pending`` is
``submitted``, ``active`` is ``working``.

Two states are derived when the log is read, from the clock, so they hold with no
process running: an open task past its ``deadline`` has ``failed`` ("deadline passed"),
and an open subtask of a task that ended so, with the same deadline (capped at its
parent's), or of a canceled task, is ``canceled``; a ``working`` task whose lease ran
out (no renewal by its assignee's process) is ``stalled``.

Example:
    >>> [(t.id, t.status) for t in load(store)[0].values()]  # doctest: +SKIP
    [('T-100', 'working'), ('t-3f2a', 'completed')]
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ralph_mail import codec
from ralph_mail.errors import MailError
from ralph_mail.message import MANY_LINES, format_ts

if TYPE_CHECKING:
    from ralph_mail.store.base import TeamStore

#: The team log the task events go to.
LOG: Final = "tasks"
#: The state key of the snapshot `load` keeps, and how many new events make it save one.
SNAPSHOT_KEY: Final = "tasks.fold"
SNAPSHOT_EVERY: Final = 1000
#: A task's states (A2A 1.0's names), in the order a task goes through them.
STATES: Final = ("submitted", "working", "input_required", "completed", "failed", "canceled",
                 "rejected")  # fmt: skip
#: The states of a task still being worked on, and those of one that ended.
OPEN: Final = frozenset({"submitted", "working", "input_required"})
FINISHED: Final = frozenset({"completed", "failed", "canceled", "rejected"})
#: The states the assignee reports, each sent to the delegator as a ``task_result``.
REPORTED: Final = frozenset({"completed", "failed", "rejected"})
#: The names logs written before A2A's were adopted use, and what they are now.
LEGACY: Final = {"pending": "submitted", "active": "working"}
#: The result of a task whose deadline passed before it ended.
DEADLINE_PASSED: Final = "deadline passed"


@dataclass(frozen=True, slots=True)
class Task:
    """One delegated task, as the task log has it at the time it was read.

    Attributes:
        id: the task id (``metadata.taskId`` of its assignment).
        description: what is to be done.
        delegated_by: who gave it out.
        assignee: who does it (after a reassignment, the new one).
        parent: the task it is part of, or None.
        priority: ``low``, ``normal``, ``high`` or ``urgent``.
        status: one of `STATES`.
        result: the result, the error or the reason, once it ended ("" before).
        created: when it was given out (UTC ISO-8601).
        updated: when its status last changed.
        assignment: the id of its current ``task_assignment`` message.
        notified: whether the delegator was sent its ``task_result``.
        held_until: for a task given to a sleeping agent, when its sleep ends: the
            assignment is held until then ("" when it was sent at once).
        deadline: when it fails if it has not ended (UTC ISO-8601; "" for none).
        lease_until: while it is worked on, when its lease runs out unless renewed.
        ended_by: who ended it when that was not a deadline: its assignee, the agent
            that canceled it, the approver that denied its assignment.
        late: a result its assignee sent after it had ended (kept, never delivered).
        reassigned_from: the assignee before the last reassignment ("" for none).
        told: the lease (``lease_until``) whose lapse the delegator was told of, and
            the teller's mark; "" before.
        stalled: it is working and its lease ran out: its assignee's process is gone.
    """

    id: str
    description: str
    delegated_by: str
    assignee: str
    parent: str | None
    priority: str
    status: str
    result: str
    created: str
    updated: str
    assignment: str
    notified: bool = False
    held_until: str = ""
    deadline: str = ""
    lease_until: str = ""
    ended_by: str = ""
    late: str = ""
    reassigned_from: str = ""
    told: str = ""
    stalled: bool = False

    @property
    def open(self) -> bool:
        """Whether it is still being worked on (submitted, working, input_required)."""
        return self.status in OPEN

    def to_dict(self) -> dict[str, Any]:
        """The task as ``ralph-mail tasks --json`` prints it."""
        return {
            "id": self.id,
            "description": self.description,
            "delegated_by": self.delegated_by,
            "assignee": self.assignee,
            "parent": self.parent,
            "priority": self.priority,
            "status": self.status,
            "stalled": self.stalled,
            "result": self.result,
            "created": self.created,
            "updated": self.updated,
            "held_until": self.held_until,
            "deadline": self.deadline,
            "lease_until": self.lease_until,
            "ended_by": self.ended_by,
            "late": self.late,
            "reassigned_from": self.reassigned_from,
        }


# -- events ---------------------------------------------------------------------------------


def _line(event: dict[str, Any]) -> bytes:
    return codec.dumps_line(event)


def created(task: Task) -> bytes:
    """The log line that records a new task."""
    event = {"e": "created", "id": task.id, "description": task.description,
             "delegated_by": task.delegated_by, "assignee": task.assignee,
             "parent": task.parent, "priority": task.priority, "created": task.created,
             "held_until": task.held_until, "assignment": task.assignment}  # fmt: skip
    if task.deadline:
        event["deadline"] = task.deadline
    return _line(event)


def changed(
    task_id: str,
    status: str,
    ts: str,
    result: str = "",
    since: int = -1,
    *,
    by: str = "",
    until: str = "",
) -> bytes:
    """The log line that records a status change (``since``: where the delegator's inbox
    ended when an outcome was recorded, to look for its result there after a crash;
    ``by``: who ended it; ``until``: the lease a start takes)."""
    event: dict[str, Any] = {"e": "status", "id": task_id, "status": status, "ts": ts}
    if status in FINISHED:
        event["result"] = result
        event["since"] = since
    if by:
        event["by"] = by
    if until:
        event["until"] = until
    return _line(event)


def leased(task_id: str, until: str, ts: str) -> bytes:
    """The log line that renews a task's lease until ``until`` (starting it if it was
    only submitted)."""
    return _line({"e": "lease", "id": task_id, "until": until, "ts": ts})


def reassigned(task_id: str, assignee: str, assignment: str, by: str, ts: str) -> bytes:
    """The log line that gives a task to ``assignee`` instead, under a new assignment."""
    return _line({"e": "reassigned", "id": task_id, "assignee": assignee,
                  "assignment": assignment, "by": by, "ts": ts})  # fmt: skip


def stalled(task_id: str, until: str, mark: str) -> bytes:
    """The log line that claims the telling of a lapse of the lease ``until``: the first
    such line (its ``mark``) tells, the others do not."""
    return _line({"e": "stalled", "id": task_id, "until": until, "mark": mark})


def notified(task_id: str) -> bytes:
    """The log line that records that the delegator was sent the result."""
    return _line({"e": "notified", "id": task_id})


# -- folding ----------------------------------------------------------------------------------


def fold(log: bytes, now: str | None = None) -> tuple[dict[str, Task], dict[str, int]]:
    """The tasks the log describes, in the order they were created, as of ``now`` (a ts;
    default the clock), and for each finished one the ``since`` offset its outcome
    recorded. Lines that do not parse are skipped."""
    state: dict[str, list[Any]] = {}
    since: dict[str, int] = {}
    _apply(state, since, log)
    return _build(state, now), since


def load(store: TeamStore, now: str | None = None) -> tuple[dict[str, Task], dict[str, int]]:
    """`fold` of the team's task log, from a snapshot of an earlier fold when there is
    one: the cost follows the tasks and the events since, not every event ever written.

    The snapshot (state ``tasks.fold``) is derived: it records how far into the log it
    folded and the bytes just before that point, and is ignored when the log no longer
    holds them (a team made again) or it does not parse; it is saved again once enough
    new events came. A snapshot an earlier version saved (fewer fields, the old state
    names) is read as its log would be.
    """
    log = store.log_read(LOG)
    state: dict[str, list[Any]] = {}
    since: dict[str, int] = {}
    start = 0
    raw = store.load_state(SNAPSHOT_KEY)
    if raw:
        try:
            snapshot = codec.loads(raw)
            offset = int(snapshot["offset"])
            rows = snapshot["tasks"]
            if (
                0 < offset <= len(log)
                and log[max(0, offset - 64) : offset].hex() == snapshot["mark"]
                and all(isinstance(row, list) and len(row) in _ROW_LENGTHS for row in rows)
            ):
                state = {str(row[0]): _upgraded(row) for row in rows}
                since, start = {str(k): int(v) for k, v in snapshot["since"].items()}, offset
        except (codec.DecodeError, KeyError, TypeError, ValueError, AttributeError):
            state, since, start = {}, {}, 0
    events = _apply(state, since, log[start:])
    if events >= SNAPSHOT_EVERY:
        snapshot = {"offset": len(log), "mark": log[max(0, len(log) - 64) :].hex(),
                    "tasks": list(state.values()), "since": since}  # fmt: skip
        with contextlib.suppress(MailError):  # a cache: a failure only costs the next fold
            store.save_state(SNAPSHOT_KEY, codec.dumps(snapshot))
    return _build(state, now), since


# A task while folding: a list of its fields in `Task`'s order but the derived `stalled`
# (cheaper than a dict to change, to save and to build a Task from), and the positions
# events change. A snapshot saved before the lifecycle fields came has 13 of them.
_FIELDS = 19
_ROW_LENGTHS = (13, _FIELDS)
_ASSIGNEE, _PARENT, _STATUS, _RESULT, _UPDATED, _ASSIGNMENT, _NOTIFIED = 3, 4, 6, 7, 9, 10, 11
_DEADLINE, _LEASE, _BY, _LATE, _FROM, _TOLD = 13, 14, 15, 16, 17, 18


def _upgraded(row: list[Any]) -> list[Any]:
    """A snapshot's row as this version folds it: the fields added since, at their
    defaults, and the state's name as it is now."""
    if len(row) < _FIELDS:
        row = [*row, "", "", "", "", "", ""][:_FIELDS]
    row[_STATUS] = LEGACY.get(row[_STATUS], row[_STATUS])
    return row


def _apply(state: dict[str, list[Any]], since: dict[str, int], log: bytes) -> int:
    """Fold the events of ``log`` into ``state`` and ``since``; return how many lines it
    read. Events change plain lists, and each `Task` is built once at the end:
    ``dataclasses.replace`` per event made a 100,000-event log take 0.8 s."""
    lines = log.splitlines()
    loads = codec.fast().loads if len(lines) > MANY_LINES else codec.loads
    for line in lines:
        try:
            event = loads(line)
            kind, task_id = event["e"], event["id"]
            if kind == "created":
                created = event["created"]
                state[task_id] = [
                    task_id, event["description"], event["delegated_by"], event["assignee"],
                    event.get("parent"), event.get("priority", "normal"), "submitted", "",
                    created, created, event.get("assignment", ""), False,
                    str(event.get("held_until", "")), str(event.get("deadline", "")),
                    "", "", "", "", "",
                ]  # fmt: skip
                continue
            task = state.get(task_id)
            if task is None:
                continue
            if kind == "status":
                _status(task, since, event, state)
            elif kind == "lease":
                _lapse(task, str(event["ts"]), state)
                if task[_STATUS] in OPEN:
                    task[_LEASE] = str(event["until"])
                    if task[_STATUS] == "submitted":
                        task[_STATUS], task[_UPDATED] = "working", str(event["ts"])
            elif kind == "reassigned":
                _lapse(task, str(event["ts"]), state)
                if task[_STATUS] in OPEN:
                    task[_FROM], task[_ASSIGNEE] = task[_ASSIGNEE], str(event["assignee"])
                    task[_ASSIGNMENT], task[_STATUS] = str(event["assignment"]), "submitted"
                    task[_UPDATED], task[_LEASE] = str(event["ts"]), ""
            elif kind == "stalled":
                if not str(task[_TOLD]).startswith(f"{event['until']} "):
                    task[_TOLD] = f"{event['until']} {event['mark']}"
            elif kind == "notified":
                task[_NOTIFIED] = True
        except (codec.DecodeError, KeyError, TypeError, ValueError):
            continue
    return len(lines)


def _status(
    task: list[Any], since: dict[str, int], event: dict[str, Any], state: dict[str, list[Any]]
) -> None:
    """Apply one status event: the first outcome stands; a result after it is late."""
    status, ts = LEGACY.get(event["status"], event["status"]), event["ts"]
    if not isinstance(status, str) or not isinstance(ts, str) or status not in STATES:
        return
    result, by = str(event.get("result", "")), str(event.get("by", ""))
    deadline = status == "failed" and result == DEADLINE_PASSED and task[_DEADLINE]
    if deadline:  # the deadline's own outcome, reported: it ended at the deadline
        ts, by = min(ts, task[_DEADLINE]), ""
    else:
        _lapse(task, ts, state)
    if task[_STATUS] not in OPEN:
        if (status, result) == (task[_STATUS], task[_RESULT]):  # the same outcome again
            if "since" in event:
                since.setdefault(task[0], int(event["since"]))
        elif status in ("completed", "failed") and by in ("", task[_ASSIGNEE]):
            task[_LATE] = result
        return
    if status in FINISHED:
        task[_RESULT], task[_BY], task[_LEASE] = result, by, ""
        if "since" in event:
            since[task[0]] = int(event["since"])
    elif "until" in event:
        task[_LEASE] = str(event["until"])
    task[_STATUS], task[_UPDATED] = status, ts
    if status == "canceled":
        _cancel_below(state, task, ts)


def _cancel_below(state: dict[str, list[Any]], root: list[Any], ts: str) -> None:
    """Cancel every open task below ``root`` (just canceled) with it: in the log's order,
    so what a subtask's assignee reports after it is late, whatever the clocks say."""
    children: dict[str, list[list[Any]]] = {}
    for row in state.values():
        if row[_PARENT] is not None:
            children.setdefault(row[_PARENT], []).append(row)
    todo, seen = [root[0]], {root[0]}
    while todo:
        for row in children.get(todo.pop(), ()):
            if row[0] in seen:
                continue
            seen.add(row[0])
            todo.append(row[0])
            if row[_STATUS] in OPEN:
                row[_STATUS], row[_RESULT] = "canceled", f"{root[0]} was canceled"
                row[_BY], row[_UPDATED], row[_LEASE] = root[_BY], ts, ""


def _lapse(task: list[Any], ts: str, state: dict[str, list[Any]]) -> None:
    """An open task whose deadline passed before ``ts`` ended then (see `_expired`)."""
    if task[_STATUS] in OPEN and task[_DEADLINE] and ts > task[_DEADLINE]:
        parent = state.get(task[_PARENT]) if task[_PARENT] is not None else None
        ends = "" if parent is None else _ends_at(parent[_STATUS], parent[_BY],
                                                   parent[_UPDATED], parent[_DEADLINE])  # fmt: skip
        _expired(task, parent[0] if parent is not None and ends == task[_DEADLINE] else None)


def _ends_at(status: str, by: str, updated: str, deadline: str) -> str:
    """The deadline a task ends at (it is open past it, or the clock ended it), or ""."""
    if status in OPEN or (not by and updated == deadline and status in ("failed", "canceled")):
        return deadline
    return ""


def _expired(task: list[Any], parent: str | None) -> None:
    """End ``task`` at its deadline: it failed; or it was canceled with ``parent``, when
    that ends at the same deadline (its subtask's deadline is capped at its own)."""
    if parent is not None:
        task[_STATUS], task[_RESULT] = "canceled", f"the deadline of {parent} passed"
    else:
        task[_STATUS], task[_RESULT] = "failed", DEADLINE_PASSED
    task[_UPDATED], task[_BY], task[_LEASE] = task[_DEADLINE], "", ""


def _build(state: dict[str, list[Any]], now: str | None) -> dict[str, Task]:
    """The `Task` of each row as of ``now``: what the clock ended (deadlines) and what
    it stalled (lapsed leases); each parent before its subtasks, which it may end."""
    if now is None:
        now = format_ts(time.time_ns() // 1000)
    built: dict[str, Task] = {}

    def build(task_id: str, depth: int) -> Task:
        known = built.get(task_id)
        if known is not None:
            return known
        row = state[task_id]
        parent_id = row[_PARENT]
        parent = None
        if parent_id in state and parent_id != task_id and depth < _DEPTH_FOLLOWED:
            parent = build(parent_id, depth + 1)
        fields = list(row)
        if fields[_STATUS] in OPEN and "" < fields[_DEADLINE] <= now:
            ends = "" if parent is None else _ends_at(parent.status, parent.ended_by,
                                                       parent.updated, parent.deadline)  # fmt: skip
            _expired(fields, parent.id if parent is not None and ends == fields[_DEADLINE]
                     else None)  # fmt: skip
        lapsed = fields[_STATUS] in ("working", "input_required") and "" < fields[_LEASE] < now
        fields.append(lapsed)  # `stalled`, the one field no event sets
        task = built[task_id] = Task(*fields)
        return task

    for task_id in state:
        build(task_id, 0)
    return {task_id: built[task_id] for task_id in state}


#: How many parents up `_build` looks for what ended a task: a chain of subtasks deeper
#: than this is read as its own (a cycle of parents never loops).
_DEPTH_FOLLOWED: Final = 200


def lease_seconds(config: dict[str, str]) -> int:
    """The team's lease (``task_lease``, s): how long a working task's assignee may go
    without renewing it before the task counts as stalled."""
    from ralph_mail import settings

    return max(1, settings.team_setting("task_lease", config))
