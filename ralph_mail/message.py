"""The message envelope: `Message`, `MessageType`, names, and the wire encoding.

One message is one line of UTF-8 JSON ending in ``\\n``. The key order on the wire
is fixed (``id, from, to, type, content, metadata, ts[, reply_to]``) so a message
re-encoded by `encode` is byte for byte the line that was written. Keys added since
(``thread, priority, ack, visibility, chain``) stand between ``metadata`` and ``ts``
and are omitted at their defaults, so a first-release line is unchanged.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from ralph_mail import codec
from ralph_mail.errors import InvalidMessage, InvalidName

BROADCAST_ADDRESS = "*"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_RESERVED_SUFFIXES = (".lock", ".json", ".jsonl")
_ID = re.compile(r"[0-9a-f]{12}")


class MessageType(StrEnum):
    """What a message means; the value is its wire name, so ``MessageType.TEXT == "text"``."""

    TEXT = "text"
    STATUS_UPDATE = "status_update"
    SHUTDOWN_REQUEST = "shutdown_request"
    SHUTDOWN_RESPONSE = "shutdown_response"
    PLAN_SUBMISSION = "plan_submission"
    PLAN_APPROVAL = "plan_approval"
    TASK_ASSIGNMENT = "task_assignment"
    BROADCAST = "broadcast"
    REQUEST = "request"
    REPLY = "reply"
    TASK_RESULT = "task_result"
    ACK = "ack"
    MENTION = "mention"
    APPROVAL_REQUEST = "approval_request"
    APPROVAL_RESPONSE = "approval_response"
    TASK_CANCELED = "task_canceled"
    TASK_STALLED = "task_stalled"


_TYPES: dict[str, MessageType] = {member.value: member for member in MessageType}
#: Any type name beyond the enum: carried as a plain str, so a pair of agents can speak
#: its own kinds and a reader never sets aside a line for a type it does not know.
_TYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


class _Types(dict[str, "MessageType | str"]):
    """Wire name -> `MessageType`, and any other valid type name -> itself (a str)."""

    def __missing__(self, key: str) -> str:
        if key.__class__ is str and _TYPE_NAME.fullmatch(key):
            return key
        raise KeyError(key)


_KINDS = _Types(_TYPES)


@dataclass(frozen=True)
class Message:
    """One message as it is stored in an inbox.

    Not slotted on purpose: `decode` adopts the dict that JSON parsing made as the
    instance's ``__dict__`` in one step, which makes reading about 1.3x faster than
    setting eight slots (measured: 1.28 against 1.64 ms per 1,000 messages).

    Attributes:
        id: 12 lowercase hex characters; a broadcast has one id in every inbox.
        from_agent: the sender (``from`` on the wire).
        to_agent: the recipient, or ``"*"`` for a broadcast (``to`` on the wire).
        type: a `MessageType`, or the type's name as a plain ``str`` for a type beyond
            the enum (``"blocker"``); ``str(message.type)`` is the wire name either way.
        content: human-readable text.
        metadata: structured data, string to string; ``{}`` when empty.
        ts: UTC ISO-8601 with microseconds and ``Z``, taken under the inbox lock.
        reply_to: the id of the message this one answers, or None.
        priority: ``"low"``, ``"normal"`` (omitted on the wire), ``"high"`` or ``"urgent"``.
        ack: whether the sender asked for an acknowledgement (omitted when false).
        visibility: ``"internal"`` (omitted), ``"user_visible"`` or ``"user_redacted"``.
        chain: the agents a request passed through, oldest first (omitted when empty).
        thread: the id of the conversation's first message: this message's own id
            unless the wire says otherwise (not a constructor argument).
        verified: whether its signature (wire keys ``sig`` and ``kid``) checks out
            against its sender's public key in the roster: True, False, or None when
            it is unsigned or was not checked (set by the reader; never on the wire).

    Example:
        >>> m = decode(b'{"id":"0123456789ab","from":"w1","to":"lead","type":"text",'
        ...            b'"content":"hi","metadata":{},"ts":"2026-01-01T00:00:00.000000Z"}')
        >>> m.type == "text", m.from_agent
        (True, 'w1')
    """

    id: str
    from_agent: str
    to_agent: str
    type: MessageType | str
    content: str
    metadata: Mapping[str, str] = field(default_factory=dict)
    ts: str = ""
    reply_to: str | None = None
    # Keys added after the first release: omitted on the wire at their defaults, and
    # absent from a decoded message's __dict__ then, so the class attribute answers.
    priority: str = "normal"
    ack: bool = False
    visibility: str = "internal"
    chain: Sequence[str] = ()
    # Set by the reader that checked the signature (`ralph_mail.signing`), in __dict__.
    verified: ClassVar[bool | None] = None

    def __hash__(self) -> int:
        return hash((self.id, self.to_agent, self.ts))

    @property
    def thread(self) -> str:
        """The id of the conversation's first message: the wire's ``thread``, else my id."""
        thread: str | None = self.__dict__.get("thread")
        return thread or self.id

    def to_dict(self) -> dict[str, Any]:
        """The wire envelope as a dict, keys in wire order."""
        envelope: dict[str, Any] = {
            "id": self.id,
            "from": self.from_agent,
            "to": self.to_agent,
            "type": str(self.type),
            "content": self.content,
            "metadata": self.metadata,
        }
        thread = self.__dict__.get("thread")
        if thread is not None and thread != self.id:
            envelope["thread"] = thread
        if self.priority != "normal":
            envelope["priority"] = self.priority
        if self.ack:
            envelope["ack"] = True
        if self.visibility != "internal":
            envelope["visibility"] = self.visibility
        if self.chain:
            envelope["chain"] = list(self.chain)
        envelope["ts"] = self.ts
        if self.reply_to is not None:
            envelope["reply_to"] = self.reply_to
        sig = self.__dict__.get("sig")
        if sig is not None:
            envelope["kid"] = self.__dict__.get("kid", "")
            envelope["sig"] = sig
        return envelope


#: The envelope keys beyond the first release's, and the values each may take.
PRIORITIES = ("low", "normal", "high", "urgent")
VISIBILITIES = ("internal", "user_visible", "user_redacted")
_OPTIONAL = ("thread", "priority", "ack", "visibility", "chain", "sig", "kid")
_KID = re.compile(r"[0-9a-f]{16}")


def may_be_signed(data: bytes) -> bool:
    """Whether a line of ``data`` may carry a signature: a ``sig`` is 64 bytes in
    base64, so it ends in ``==`` (a line whose ``sig`` does not is set aside), and an
    ``=`` is found at memchr's speed, where a search for ``"sig":"`` costs a reader
    about 0.1 ms per 1,000 lines."""
    return b"=" in data


def check_name(name: object, what: str = "name") -> str:
    """Return ``name`` if it is a valid team or agent name, else raise `InvalidName`.

    >>> check_name("worker-1", "agent")
    'worker-1'
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidName(
            f"invalid {what} {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    if name.endswith(_RESERVED_SUFFIXES):
        raise InvalidName(
            f"invalid {what} {name!r}: names may not end in .lock, .json or .jsonl; rename it"
        )
    return name


def check_id(value: object, what: str = "id") -> str:
    """Return ``value`` if it is a message id (12 lowercase hex characters)."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise InvalidMessage(
            f"invalid {what} {value!r}: a message id is 12 lowercase hex characters"
        )
    return value


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """Return a copy of ``metadata`` if every key and value is a string."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidMessage(f"invalid metadata {metadata!r}: pass a mapping of strings to strings")
    checked = dict(metadata)
    for key, value in checked.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidMessage(
                f"invalid metadata {key!r}: {value!r}: keys and values must be strings; "
                "convert them with str()"
            )
    return checked


def check_type(value: object) -> MessageType | str:
    """Return the `MessageType` named by ``value`` (a member or its wire name), or the
    name itself for any other valid type name (``^[a-z][a-z0-9_]{0,63}$``).

    >>> check_type("text"), check_type("blocker")
    (<MessageType.TEXT: 'text'>, 'blocker')
    """
    if isinstance(value, MessageType):
        return value
    try:
        return _KINDS[value] if isinstance(value, str) else _KINDS[""]
    except KeyError:
        raise InvalidMessage(
            f"invalid message type {value!r}: use a lowercase name matching "
            f"[a-z][a-z0-9_]{{0,63}}, e.g. one of {', '.join(_TYPES)}"
        ) from None


def check_priority(value: object) -> str:
    """Return ``value`` if it is a priority (``low``, ``normal``, ``high``, ``urgent``)."""
    if value not in PRIORITIES:
        raise InvalidMessage(f"invalid priority {value!r}: use one of {', '.join(PRIORITIES)}")
    return str(value)


def check_visibility(value: object) -> str:
    """Return ``value`` if it is a visibility (``internal``, ``user_visible``,
    ``user_redacted``)."""
    if value not in VISIBILITIES:
        raise InvalidMessage(f"invalid visibility {value!r}: use one of {', '.join(VISIBILITIES)}")
    return str(value)


def check_chain(value: object) -> tuple[str, ...]:
    """Return ``value`` as a chain of agent names (a sequence, or a comma-separated str)."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part]
    if not isinstance(value, (list, tuple)):
        raise InvalidMessage(f"invalid chain {value!r}: give agent names, oldest first")
    return tuple(check_name(name, "agent name in the chain") for name in value)


#: Fresh ids drawn ahead, 64 from one system call (a child after fork draws its own).
_FRESH: list[str] = []
os.register_at_fork(after_in_child=_FRESH.clear)


def new_id() -> str:
    """A fresh random message id: 12 lowercase hex characters (48 random bits)."""
    try:
        return _FRESH.pop()  # atomic: two threads never get the same id
    except IndexError:
        drawn = os.urandom(6 * 64).hex()
        _FRESH.extend(drawn[at : at + 12] for at in range(0, len(drawn), 12))
        return _FRESH.pop()


#: The date and time to the second of the last few seconds formatted: they change once
#: a second, and a presence check formats two (now, and now less the timeout).
_ts_prefixes: dict[int, str] = {}


def format_ts(micros: int) -> str:
    """UTC ISO-8601 with microseconds and ``Z`` for a time in microseconds since the epoch.

    >>> format_ts(1_700_000_000_123_456)
    '2023-11-14T22:13:20.123456Z'
    """
    second, fraction = divmod(micros, 1_000_000)
    prefix = _ts_prefixes.get(second)
    if prefix is None:
        if len(_ts_prefixes) >= 8:
            _ts_prefixes.clear()
        prefix = _ts_prefixes[second] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return f"{prefix}.{fraction:06d}Z"


def parse_ts(ts: str) -> float:
    """Seconds since the epoch for a ``ts`` that `format_ts` wrote.

    >>> parse_ts("2023-11-14T22:13:20.123456Z")
    1700000000.123456
    """
    import calendar  # here, not above: it costs the command line milliseconds to import

    second = calendar.timegm(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S"))
    return second + int(ts[20:26]) / 1_000_000


def encode(message: Message) -> bytes:
    """The wire line for ``message``, newline included."""
    try:
        return codec.dumps_line(message.to_dict())
    except TypeError as exc:  # orjson refuses lone surrogates and non-string values
        raise InvalidMessage(f"message {message.id} cannot be encoded: {exc}") from None


#: A wire ts is this wide; it stands for the ts while a line is encoded outside the lock.
TS_PLACEHOLDER = "0000-00-00T00:00:00.000000Z"
_TS_VALUE = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def encode_parts(envelope: dict[str, Any], max_bytes: int) -> tuple[bytes, bytes]:
    """The wire line for ``envelope`` split around its ts value: ``head + ts + tail``.

    A sender encodes outside the inbox lock, and under it only takes the ts and writes
    the line. Refuses a line over ``max_bytes`` or one that is not UTF-8 JSON.
    """
    envelope["ts"] = TS_PLACEHOLDER
    try:
        line = codec.dumps_line(envelope)
    except TypeError as exc:
        raise InvalidMessage(f"message cannot be encoded as UTF-8 JSON: {exc}") from None
    if len(line) > max_bytes:
        raise InvalidMessage(
            f"message of {len(line)} bytes is over the {max_bytes}-byte limit: "
            "send a shorter body or raise RALPH_MAX_MESSAGE_BYTES"
        )
    # ts is the last key but for reply_to (12 hex digits), and a quote inside a string
    # value is escaped, so the last '"ts":"' is the envelope's own.
    cut = line.rfind(b'"ts":"') + 6
    return line[:cut], line[cut + len(TS_PLACEHOLDER) :]


def fit_text(text: str, max_bytes: int) -> str:
    """The longest start of ``text`` that takes at most ``max_bytes`` as a JSON string's
    content on the wire: a quote, a backslash or a control character costs two bytes or
    more there, so a body under the limit raw can be over it encoded.

    >>> fit_text('say "hi"', 6)
    'say '
    """
    if len(codec.dumps(text)) - 2 <= max_bytes:
        return text
    low, high = 0, min(len(text), max_bytes)  # a character costs a byte at least
    while low < high:  # a few dozen encodings of the body at most, on a rare path
        middle = (low + high + 1) // 2
        if len(codec.dumps(text[:middle])) - 2 <= max_bytes:
            low = middle
        else:
            high = middle - 1
    return text[:low]


def last_ts(data: bytes) -> str | None:
    """The ts of the last line in ``data`` (None when it has none).

    Runs under the inbox lock on every contended send, so it is an rfind, not a parse.
    """
    start = data.rfind(b'"ts":"') + 6
    stamp = data[start : start + len(TS_PLACEHOLDER)]
    return stamp.decode() if start > 5 and _TS_VALUE.fullmatch(stamp) else None


#: A read of more lines than this decodes them with orjson (see `ralph_mail.codec`).
MANY_LINES = 256
_FIELDS = ("id", "from_agent", "to_agent", "type", "content", "metadata", "ts", "reply_to")
_FIELD_SET = frozenset(_FIELDS)
_OPTIONAL_SET = frozenset(_OPTIONAL)
_new = object.__new__
_adopt = object.__setattr__


def decode(line: bytes) -> Message:
    """Parse one wire line (with or without its newline); unknown keys are ignored.

    Raises `InvalidMessage` naming what is wrong, so the reader can set the line aside.
    """
    try:
        fields = codec.loads(line)
    except codec.DecodeError as exc:
        raise InvalidMessage(f"not valid JSON: {exc}") from None
    if type(fields) is not dict:
        raise InvalidMessage("not a JSON object")
    # Rename the wire keys in place and adopt the dict: the hot path of every read.
    try:
        fields["from_agent"] = fields.pop("from")
        fields["to_agent"] = fields.pop("to")
        fields["type"] = _KINDS[fields["type"]]
    except KeyError as exc:
        raise InvalidMessage(f"missing or unknown value for key {exc}") from None
    except TypeError:
        raise InvalidMessage(f"bad type value {fields['type']!r}") from None
    if "reply_to" not in fields:
        fields["reply_to"] = None
    if "metadata" not in fields:
        fields["metadata"] = {}
    if len(fields) != 8:  # optional keys, or keys from a newer writer: keep only ours
        try:
            kept = {key: fields[key] for key in _FIELDS}
        except KeyError as exc:
            raise InvalidMessage(f"missing key {exc}") from None
        for key in _OPTIONAL:
            if key in fields:
                kept[key] = _check_optional(key, fields[key])
        fields = kept
    try:
        well_typed = (
            type(fields["id"]) is str
            and type(fields["content"]) is str
            and type(fields["ts"]) is str
            and type(fields["from_agent"]) is str
            and type(fields["to_agent"]) is str
            and type(fields["metadata"]) is dict
            and (fields["reply_to"] is None or type(fields["reply_to"]) is str)
        )
    except KeyError as exc:
        raise InvalidMessage(f"missing key {exc}") from None
    if not well_typed:
        raise InvalidMessage("a key has the wrong JSON type")
    for value in fields["metadata"].values():
        if type(value) is not str:
            raise InvalidMessage(f"metadata value {value!r} is not a string")
    message = _new(Message)
    _adopt(message, "__dict__", fields)
    return message


def _check_optional(key: str, value: Any) -> Any:
    """An optional envelope key's value as read from the wire, or `InvalidMessage`."""
    good = (
        (key == "thread" and type(value) is str and _ID.fullmatch(value) is not None)
        or (key == "priority" and value in PRIORITIES)
        or (key == "ack" and type(value) is bool)
        or (key == "visibility" and value in VISIBILITIES)
        or (key == "chain" and type(value) is list and all(type(v) is str for v in value))
        or (key == "sig" and type(value) is str and len(value) == 88 and value[-2:] == "==")
        or (key == "kid" and type(value) is str and _KID.fullmatch(value) is not None)
    )
    if not good:
        raise InvalidMessage(f"bad value for key {key!r}: {value!r}")
    return tuple(value) if key == "chain" else value


def decode_lines(lines: list[bytes]) -> tuple[list[Message | str], bool]:
    """Decode many lines: a `Message` for each good line, the reason for each bad one,
    and whether every line was good.

    The loop inlines `decode`'s checks for well-formed lines (the common case) and hands
    any other line to `decode` for its precise reason; reading is dominated by this loop.
    """
    out: list[Message | str] = []
    append = out.append
    clean = True
    # A read of many lines pays for orjson's import; a command's few lines do not.
    loads = codec.fast().loads if len(lines) > MANY_LINES else codec.loads
    types = _KINDS
    for line in lines:
        try:
            fields = loads(line)
            fields["from_agent"] = sender = fields.pop("from")
            fields["to_agent"] = recipient = fields.pop("to")
            fields["type"] = types[fields["type"]]
            if "reply_to" not in fields:
                fields["reply_to"] = None
            metadata = fields["metadata"]
            if len(fields) != 8:  # optional keys (a request's chain, a reply's thread)
                extra = fields.keys() - _FIELD_SET
                if len(fields) - len(extra) != 8 or not extra <= _OPTIONAL_SET:
                    raise InvalidMessage("keys beyond the envelope's")  # `decode` drops them
                for key in extra:
                    fields[key] = _check_optional(key, fields[key])
            ok = (
                sender.__class__
                is recipient.__class__
                is fields["id"].__class__
                is fields["content"].__class__
                is fields["ts"].__class__
                is str
                and metadata.__class__ is dict
                and (fields["reply_to"] is None or fields["reply_to"].__class__ is str)
            )
            if ok and metadata:
                for value in metadata.values():
                    if value.__class__ is not str:
                        ok = False
        except Exception:
            ok = False
        if ok:
            message = _new(Message)
            _adopt(message, "__dict__", fields)
            append(message)
        else:
            try:
                append(decode(line))
            except InvalidMessage as exc:
                append(str(exc))
                clean = False
    return out, clean


def from_envelope(envelope: Mapping[str, Any]) -> Message:
    """The `Message` for a wire envelope that the sender built and checked itself."""
    fields = {
        "id": envelope["id"],
        "from_agent": envelope["from"],
        "to_agent": envelope["to"],
        "type": _KINDS[envelope["type"]],
        "content": envelope["content"],
        "metadata": envelope["metadata"],
        "ts": envelope["ts"],
        "reply_to": envelope.get("reply_to"),
    }
    for key in _OPTIONAL:
        if key in envelope:
            fields[key] = tuple(envelope[key]) if key == "chain" else envelope[key]
    message = _new(Message)
    _adopt(message, "__dict__", fields)
    return message
