"""Delegated tasks: giving them out, working them, ending them, and the tree they form.

The team's task log and its states live in `ralph_mail.govern.tasklog` (the Gate checks
answers against it); this room does what agents do to it, over one agent's mailbox:

- the delegator gives a task (``delegate``; a ``deadline`` capped at its parent's),
  cancels it with every open subtask below (``cancel``: each assignee gets a
  ``task_canceled``), or gives it to another agent (``reassign``: the old assignee gets
  a ``task_canceled``, and its result is not taken);
- the assignee starts it (``working``, with a lease its process renews: ``heartbeat``),
  asks its delegator in the task's thread (``input_required`` until the reply comes),
  and ends it: ``completed``, ``failed`` or ``rejected``, its delegator sent the
  ``task_result`` once; a result after the task ended is kept as ``late``;
- the delegator's own reads tell it, once, of a task whose lease lapsed: a
  ``task_stalled`` in its inbox (`look`).

Example:
    >>> [(t.id, t.status) for t in bus.tasks()]            # doctest: +SKIP
    [('T-100', 'working'), ('t-3f2a', 'completed')]
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

from ralph_mail import codec
from ralph_mail.errors import InvalidMessage, MailError, PermissionDenied, TaskEnded
from ralph_mail.govern.tasklog import (
    DEADLINE_PASSED,
    FINISHED,
    LEGACY,
    LOG,
    OPEN,
    REPORTED,
    SNAPSHOT_EVERY,
    SNAPSHOT_KEY,
    STATES,
    Task,
    changed,
    created,
    fold,
    lease_seconds,
    leased,
    load,
    notified,
    reassigned,
    stalled,
)
from ralph_mail.message import (
    Message,
    MessageType,
    check_priority,
    encode_parts,
    format_ts,
    from_envelope,
    new_id,
    parse_ts,
)

if TYPE_CHECKING:
    from datetime import datetime

    from ralph_mail.mailbox import Mailbox

__all__ = [
    "DEADLINE_PASSED", "FINISHED", "HELD", "LEGACY", "LOG", "OPEN", "REPORTED",
    "SNAPSHOT_EVERY", "SNAPSHOT_KEY", "STATES", "Task", "cancel", "changed", "created",
    "delegate", "draw", "finish", "fold", "give", "heartbeat", "load", "look", "notified",
    "ordered", "reassign", "start", "tree_lines", "wait_for_result",
]  # fmt: skip

#: The team log of the assignments held for a sleeping agent: ``held.AGENT``.
HELD: Final = "held."
#: How often `wait_for_result` looks at the task log again while it waits (s): a
#: reassignment, a cancel or a deadline changes what it waits for.
_RELOOK_S: Final = 1.0
_DURATION = re.compile(r"\+?\d+[smhd]")


def _now() -> str:
    return format_ts(time.time_ns() // 1000)


# -- the tree --------------------------------------------------------------------------------


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
    for root in children.get(None, []):
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


def state_of(task: Task) -> str:
    """The word a listing shows for ``task``'s state: its status, or ``stalled``."""
    return "stalled" if task.stalled else task.status


def notes(task: Task) -> str:
    """What a listing says beside ``task``'s state: when it ended and who ended it, the
    hold, the lease, the deadline, a late result, a reassignment."""
    said = []
    if task.status in FINISHED:
        said.append(_clock(task.updated))
        if task.ended_by and task.ended_by != task.assignee:
            said.append(f"by {task.ended_by}")
        if task.status == "failed" and task.result == DEADLINE_PASSED:
            said.append(DEADLINE_PASSED)
    elif task.held_until and task.status == "submitted":
        said.append(f"held until {task.held_until[11:16]} UTC")
    if task.stalled:
        said.append(f"lease lapsed {_clock(task.lease_until)}")
    elif task.open and task.lease_until:
        said.append(f"lease to {_clock(task.lease_until)}")
    if task.open and task.deadline:
        said.append(f"deadline {_clock(task.deadline)}")
    if task.reassigned_from and task.open:
        said.append(f"from {task.reassigned_from}")
    if task.late:
        said.append("late result kept")
    return "  ".join(said)


def _clock(ts: str) -> str:
    """``ts`` shortly: the time of day today (UTC), the date and time otherwise."""
    return ts[11:19] if ts[:10] == _now()[:10] else f"{ts[:10]} {ts[11:16]}"


