"""Delegated tasks: the team's task log, folded into `Task` records and drawn as a tree.

Every task given out in a team (a `MessageBus.delegate`, the lead's ``assign``) is an
event in the team log ``tasks`` (append-only, one JSON object a line): ``created``,
then ``status`` changes (``active``, ``completed``, ``failed``), then ``notified`` once
the delegator was sent its ``task_result``. Reading folds the log; nothing is rewritten,
so a crash leaves the log as it was before or after one whole event.

Example:
    >>> [(t.id, t.status) for t in bus.tasks()]            # doctest: +SKIP
    [('T-100', 'active'), ('t-3f2a', 'completed')]
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import orjson

from ralph_mail.errors import InvalidMessage, MailError
from ralph_mail.message import (
    Message,
    MessageType,
    check_priority,
    encode_parts,
    format_ts,
    from_envelope,
    new_id,
)

if TYPE_CHECKING:
    from ralph_mail.mailbox import Mailbox
    from ralph_mail.store.base import TeamStore

#: The state key of the snapshot `load` keeps, and how many new events make it save one.
SNAPSHOT_KEY: Final = "tasks.fold"
SNAPSHOT_EVERY: Final = 1000
#: The team log the task events go to.
LOG: Final = "tasks"
STATUSES = ("pending", "active", "completed", "failed")
FINISHED = frozenset({"completed", "failed"})


@dataclass(frozen=True, slots=True)
class Task:
    """One delegated task, as the task log has it now.

    Attributes:
        id: the task id (``metadata.taskId`` of its assignment).
        description: what is to be done.
        delegated_by: who gave it out.
        assignee: who does it.
        parent: the task it is part of, or None.
        priority: ``low``, ``normal``, ``high`` or ``urgent``.
        status: ``pending``, ``active``, ``completed`` or ``failed``.
        result: the result or the error, once finished ("" before).
        created: when it was given out (UTC ISO-8601).
        updated: when its status last changed.
        assignment: the id of its ``task_assignment`` message.
        notified: whether the delegator was sent its ``task_result``.
        held_until: for a task given to a sleeping agent, when its sleep ends: the
            assignment is held until then ("" when it was sent at once).
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
            "result": self.result,
            "created": self.created,
            "updated": self.updated,
            "held_until": self.held_until,
        }


def created(task: Task) -> bytes:
    """The log line that records a new task."""
    return orjson.dumps({"e": "created", **task.to_dict(), "assignment": task.assignment},
                        option=orjson.OPT_APPEND_NEWLINE)  # fmt: skip


def changed(task_id: str, status: str, ts: str, result: str = "", since: int = -1) -> bytes:
    """The log line that records a status change (``since``: where the delegator's inbox
    ended when an outcome was recorded, to look for its result there after a crash)."""
    event: dict[str, Any] = {"e": "status", "id": task_id, "status": status, "ts": ts}
    if status in FINISHED:
        event["result"] = result
        event["since"] = since
    return orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE)


def notified(task_id: str) -> bytes:
    """The log line that records that the delegator was sent the result."""
    return orjson.dumps({"e": "notified", "id": task_id}, option=orjson.OPT_APPEND_NEWLINE)


def fold(log: bytes) -> tuple[dict[str, Task], dict[str, int]]:
    """The tasks the log describes, in the order they were created, and for each finished
    one the ``since`` offset its outcome recorded. Lines that do not parse are skipped."""
    state: dict[str, list[Any]] = {}
    since: dict[str, int] = {}
    _apply(state, since, log)
    return _build(state), since


