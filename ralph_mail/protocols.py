"""The team protocols' vocabulary: agent states, metadata keys, and protocol messages parsed.

The lead (`TeamOrchestrator`), the teammate (`TeamAgent`) and the command line share
these checks, so all three accept and refuse the same messages. A sender's mistake is an
`InvalidMessage` (nothing is sent); a received message that breaks the protocol is a
`ProtocolError`, which the lead answers instead of acting on.

Example:
    >>> status_metadata("working", task="T-1", progress="0.5")
    {'state': 'working', 'task': 'T-1', 'progress': '0.5'}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from ralph_mail.errors import InvalidMessage, ProtocolError
from ralph_mail.message import Message

#: The states a status update may report (DESIGN §3), in the order a task goes through them.
STATES: Final = ("idle", "working", "blocked", "done", "failed")
#: States after which an agent has nothing left to do on its task.
FINISHED_STATES: Final = frozenset({"done", "failed"})
#: States in which an agent that deferred a shutdown is worth asking again at once.
AVAILABLE_STATES: Final = frozenset({"idle", "done", "failed"})

# Metadata keys of the protocol messages (DESIGN §3). `deferred` is this package's
# addition to shutdown_response: "accepted=false, deferred=true" means "not yet, ask me
# again", where a bare "accepted=false" is a final refusal. Readers ignore unknown keys,
# so older readers see a deferral as a refusal, which is the safe reading.
STATE: Final = "state"
TASK: Final = "task"
PROGRESS: Final = "progress"
TASK_ID: Final = "taskId"
APPROVED: Final = "approved"
ACCEPTED: Final = "accepted"
DEFERRED: Final = "deferred"
ERROR: Final = "error"
#: The notices about a task its delegator (or the lead) sends: its assignee that it was
#: canceled (or moved to another agent); itself that its lease lapsed.
TASK_NOTICES: Final = frozenset({"task_canceled", "task_stalled"})


def check_state(value: str) -> str:
    """Return ``value`` if it is a status state, else raise `InvalidMessage` naming them.

    >>> check_state("working")
    'working'
    """
    if value not in STATES:
        raise InvalidMessage(f"invalid state {value!r}: use one of {', '.join(STATES)}")
    return value


def check_progress(value: str | float) -> str:
    """Return ``value`` as the wire's progress string if it is a number from 0 to 1.

    >>> check_progress(0.25), check_progress("1")
    ('0.25', '1')
    """
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0.0 <= number <= 1.0:  # also refuses nan
        raise InvalidMessage(f"invalid progress {value!r}: give a fraction from 0 to 1, e.g. 0.5")
    return value.strip() if isinstance(value, str) else f"{number:g}"


def check_task_id(value: str) -> str:
    """Return ``value`` if it can name a task: not empty, one line."""
    if not value.strip() or "\n" in value:
        raise InvalidMessage(f"invalid task id {value!r}: give a non-empty one-line id, e.g. T-1")
    return value


def status_metadata(
    state: str, task: str | None = None, progress: str | float | None = None
) -> dict[str, str]:
    """The metadata of a status update, checked: `InvalidMessage` for a bad value."""
    metadata = {STATE: check_state(state)}
    if task is not None:
        metadata[TASK] = check_task_id(task)
    if progress is not None:
        metadata[PROGRESS] = check_progress(progress)
    return metadata


def check_outgoing(kind: str, metadata: dict[str, str]) -> None:
    """Refuse protocol metadata the lead would refuse on arrival, before it is sent:
    a status update's state, task and progress; the true/false of an approval or a
    shutdown answer; the task a task notice (``task_canceled``, ``task_stalled``) is
    about. `InvalidMessage` names the value and the fix."""
    if kind == "status_update":
        status_metadata(metadata.get(STATE, ""), metadata.get(TASK), metadata.get(PROGRESS))
    if kind in TASK_NOTICES:
        if not metadata.get(TASK_ID, "").strip():
            raise InvalidMessage(
                f"a {kind} needs metadata {TASK_ID}, the task it is about: add --meta "
                f"{TASK_ID}=ID (or use 'ralph-mail task cancel ID')"
            )
        check_task_id(metadata[TASK_ID])
    flags = {"plan_approval": APPROVED, "shutdown_response": ACCEPTED}
    key = flags.get(kind)
    if key is not None and metadata.get(key, "").strip().lower() not in ("true", "false"):
        raise InvalidMessage(
            f"a {kind} needs metadata {key}=true or {key}=false, not "
            f"{metadata.get(key)!r}: add --meta {key}=true"
        )


def shutdown_answer(
    accepted: bool, deferred: bool = False, reason: str | None = None
) -> tuple[str, dict[str, str]]:
    """The content and metadata of a shutdown_response: accepted, deferred ("not yet,
    ask me again") or refused, with the reason given or the default words of each.
    Every face answers a shutdown request with this.

    >>> shutdown_answer(False, deferred=True)
    ('finishing current task', {'accepted': 'false', 'deferred': 'true'})
    """
    metadata = {ACCEPTED: "true" if accepted else "false"}
    if deferred and not accepted:
        metadata[DEFERRED] = "true"
    default = "shutting down" if accepted else "finishing current task" if deferred else "no"
    return (default if reason is None else reason), metadata


def _flag(message: Message, key: str, fix: str) -> bool:
    value = message.metadata.get(key)
    if value is None:
        raise ProtocolError(
            f"{message.type} {message.id} from {message.from_agent} has no metadata.{key}: {fix}"
        )
    lowered = value.strip().lower()
    if lowered not in ("true", "false"):
        raise ProtocolError(
            f"{message.type} {message.id} from {message.from_agent} has "
            f"metadata.{key}={value!r}: use 'true' or 'false'; {fix}"
        )
    return lowered == "true"


@dataclass(frozen=True, slots=True)
class Status:
    """A status update, parsed.

    Attributes:
        state: one of `STATES`.
        task: the task it is about, or "".
        progress: a fraction from 0 to 1, or None when not given.
    """

    state: str
    task: str
    progress: float | None


def parse_status(message: Message) -> Status:
    """The `Status` a status_update carries; `ProtocolError` when it is malformed."""
    fix = "send 'ralph-mail status TEXT --state STATE' with a state of " + ", ".join(STATES)
    state = message.metadata.get(STATE)
    if state is None:
        raise ProtocolError(
            f"status_update {message.id} from {message.from_agent} has no metadata.state: {fix}"
        )
    if state not in STATES:
        raise ProtocolError(
            f"status_update {message.id} from {message.from_agent} has unknown state "
            f"{state!r}: {fix}"
        )
    progress = None
    raw = message.metadata.get(PROGRESS)
    if raw is not None:
        try:
            progress = float(check_progress(raw))
        except InvalidMessage:
            raise ProtocolError(
                f"status_update {message.id} from {message.from_agent} has progress {raw!r}: "
                "give a fraction from 0 to 1 (--progress 0.5)"
            ) from None
    return Status(state, message.metadata.get(TASK, ""), progress)


@dataclass(frozen=True, slots=True)
class ShutdownAnswer:
    """A shutdown response, parsed.

    Attributes:
        accepted: the agent will stop.
        deferred: not accepted *yet* ("finishing current task"): ask again later.
        reason: the agent's words.
        request_id: the request it answers.
    """

    accepted: bool
    deferred: bool
    reason: str
    request_id: str


def parse_shutdown_response(message: Message) -> ShutdownAnswer:
    """The `ShutdownAnswer` a shutdown_response carries; `ProtocolError` when malformed."""
    fix = "answer with 'ralph-mail shutdown respond --accept|--reject|--defer'"
    accepted = _flag(message, ACCEPTED, fix)
    if message.reply_to is None:
        raise ProtocolError(
            f"shutdown_response {message.id} from {message.from_agent} has no reply_to: "
            f"it must name the request it answers; {fix}"
        )
    deferred = not accepted and message.metadata.get(DEFERRED, "").strip().lower() == "true"
    return ShutdownAnswer(accepted, deferred, message.content, message.reply_to)


def parse_plan_approval(message: Message) -> tuple[bool, str]:
    """``(approved, feedback)`` of a plan_approval; `ProtocolError` when malformed."""
    approved = _flag(message, APPROVED, "the lead must send metadata approved=true|false")
    return approved, message.content


def derived_id(*parts: str) -> str:
    """A message id that depends only on ``parts``: the same reply gets the same id.

    A lead that dies after sending a reply but before recording it sends the reply again
    on restart; with a derived id the copy is recognisable (and recognised: see
    `TeamOrchestrator`), where a random id would make it a second answer.

    >>> derived_id("lead", "w1:0123456789ab", "0") == derived_id("lead", "w1:0123456789ab", "0")
    True
    """
    import hashlib  # only the lead derives ids: a shell status need not load it

    return hashlib.blake2b("\0".join(parts).encode(), digest_size=6).hexdigest()