def draw(tasks: dict[str, Task], escape: Callable[[str], str] = str, header: bool = False,
         cost: Callable[[Task], str] | None = None) -> str:  # fmt: skip
    """The tree as text, a task a line: id and description, assignee, state, ``cost(task)``
    when given (what its subtree cost), and notes (`notes`). ``escape`` makes the stored
    text safe for the terminal; ``header`` puts the columns' names first (a terminal's
    listing)."""
    rows = [(escape(f"{prefix}{task.id}  {task.description}"), escape(task.assignee),
             state_of(task), cost(task) if cost is not None else "", escape(notes(task)))
            for prefix, task in tree_lines(tasks)]  # fmt: skip
    if header and rows:
        rows.insert(0, ("TASK", "ASSIGNEE", "STATE", "COST", "NOTES"))
    widths = [max((len(row[n]) for row in rows), default=0) for n in range(4)]
    lines = []
    for *cells, said in rows:
        shown = [f"{cell:<{width}}" for cell, width in zip(cells, widths, strict=True)]
        if cost is None:
            del shown[3]
        lines.append("  ".join([*shown, said]).rstrip() + "\n")
    return "".join(lines)


# -- giving tasks out ------------------------------------------------------------------------


def parse_deadline(value: str | datetime | float | None) -> str:
    """A deadline as a wire timestamp: a duration from now (``10m``, ``+90s``, a number of
    seconds), an ISO-8601 time or a datetime; "" for None. One that has passed is refused.

    >>> parse_deadline(None)
    ''
    """
    from datetime import datetime  # here: a read, which loads this module, needs none

    from ralph_mail.govern.presence import parse_until

    if value is None or value == "":
        return ""
    when: str | datetime
    if isinstance(value, bool) or not isinstance(value, (int, float, str, datetime)):
        raise InvalidMessage(f"invalid deadline {value!r}: give 10m, seconds or a time")
    if isinstance(value, (int, float)):
        if not 0 < value < 10**9:
            raise InvalidMessage(f"invalid deadline {value!r}: give seconds from now, > 0")
        when = datetime.fromtimestamp(time.time() + value).astimezone()
    elif isinstance(value, str) and _DURATION.fullmatch(value.strip()):
        when = "+" + value.strip().lstrip("+")
    else:
        when = value
    stamp = parse_until(when)
    if stamp <= _now():
        raise InvalidMessage(
            f"invalid deadline {value!s}: it has passed; give a later time, or a duration "
            "such as 10m"
        )
    return stamp


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
    deadline: str | datetime | float | None = None,
) -> Task:
    """`MessageBus.delegate`: record a task and send its assignment."""
    from ralph_mail.govern import presence

    assignee = box.recipient(to)
    if assignee == box.agent:
        raise InvalidMessage(f"{to!r} is delegating to itself: name a teammate")
    until = presence.require_online(box, assignee)
    return give(box, assignee, description, context, priority, parent, id, hold=until,
                visibility=visibility, deadline=parse_deadline(deadline))[0]  # fmt: skip


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
    deadline: str = "",
) -> tuple[Task, Message]:
    """Record (unless known) and send a task; ``strict=False`` (the lead's assign)
    lets an existing id be given out again with other words, as a new assignment.
    With ``hold`` (a ts), the assignment is held for the assignee until then. A subtask's
    ``deadline`` is capped at its parent's; a subtask of a task canceled or past its
    deadline is refused."""
    from ralph_mail import protocols

    task_id = protocols.check_task_id(id) if id is not None else f"t-{new_id()[:8]}"
    if priority is not None:
        check_priority(priority)
    known, _ = load(box.store)
    if parent is not None:
        above = known.get(protocols.check_task_id(parent))
        if above is not None and (above.status == "canceled" or "" < above.deadline <= _now()):
            raise TaskEnded(f"{_ended(above)}: a subtask of it cannot be given out")
        if above is not None and above.deadline:
            deadline = min(deadline or above.deadline, above.deadline)
    task = known.get(task_id)
    if task is not None and (task.assignee, task.description) != (assignee, description):
        if strict:
            raise InvalidMessage(
                f"task {task_id} already exists (given to {task.assignee}): pick another id"
            )
        task = None  # the lead gives the same task id out again: a new assignment
    if task is not None:
        deadline = task.deadline
    metadata = {protocols.TASK_ID: task_id}
    the_parent = task.parent if task is not None else parent
    if the_parent:
        metadata["parent"] = the_parent
    if context is not None:
        metadata["context"] = context
    if deadline:
        metadata["deadline"] = deadline
    fresh = task is None
    assignment = task.assignment if task is not None else new_id()
    envelope = box.envelope(assignee, MessageType.TASK_ASSIGNMENT, description, metadata,
                            None, assignment, priority=priority,
                            visibility=visibility)  # fmt: skip
    encode_parts(envelope, box.max_message_bytes)  # refuses what could never be sent
    reason = box.gate.check(envelope)  # before the task is recorded: a refusal leaves none
    if task is None:
        now = _now()
        task = Task(task_id, description, box.agent, assignee, parent, priority or "normal",
                    "submitted", "", now, now, assignment, held_until=hold,
                    deadline=deadline)  # fmt: skip
        box.store.log_append(LOG, created(task))
    return task, _send_assignment(box, envelope, reason, hold, fresh)