def load(store: TeamStore) -> tuple[dict[str, Task], dict[str, int]]:
    """`fold` of the team's task log, from a snapshot of an earlier fold when there is
    one: the cost follows the tasks and the events since, not every event ever written.

    The snapshot (state ``tasks.fold``) is derived: it records how far into the log it
    folded and the bytes just before that point, and is ignored when the log no longer
    holds them (a team made again) or it does not parse; it is saved again once enough
    new events came.
    """
    log = store.log_read(LOG)
    state: dict[str, list[Any]] = {}
    since: dict[str, int] = {}
    start = 0
    raw = store.load_state(SNAPSHOT_KEY)
    if raw:
        try:
            snapshot = orjson.loads(raw)
            offset = int(snapshot["offset"])
            rows = snapshot["tasks"]
            if (
                0 < offset <= len(log)
                and log[max(0, offset - 64) : offset].hex() == snapshot["mark"]
                and all(isinstance(row, list) and len(row) == _FIELDS for row in rows)
            ):
                state = {str(row[0]): row for row in rows}
                since, start = {str(k): int(v) for k, v in snapshot["since"].items()}, offset
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            state, since, start = {}, {}, 0
    events = _apply(state, since, log[start:])
    if events >= SNAPSHOT_EVERY:
        snapshot = {"offset": len(log), "mark": log[max(0, len(log) - 64) :].hex(),
                    "tasks": list(state.values()), "since": since}  # fmt: skip
        with contextlib.suppress(MailError):  # a cache: a failure only costs the next fold
            store.save_state(SNAPSHOT_KEY, orjson.dumps(snapshot))
    return _build(state), since


# A task while folding: a list of its fields in `Task`'s order (cheaper than a dict to
# change, to save and to build a Task from), and the positions changed by events.
_FIELDS = 13
_STATUS, _RESULT, _UPDATED, _NOTIFIED = 6, 7, 9, 11


def _apply(state: dict[str, list[Any]], since: dict[str, int], log: bytes) -> int:
    """Fold the events of ``log`` into ``state`` and ``since``; return how many lines it
    read. Events change plain lists, and each `Task` is built once at the end:
    ``dataclasses.replace`` per event made a 100,000-event log take 0.8 s."""
    loads = orjson.loads
    lines = log.splitlines()
    for line in lines:
        try:
            event = loads(line)
            kind, task_id = event["e"], event["id"]
            if kind == "created":
                created = event["created"]
                state[task_id] = [
                    task_id, event["description"], event["delegated_by"], event["assignee"],
                    event.get("parent"), event.get("priority", "normal"), "pending", "",
                    created, created, event.get("assignment", ""), False,
                    str(event.get("held_until", "")),
                ]  # fmt: skip
                continue
            task = state.get(task_id)
            if task is None:
                continue
            if kind == "status":
                if task[_STATUS] in FINISHED:
                    continue  # the first outcome stands
                status, ts = event["status"], event["ts"]
                if not isinstance(status, str) or not isinstance(ts, str):
                    continue
                task[_STATUS], task[_UPDATED] = status, ts
                if "result" in event:
                    task[_RESULT] = str(event["result"])
                if "since" in event:
                    since[task_id] = int(event["since"])
            elif kind == "notified":
                task[_NOTIFIED] = True
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return len(lines)


def _build(state: dict[str, list[Any]]) -> dict[str, Task]:
    return {task_id: Task(*fields) for task_id, fields in state.items()}


def ordered(tasks: dict[str, Task]) -> list[Task]:
    """Parents first, each followed by its subtasks (depth first, in creation order)."""
    return [task for _, task in tree_lines(tasks)]


def tree_lines(tasks: dict[str, Task]) -> list[tuple[str, Task]]:
    """``(prefix, task)`` pairs drawing the tree: ``├── `` and ``└── `` before subtasks.

    Walked with a stack, not recursion: a chain of subtasks any depth deep is drawn.
    """
    children: dict[str | None, list[Task]] = {}
    for task in tasks.values():
        parent = task.parent if task.parent in tasks and task.parent != task.id else None
        children.setdefault(parent, []).append(task)
    out: list[tuple[str, Task]] = []
    seen: set[str] = set()
    # Roots first; then any task left unseen (parents that name each other) as a root.
    roots = children.get(None, [])
    for root in roots:
        _walk(root, children, seen, out)
    if len(seen) < len(tasks):
        for root in tasks.values():
            _walk(root, children, seen, out)
    return out


def _walk(
    root: Task,
    children: dict[str | None, list[Task]],
    seen: set[str],
    out: list[tuple[str, Task]],
) -> None:
    """Append ``root`` and its subtasks, depth first, to ``out`` (once each)."""
    # (task, prefix drawn before it, indent its own subtasks get)
    stack = [(root, "", "")]
    while stack:
        task, prefix, indent = stack.pop()
        if task.id in seen:
            continue
        seen.add(task.id)
        out.append((prefix, task))
        kids = children.get(task.id)
        if not kids:
            continue
        last = len(kids) - 1
        for index in range(last, -1, -1):
            stack.append((kids[index], indent + ("└── " if index == last else "├── "),
                          indent + ("    " if index == last else "│   ")))  # fmt: skip


def draw(tasks: dict[str, Task], escape: Callable[[str], str] = str) -> str:
    """The tree as text, a task a line: id and description, assignee, status (and the
    time it finished). ``escape`` makes the stored text safe for the terminal."""
    rows = [(escape(f"{prefix}{task.id}  {task.description}"), escape(task.assignee), task)
            for prefix, task in tree_lines(tasks)]  # fmt: skip
    heads = max((len(head) for head, _, _ in rows), default=0)
    names = max((len(name) for _, name, _ in rows), default=0)
    lines = []
    for head, name, task in rows:
        finished = f"  {task.updated[11:16]}" if task.status in FINISHED else ""
        if task.status == "pending" and task.held_until:
            finished = f"  held until {task.held_until[11:16]} UTC"
        status = escape(f"{task.status}{finished}")
        lines.append(f"{head:<{heads}}  {name:<{names}}  {status}\n")
    return "".join(lines)


# -- delegating and finishing, over one agent's mailbox ------------------------------------

#: The team log of the assignments held for a sleeping agent: ``held.AGENT``.
HELD: Final = "held."


def delegate(
    box: Mailbox,
    to: str,
    description: str,
    *,
    context: str | None,
    priority: str | None,
    parent: str | None,
    id: str | None,
    visibility: str | None,
) -> Task:
    """`MessageBus.delegate`: record a task and send its assignment."""
    from ralph_mail.govern import presence

    assignee = box.recipient(to)
    if assignee == box.agent:
        raise InvalidMessage(f"{to!r} is delegating to itself: name a teammate")
    until = presence.require_online(box, assignee)
    return give(box, assignee, description, context, priority, parent, id, hold=until,
                visibility=visibility)[0]  # fmt: skip