def _send_assignment(
    box: Mailbox, envelope: dict[str, object], reason: str, hold: str, fresh: bool = False
) -> Message:
    """Deliver an assignment the Gate passed: held for approval (delivered once
    approved), held for a sleeping assignee until ``hold``, or at once (``fresh``: its id
    was made for it, see `Mailbox._deliver`)."""
    if reason:
        return box.gate.hold(envelope, reason)
    if not hold:  # a new assignment's id is fresh: its thread starts here
        return box._deliver(envelope, fresh=fresh)
    assignee = str(envelope["to"])
    box.seal(envelope)  # signed now: the assignee's process delivers it as it is
    record = {"held": envelope, "until": hold, "since": box.store.size(assignee)}
    box.store.log_append(f"{HELD}{assignee}", codec.dumps(record) + b"\n")
    return from_envelope(envelope)


def release_held(box: Mailbox) -> None:
    """Deliver to my inbox the assignments held while I slept whose hold is over (or
    all, once I am not sleeping). Only the process consuming my inbox runs this, so
    no two release one; run again after a crash, it delivers what is not there yet."""
    log = box.store.log_read(f"{HELD}{box.agent}")
    if not log:
        return
    held: dict[str, dict[str, Any]] = {}
    for line in log.splitlines():
        try:
            record = codec.loads(line)
            if "released" in record:
                held.pop(str(record["released"]), None)
            else:
                held[str(record["held"]["id"])] = record
        except (codec.DecodeError, KeyError, TypeError):
            continue  # a damaged record: the others are still released
    if not held:
        return
    from ralph_mail.govern import presence  # not before: a read with nothing held skips it

    state, _, _ = presence.presence_of(box.team, box.agent)
    now = _now()
    for message_id, record in held.items():
        if state == "sleeping" and str(record.get("until", "")) > now:
            continue
        # Where gc collected the inbox since, err on delivering twice (a receiver
        # that remembers ids handles it once), never on losing the task.
        if not box.delivered(box.agent, message_id, int(record.get("since", 0))):
            box._deliver(dict(record["held"]))
        released = codec.dumps({"released": message_id}) + b"\n"
        box.store.log_append(f"{HELD}{box.agent}", released)


# -- the assignee's side -----------------------------------------------------------------------


def _ended(task: Task) -> str:
    """How ``task`` ended, in words: ``task T was canceled by lead (why)``."""
    if task.status == "failed" and task.result == DEADLINE_PASSED and not task.ended_by:
        return f"task {task.id} failed: its deadline {task.deadline} passed"
    if task.ended_by and task.ended_by != task.assignee:
        why = f" ({task.result})" if task.result else ""
        return f"task {task.id} was {task.status} by {task.ended_by}{why}"
    if task.status == "canceled":  # with its parent, at a deadline
        return f"task {task.id} was canceled: {task.result}"
    return f"task {task.id} is already {task.status}"


def _mine(box: Mailbox, task_id: str) -> tuple[Task, dict[str, int]]:
    """My task ``task_id`` (I am its assignee) as the log has it now, and the since
    offsets; `MailError` when there is none, `TaskEnded` when it was moved from me."""
    from ralph_mail import protocols

    known, since = load(box.store)
    task = known.get(protocols.check_task_id(task_id))
    if task is None:
        raise MailError(f"no task {task_id!r} in team {box.team.name!r}: see 'ralph-mail tasks'")
    if task.assignee != box.agent:
        if task.reassigned_from == box.agent:
            raise TaskEnded(
                f"task {task_id} was reassigned to {task.assignee}: it is not "
                f"{box.agent}'s any more, and its result is not taken"
            )
        raise InvalidMessage(
            f"task {task_id} is {task.assignee}'s, not {box.agent}'s: only the assignee "
            "starts, completes or fails it"
        )
    return task, since


def start(box: Mailbox, task_id: str) -> Task:
    """`MessageBus.start`: my task is ``working``, with a lease from now (a task that is
    already working has its lease renewed). `TaskEnded` when it ended."""
    return heartbeat(box, task_id, start=True)


def heartbeat(box: Mailbox, task_id: str, *, start: bool = False) -> Task:
    """`MessageBus.heartbeat`: renew my task's lease (the team's ``task_lease`` from now),
    starting it if it was only submitted; ``start`` also takes it back from
    ``input_required``. `TaskEnded` when it ended: stop working on it."""
    task, _ = _mine(box, task_id)
    if not task.open:
        raise TaskEnded(f"{_ended(task)}: stop working on it")
    now = time.time()
    ts = format_ts(int(now * 1_000_000))
    until = format_ts(int((now + lease_seconds(dict(box.team.config))) * 1_000_000))
    if start and task.status != "working":
        box.store.log_append(LOG, changed(task.id, "working", ts, until=until))
    else:
        box.store.log_append(LOG, leased(task.id, until, ts))
    return load(box.store)[0][task.id]


def finish(box: Mailbox, task_id: str, status: str, result: str,
           metadata: dict[str, str] | None = None) -> Task:  # fmt: skip
    """`MessageBus.complete` / `fail` / `reject`: record my task's outcome and send its
    delegator the ``task_result``, once (with ``metadata``: what the work cost, from
    ``ralph-mail run``). An outcome that comes after the task ended (canceled, its
    deadline passed) is kept as late, and `TaskEnded` says how it ended."""
    from ralph_mail import protocols

    if not isinstance(result, str):
        raise InvalidMessage(f"result must be a string, not {result.__class__.__name__}")
    task, since = _mine(box, task_id)
    same = (task.status, task.result) == (status, result)
    if task.open or not same or (not task.notified and task.id not in since):
        # The outcome first, with where the delegator's inbox ends now: a run killed
        # after this and before the result is sent finds it there and sends it once.
        # After the end it is late (or, for the deadline's, where to look for it).
        at = box.store.size(task.delegated_by)
        box.store.log_append(LOG, changed(task.id, status, _now(), result, at, by=box.agent))
        known, since = load(box.store)
        task = known[task.id]
    if task.status in REPORTED and task.ended_by in ("", box.agent) and not task.notified:
        result_id = protocols.derived_id(task.assignment, "result")
        # Looked for in the delegator's audit trail: what gc collected since counts,
        # so a result consumed and collected is not sent again (each outcome once).
        if not box.delivered(task.delegated_by, result_id, since.get(task.id, 0),
                             collected=True, audit=True):  # fmt: skip
            box._send(task.delegated_by, MessageType.TASK_RESULT, task.result,
                      {**(metadata or {}), protocols.TASK_ID: task.id, "status": task.status},
                      task.assignment, result_id, task.assignment)  # fmt: skip
        box.store.log_append(LOG, notified(task.id))
        task = load(box.store)[0][task.id]
    if (task.status, task.result) != (status, result):
        late = " the result is kept as late, not delivered" if status != "rejected" else ""
        raise TaskEnded(f"{_ended(task)}: it cannot be {status};{late}".rstrip(";"))
    return task


def asked_about(box: Mailbox, to: str, task_id: str) -> Task | None:
    """My open task ``task_id`` when ``to`` gave it to me (an ask of ``to`` about it
    waits for input), else None."""
    from ralph_mail import protocols

    task = load(box.store)[0].get(protocols.check_task_id(task_id))
    if task is None or task.assignee != box.agent or task.delegated_by != to or not task.open:
        return None
    return task