def give(
    box: Mailbox,
    assignee: str,
    description: str,
    context: str | None,
    priority: str | None,
    parent: str | None,
    id: str | None,
    *,
    strict: bool = True,
    hold: str = "",
    visibility: str | None = None,
) -> tuple[Task, Message]:
    """Record (unless known) and send a task; ``strict=False`` (the lead's assign)
    lets an existing id be given out again with other words, as a new assignment.
    With ``hold`` (a ts), the assignment is held for the assignee until then."""
    from ralph_mail import protocols

    task_id = protocols.check_task_id(id) if id is not None else f"t-{new_id()[:8]}"
    if priority is not None:
        check_priority(priority)
    if parent is not None:
        protocols.check_task_id(parent)
    known, _ = load(box.store)
    task = known.get(task_id)
    if task is not None and (task.assignee, task.description) != (assignee, description):
        if strict:
            raise InvalidMessage(
                f"task {task_id} already exists (given to {task.assignee}): pick another id"
            )
        task = None  # the lead gives the same task id out again: a new assignment
    metadata = {protocols.TASK_ID: task_id}
    the_parent = task.parent if task is not None else parent
    if the_parent:
        metadata["parent"] = the_parent
    if context is not None:
        metadata["context"] = context
    assignment = task.assignment if task is not None else new_id()
    envelope = box.envelope(assignee, MessageType.TASK_ASSIGNMENT, description, metadata,
                            None, assignment, priority=priority,
                            visibility=visibility)  # fmt: skip
    encode_parts(envelope, box.max_message_bytes)  # refuses what could never be sent
    reason = box.gate.check(envelope)  # before the task is recorded: a refusal leaves none
    if task is None:
        now = format_ts(time.time_ns() // 1000)
        task = Task(task_id, description, box.agent, assignee, parent, priority or "normal",
                    "pending", "", now, now, assignment, held_until=hold)  # fmt: skip
        box.store.log_append(LOG, created(task))
    if reason:  # held for approval: once approved, it is delivered at once
        return task, box.gate.hold(envelope, reason)
    if not hold:
        return task, box._deliver(envelope)
    record = {"held": envelope, "until": hold, "since": box.store.size(assignee)}
    box.store.log_append(f"{HELD}{assignee}", orjson.dumps(record) + b"\n")
    return task, from_envelope(envelope)


def release_held(box: Mailbox) -> None:
    """Deliver to my inbox the assignments held while I slept whose hold is over (or
    all, once I am not sleeping). Only the process consuming my inbox runs this, so
    no two release one; run again after a crash, it delivers what is not there yet."""
    from ralph_mail.govern import presence

    log = box.store.log_read(f"{HELD}{box.agent}")
    if not log:
        return
    held: dict[str, dict[str, Any]] = {}
    for line in log.splitlines():
        try:
            record = orjson.loads(line)
            if "released" in record:
                held.pop(str(record["released"]), None)
            else:
                held[str(record["held"]["id"])] = record
        except (orjson.JSONDecodeError, KeyError, TypeError):
            continue  # a damaged record: the others are still released
    if not held:
        return
    state, _, _ = presence.presence_of(box.team, box.agent)
    now = format_ts(time.time_ns() // 1000)
    for message_id, record in held.items():
        if state == "sleeping" and str(record.get("until", "")) > now:
            continue
        # Where gc collected the inbox since, err on delivering twice (a receiver
        # that remembers ids handles it once), never on losing the task.
        if not box.delivered(box.agent, message_id, int(record.get("since", 0))):
            box._deliver(dict(record["held"]))
        released = orjson.dumps({"released": message_id}) + b"\n"
        box.store.log_append(f"{HELD}{box.agent}", released)


def finish(box: Mailbox, task_id: str, status: str, result: str) -> Task:
    """`MessageBus.start` / `complete` / `fail`: record my task's new status and, once
    finished, send its delegator the ``task_result``, once."""
    from ralph_mail import protocols

    if not isinstance(result, str):
        raise InvalidMessage(f"result must be a string, not {result.__class__.__name__}")
    known, since = load(box.store)
    task = known.get(protocols.check_task_id(task_id))
    if task is None:
        raise MailError(f"no task {task_id!r} in team {box.team.name!r}: see 'ralph-mail tasks'")
    if task.assignee != box.agent:
        raise InvalidMessage(
            f"task {task_id} is {task.assignee}'s, not {box.agent}'s: only the assignee "
            "starts, completes or fails it"
        )
    now = format_ts(time.time_ns() // 1000)
    if status == "active":
        if task.status == "pending":
            box.store.log_append(LOG, changed(task_id, "active", now))
        return load(box.store)[0][task_id]
    if task.status in FINISHED and task.status != status:
        raise InvalidMessage(f"task {task_id} is already {task.status}: it cannot be {status}")
    if task.status not in FINISHED:
        # The outcome first, with where the delegator's inbox ends now: a run killed
        # after this and before the result is sent finds it there and sends it once.
        since[task_id] = box.store.size(task.delegated_by)
        box.store.log_append(LOG, changed(task_id, status, now, result, since[task_id]))
        task = load(box.store)[0][task_id]
    if not task.notified:
        result_id = protocols.derived_id(task.assignment, "result")
        # Looked for in the delegator's audit trail: what gc collected since counts,
        # so a result consumed and collected is not sent again (each outcome once).
        if not box.delivered(task.delegated_by, result_id, since.get(task_id, 0),
                             collected=True, audit=True):  # fmt: skip
            box._send(task.delegated_by, MessageType.TASK_RESULT, task.result,
                      {protocols.TASK_ID: task_id, "status": task.status},
                      task.assignment, result_id, task.assignment)  # fmt: skip
        box.store.log_append(LOG, notified(task_id))
        task = load(box.store)[0][task_id]
    return task


def wait_for_result(box: Mailbox, task: Task, timeout: float, since: int) -> Message | None:
    """`MessageBus.wait_for_result`: block until ``task``'s result is in my inbox."""
    return box.await_answer(task.assignment, since, timeout, MessageType.TASK_RESULT,
                            sender=task.assignee)  # fmt: skip