def waiting_for_input(box: Mailbox, task: Task, waiting: bool) -> None:
    """My task is ``input_required`` while I wait for its delegator's answer (``waiting``),
    and ``working`` again after (unless it ended meanwhile)."""
    now = load(box.store)[0].get(task.id)
    before = ("submitted", "working") if waiting else ("input_required",)
    if now is not None and now.status in before:
        box.store.log_append(LOG, changed(task.id, "input_required" if waiting else "working",
                                          _now()))  # fmt: skip


# -- the delegator's side (or the lead's) ----------------------------------------------------


def _given(box: Mailbox, task_id: str, act: str) -> tuple[Task, dict[str, Task]]:
    """Task ``task_id``, when my agent may ``act`` on it: I gave it out, or I am the lead
    (`PermissionDenied` otherwise); and every task of the log."""
    from ralph_mail import protocols

    known, _ = load(box.store)
    task = known.get(protocols.check_task_id(task_id))
    if task is None:
        raise MailError(f"no task {task_id!r} in team {box.team.name!r}: see 'ralph-mail tasks'")
    lead = box.refresh_team().lead
    if box.agent not in (task.delegated_by, lead):
        raise PermissionDenied(
            f"task {task.id} was given out by {task.delegated_by}: only it or the lead "
            f"({lead}) {act} it"
        )
    return task, known


def cancel(box: Mailbox, task_id: str, reason: str) -> Task:
    """`MessageBus.cancel`: cancel the task and, with it, every open task below it; each
    of their assignees is sent a ``task_canceled``. Run again after a crash, it sends
    what was not sent; `TaskEnded` when the task ended first (a result came)."""
    if not isinstance(reason, str) or "\n" in reason:
        raise InvalidMessage(f"invalid reason {reason!r}: give one line of text")
    task, known = _given(box, task_id, "cancels")
    if task.open:
        box.store.log_append(LOG, changed(task.id, "canceled", _now(), reason, by=box.agent))
        known, _ = load(box.store)
        task = known[task.id]
    if task.status != "canceled" or task.ended_by != box.agent:
        raise TaskEnded(f"{_ended(task)}: nothing to cancel")
    for each in canceled_with(task, known.values()):
        why = reason if each.id == task.id else f"{task.id} was canceled" + (
            f" ({reason})" if reason else "")  # fmt: skip
        _tell_canceled(box, each, each.assignee, each.assignment, why)
    return task


def canceled_with(task: Task, tasks: Iterable[Task]) -> list[Task]:
    """The canceled ``task`` and the subtasks below it its cancel ended (canceled by the
    same agent), parents first: what one `cancel` stopped."""
    known = {each.id: each for each in tasks}
    return [t for t in ordered(known) if t.status == "canceled" and t.ended_by == task.ended_by
            and (t.id == task.id or _under(t, task.id, known))]  # fmt: skip


def _under(task: Task, root: str, known: dict[str, Task]) -> bool:
    """Whether ``task`` is a subtask of ``root``, however deep."""
    seen = set()
    parent = task.parent
    while parent is not None and parent not in seen:
        if parent == root:
            return True
        seen.add(parent)
        above = known.get(parent)
        parent = above.parent if above is not None else None
    return False


def _tell_canceled(box: Mailbox, task: Task, to: str, assignment: str, why: str) -> None:
    """Send ``to`` (a task's assignee, or its assignee before a reassignment) the
    ``task_canceled`` of ``assignment``, unless it is there already."""
    from ralph_mail import protocols

    notice = protocols.derived_id(assignment, "canceled")
    if to == box.agent or box.delivered(to, notice, 0, collected=True, audit=True):
        return
    words = f"task {task.id} was canceled by {box.agent}" + (f": {why}" if why else "")
    box._send(to, MessageType.TASK_CANCELED, words + "; stop working on it",
              {protocols.TASK_ID: task.id, "reason": why}, assignment, notice,
              assignment)  # fmt: skip


def reassign(box: Mailbox, task_id: str, to: str) -> Task:
    """`MessageBus.reassign`: give the task to ``to`` instead, under a new assignment (its
    words and context as before); the old assignee is sent a ``task_canceled``, and its
    result is not taken any more."""
    from ralph_mail import protocols
    from ralph_mail.govern import presence

    task, _ = _given(box, task_id, "reassigns")
    if not task.open:
        raise TaskEnded(f"{_ended(task)}: nothing to reassign")
    assignee = box.recipient(to)
    if assignee == task.assignee:
        raise InvalidMessage(f"task {task.id} is {assignee}'s already: name another agent")
    if assignee == box.agent:
        raise InvalidMessage(f"{to!r} is delegating to itself: name a teammate")
    hold = presence.require_online(box, assignee)
    old = box.find(task.assignment, (task.delegated_by, task.assignee))
    metadata = dict(old.metadata) if old is not None else {protocols.TASK_ID: task.id}
    metadata.update({protocols.TASK_ID: task.id, "reassigned_from": task.assignee})
    envelope = box.envelope(assignee, MessageType.TASK_ASSIGNMENT, task.description, metadata,
                            priority=task.priority,
                            visibility=old.visibility if old is not None else None)  # fmt: skip
    reason = box.gate.check(envelope)  # before the move is recorded: a refusal moves nothing
    box.store.log_append(LOG, reassigned(task.id, assignee, str(envelope["id"]), box.agent,
                                         _now()))  # fmt: skip
    moved = load(box.store)[0][task.id]
    if moved.assignment != envelope["id"]:
        raise TaskEnded(f"{_ended(moved)}: nothing to reassign")
    _send_assignment(box, envelope, reason, hold, fresh=True)
    _tell_canceled(box, task, task.assignee, task.assignment, f"reassigned to {assignee}")
    return moved


def look(box: Mailbox) -> float:
    """Tell my agent, once, of each task it gave out whose lease lapsed: a
    ``task_stalled`` in its own inbox. Run by the reads of a delegator and by
    `wait_for_result`; return when (time.time) the next lapse can come at the soonest:
    the earliest lease of my tasks being worked on, or a whole lease from now (a task
    started later holds its lease that long), so a read need not look before."""
    from ralph_mail import protocols

    known, _ = load(box.store)
    now = time.time()
    due = now + lease_seconds(dict(box.team.config))
    lapsed = []
    for task in known.values():
        if task.delegated_by != box.agent or not task.lease_until or not task.open:
            continue
        if task.told.startswith(f"{task.lease_until} "):
            continue  # told already: a renewal holds a lease from then
        if task.stalled:
            lapsed.append(task)
        else:
            due = min(due, parse_ts(task.lease_until))
    if not lapsed:
        return due
    mark = new_id()  # the first claim of a lapse tells it: two processes tell it once
    for task in lapsed:
        box.store.log_append(LOG, stalled(task.id, task.lease_until, mark))
    known, _ = load(box.store)
    for task in lapsed:
        told = known.get(task.id)
        if told is None or told.told != f"{task.lease_until} {mark}":
            continue
        box._send(box.agent, MessageType.TASK_STALLED,
                  f"task {task.id} stalled: {task.assignee} has not renewed its lease since "
                  f"{task.lease_until}; reassign it ('ralph-mail task reassign {task.id} "
                  "AGENT') or cancel it",
                  {protocols.TASK_ID: task.id, "assignee": task.assignee,
                   "lease_until": task.lease_until}, task.assignment,
                  protocols.derived_id(task.assignment, "stalled", task.lease_until),
                  task.assignment)  # fmt: skip
    return due


def before_read(box: Mailbox, due: float) -> float:
    """What a read of my inbox does first (at most once a second): release the
    assignments held while I slept, and, once ``due`` (time.time) has come, tell me of
    my delegations that stalled; return when to look again."""
    release_held(box)
    if time.time() < due:
        return due
    try:
        return look(box)
    except MailError as exc:  # a notice: never stop mail for it
        warnings.warn(f"cannot tell {box.agent} of a stalled task: {exc}", RuntimeWarning,
                      stacklevel=3)  # fmt: skip
        return time.time() + 1.0


def wait_for_result(box: Mailbox, task: Task, timeout: float, since: int) -> Message | None:
    """`MessageBus.wait_for_result`: block until the current assignee's result of
    ``task`` is in my inbox; None after ``timeout``, or at once when the task ended with
    no result to come (canceled, its assignment denied, its deadline passed)."""
    end = time.monotonic() + timeout
    while True:
        now = load(box.store)[0].get(task.id, task)
        if not now.open and not now.notified and now.ended_by != now.assignee:
            return None
        left = end - time.monotonic()
        found = box.await_answer(now.assignment, since, max(0.0, min(left, _RELOOK_S)),
                                 MessageType.TASK_RESULT, sender=now.assignee)  # fmt: skip
        if found is not None or left <= 0:
            return found
        look(box)
