"""`Mailbox`: the core of one agent's view of its team: write (through the Gate), look
messages up, and, through `Consuming`, read and wait.

Every message this package writes goes through `Mailbox._send` (one recipient) or
`Mailbox.broadcast` (all), and both ask the team's `Gate` first: nothing else appends to
an inbox. The rooms above it (``talk/``, ``govern/``) and `MessageBus` build on these
few methods; only the storage seam (`ralph_mail.store.base`) is below.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from ralph_mail import codec, settings
from ralph_mail.errors import (
    BroadcastError,
    InvalidMessage,
    MailError,
    UnknownAgent,
)
from ralph_mail.mailbox.consuming import UNKNOWN_END, Consuming
from ralph_mail.message import (
    BROADCAST_ADDRESS,
    TS_PLACEHOLDER,
    Message,
    MessageType,
    check_chain,
    check_id,
    check_metadata,
    check_name,
    check_priority,
    check_type,
    check_visibility,
    decode_lines,
    encode_parts,
    format_ts,
    from_envelope,
    new_id,
)
from ralph_mail.store.base import Cursor, TeamStore, Waiter
from ralph_mail.team import Member, Roster, Team, load_team

if TYPE_CHECKING:
    from typing import Self

    from ralph_mail.signing import Signer

_T = TypeVar("_T")

#: How often one mailbox notes its agent as active (s); see ralph_mail.govern.presence.
_TOUCH_EVERY_S = 1.0
#: Types that start a thread of their own, indexed under their id for `thread` (and
#: marked as starting there: only what threads answers, not every protocol message).
THREAD_STARTERS = frozenset({MessageType.REQUEST, MessageType.TASK_ASSIGNMENT})
#: Everything, for an index read: `indexed` returns O(what the index holds).
ALL = 1 << 62
#: How many of a pair's last messages `find` looks through before all of them.
_RECENT = 64


class Judge(Protocol):
    """What a mailbox asks before every write: the Gate (`ralph_mail.govern.gate.Gate`)."""

    def check(
        self,
        envelope: dict[str, object],
        *,
        in_thread: list[Message] | None = None,
        waits: bool = False,
    ) -> str:
        """Raise when ``envelope`` is refused; return why it is held, or "" to deliver it."""

    def hold(self, envelope: dict[str, object], reason: str) -> Message:
        """Keep ``envelope`` for approval; return it undelivered (no ``ts``)."""

    def require_lead(self, act: str) -> None:
        """`PermissionDenied` unless my agent is the lead: ``act`` is the lead's alone."""

    def requires_signed(self) -> bool:
        """Whether the team's policy requires signed messages (``require_signed``)."""


def pair_key(a: str, b: str) -> str:
    """The index of the direct messages between ``a`` and ``b``, both directions."""
    return "pair+" + "+".join(sorted((a, b)))


class Mailbox(Consuming):
    """One agent of one team: write to teammates through the Gate, consume its own inbox.

    Sends are appended under the recipient's inbox lock; reads start from the agent's
    persisted cursor, so only new messages are read, and waits block on file events.
    `MessageBus` is the public face of it, and gives it its Gate: ``gate`` makes the
    `Judge` every write of this mailbox asks; the other arguments are `MessageBus`'s.
    """

    def __init__(
        self,
        team: str,
        agent: str,
        home: str | os.PathLike[str] | None = None,
        *,
        gate: Callable[[Mailbox], Judge],
        durable: bool | None = None,
        max_message_bytes: int | None = None,
        backend: str | None = None,
    ) -> None:
        self.agent = check_name(agent, "agent name")
        self._team = load_team(team, home, backend=backend)
        self._team.member(agent)
        self._members = frozenset(self._team.names)
        self._roster = Roster(self._team)  # read again by refresh_team
        self._pairs: dict[tuple[str, str], str] = {}  # (sender, recipient): their index
        self._store = self._team.store
        self._store.durable = settings.durable(durable)
        self.max_message_bytes = settings.max_message_bytes(max_message_bytes)
        self._gc_auto = settings.gc_auto_bytes()
        self._compact_due = False
        self._cursor: Cursor | None = None
        self._scanned = 0  # logical offset up to which _pending is complete
        # Unconsumed (line start, message), oldest first: a deque, so that committing
        # message after message (the lead catching up) costs O(1) each, not O(pending).
        self._pending: deque[tuple[int, Message]] = deque()
        self._watcher: Waiter | None = None
        # Consuming, one thread at a time: asks from several threads, an MCP server's tools.
        self._lock = threading.RLock()
        # Per thread: an ask's waiter and thread marks, whether a wait did its chores
        # before it blocked, the commits a hand-on holds. Not attributes of the mailbox:
        # past 29 of those, CPython 3.11 keeps them in a dict of its own, and every
        # attribute on a wake-up's path costs more (a tenth of a wake-up, measured).
        self._local = threading.local()
        self._ask_waiters: list[tuple[threading.Thread, Waiter]] = []
        #: Requests this process asks now, each waiting for its own reply: a `poll` in
        #: another thread (an MCP server's check_inbox) leaves their replies to them.
        self.asking: set[str] = set()
        self._received: dict[str, Message] = {}  # requests read lately, by id (`received`)
        self._unseen_from = UNKNOWN_END  # (no claim yet)
        self._fresh: set[str] = set()
        self._answered: dict[str, None] = {}
        self._touched = -_TOUCH_EVERY_S  # when this mailbox last noted its agent as active
        self._myself: tuple[Team, Member] | None = None
        #: The agents the request this process handles passed through (``RALPH_CHAIN``):
        #: a request this mailbox sends carries it on, plus me.
        try:
            self.chain = check_chain(os.environ.get("RALPH_CHAIN", ""))
        except MailError as exc:
            raise InvalidMessage(f"RALPH_CHAIN: {exc}") from None
        self._signer: Signer | None = None  # made on the first send (see `seal`)
        self._signs: tuple[Team | None, bool] = (None, False)  # (roster, any key in it)
        #: The one Gate every message this mailbox writes passes.
        self.gate = gate(self)

    # -- who ----------------------------------------------------------------------------

    @property
    def team(self) -> Team:
        """The team's roster, as loaded (see `refresh_team`)."""
        return self._team

    @property
    def store(self) -> TeamStore:
        """The team's storage (the seam every backend implements)."""
        return self._store

    @property
    def durable(self) -> bool:
        """Whether each send is fsynced before it returns."""
        return self._store.durable

    def refresh_team(self) -> Team:
        """Reload the roster from the store (parsed again only when it changed: a
        broadcast to a thousand members looks at it twice)."""
        team = self._roster.now()
        if team is not self._team:
            self._team, self._members = team, frozenset(team.names)
        return team

    def me(self) -> Member:
        """My roster entry (looked up once per roster)."""
        if self._myself is None or self._myself[0] is not self._team:
            self._myself = (self._team, self._team.member(self.agent))
        return self._myself[1]

    def recipient(self, to: str) -> str:
        """``to`` if it names a member (the roster read again when it does not yet);
        `UnknownAgent` naming the members otherwise."""
        if to in self._members:
            return to
        if to == BROADCAST_ADDRESS:
            raise InvalidMessage("'*' is the broadcast address: use broadcast() to reach everyone")
        check_name(to, "recipient")
        if to in self.refresh_team().names:
            return to
        self._team.member(to)  # raises UnknownAgent naming the members
        raise UnknownAgent(to)  # pragma: no cover - member() raised

    # -- writing --------------------------------------------------------------------------

    def envelope(
        self,
        to: str,
        type: MessageType | str,
        content: str,
        metadata: Mapping[str, str] | None,
        reply_to: str | None = None,
        id: str | None = None,
        *,
        thread: str | None = None,
        priority: str | None = None,
        ack: bool = False,
        visibility: str | None = None,
        chain: tuple[str, ...] = (),
    ) -> dict[str, object]:
        """A checked envelope from me to ``to``, with no ``ts`` yet; the optional keys
        only where they differ from their defaults."""
        if not isinstance(content, str):
            raise InvalidMessage(
                f"content must be a string, not {content.__class__.__name__}: convert it with str()"
            )
        envelope: dict[str, object] = {
            "id": new_id() if id is None else check_id(id),
            "from": self.agent,
            "to": to,
            "type": str(check_type(type)),
            "content": content,
            "metadata": check_metadata(metadata),
        }
        if reply_to is not None:
            envelope["reply_to"] = check_id(reply_to, "reply_to")
        if thread is not None and check_id(thread, "thread") != envelope["id"]:
            envelope["thread"] = thread
        if priority is not None and check_priority(priority) != "normal":
            envelope["priority"] = priority
        if ack is True:
            envelope["ack"] = True
        elif ack is not False:
            raise InvalidMessage(f"invalid ack {ack!r}: pass True or False")
        if visibility is not None and check_visibility(visibility) != "internal":
            envelope["visibility"] = visibility
        if chain:
            envelope["chain"] = list(chain)
        envelope["ts"] = ""
        return envelope

    def _send(
        self,
        to: str,
        type: MessageType | str,
        content: str,
        metadata: Mapping[str, str] | None,
        reply_to: str | None,
        id: str | None,
        thread: str | None = None,
        priority: str | None = None,
        ack: bool = False,
        visibility: str | None = None,
        chain: tuple[str, ...] = (),
        *,
        in_thread: list[Message] | None = None,
    ) -> Message:
        """Write one message through the Gate. A message the Gate holds for approval is
        returned undelivered, with no ``ts``. ``in_thread``: the thread's messages, when
        the caller has just read them."""
        envelope = self.envelope(self.recipient(to), type, content, metadata, reply_to, id,
                                 thread=thread, priority=priority, ack=ack,
                                 visibility=visibility, chain=chain)  # fmt: skip
        return self.write(envelope, in_thread=in_thread, fresh=id is None)

    def write(
        self,
        envelope: dict[str, object],
        *,
        in_thread: list[Message] | None = None,
        waits: bool = False,
        fresh: bool = False,
    ) -> Message:
        """Deliver ``envelope`` (from `envelope`) if the Gate lets it through, or hold it
        for approval (returned with no ``ts``) if the Gate says so. ``waits``: the
        sender will wait for its answer (see `Gate.check`); ``fresh``: its id was made
        for it (see `_deliver`)."""
        held = self.gate.check(envelope, in_thread=in_thread, waits=waits)
        if held:
            return self.gate.hold(envelope, held)
        return self._deliver(envelope, fresh=fresh)

    def _deliver(self, envelope: dict[str, object], *, fresh: bool = False) -> Message:
        """Append an envelope the Gate passed to its recipient's inbox, and index it.

        ``fresh``: the envelope's id was made for it, never sent before: a thread it
        starts is marked as starting here, before any message of it exists, so that a
        look at the thread stops there (an id sent again, a retry, is not marked: the
        look goes back further, and finds the first sending's answers too). An id
        from `take_marked_id` was marked already."""
        self.seal(envelope)
        head, tail = encode_parts(envelope, self.max_message_bytes)
        if fresh and envelope["type"] in THREAD_STARTERS and not self._was_marked(envelope):
            try:
                self._store.index_start(f"thread+{envelope['id']}")
            except MailError as exc:  # only a look at the thread is slower: send on
                warnings.warn(f"{exc}; thread {envelope['id']} is looked up in full",
                              RuntimeWarning, stacklevel=3)  # fmt: skip
        envelope["ts"], offset = self._store.append(str(envelope["to"]), head, tail)
        self.touch()
        self._index(envelope, offset, len(head) + len(TS_PLACEHOLDER) + len(tail))
        return from_envelope(envelope)

    def premark(self) -> None:
        """Make the id of this thread's next ask and mark its thread's start now (see
        `_deliver`): an ask does it while it waits for its answer, so the next one does
        not wait for it. A mark whose id is never used costs its entry, nothing more."""
        marked = new_id()
        try:
            self._store.index_start(f"thread+{marked}")
        except MailError:  # the next ask marks its thread itself
            return
        self._local.marked = marked

    def take_marked_id(self) -> str | None:
        """The id `premark` made for this thread's next ask, if any, given out once: the
        envelope made with it is delivered unmarked again (see `_deliver`)."""
        marked = getattr(self._local, "marked", None)
        self._local.marked = None
        self._local.taken = marked
        return marked

    def _was_marked(self, envelope: dict[str, object]) -> bool:
        return envelope["id"] == getattr(self._local, "taken", None)

    def _index(self, envelope: dict[str, object], offset: int, length: int) -> None:
        """Note where a direct message is, for `history`, `thread` and the Gate.

        After the append, not under its lock: a process killed in between, or an index
        that cannot be written, leaves the message delivered but missing from history
        (never the other way round).
        """
        # (The sender, not me: an approver releasing a held message delivers it for it.)
        sender, recipient = str(envelope["from"]), str(envelope["to"])
        pair = self._pairs.get((sender, recipient))
        if pair is None:
            pair = self._pairs[sender, recipient] = pair_key(sender, recipient)
        kind = envelope["type"]
        try:
            self._store.index_add(pair, recipient, offset, length)
            if "thread" in envelope or kind in THREAD_STARTERS:
                thread = envelope.get("thread", envelope["id"])
                self._store.index_add(f"thread+{thread}", recipient, offset, length)
            if "ack" in envelope:  # for pending_acks: what the sender asked to be acknowledged
                self._store.index_add(f"acks+{sender}", recipient, offset, length)
            if kind == MessageType.ACK:  # and what answered it, for its sender
                self._store.index_add(f"acked+{recipient}", recipient, offset, length)
        except MailError as exc:  # the message is delivered: a send that returned stays so
            warnings.warn(f"{exc}; message {envelope['id']} is missing from history",
                          RuntimeWarning, stacklevel=4)  # fmt: skip

    def _index_copies(self, envelope: dict[str, object], copies: list[tuple[str, int]],
                      length: int) -> None:  # fmt: skip
        """Note where each copy of a broadcast is, ``(member, offset)``, in its sender's
        ``broadcasts+NAME`` index (for receipts); as `_index`, after the appends."""
        entries = [(member, offset, length) for member, offset in copies]
        try:
            self._store.index_extend(f"broadcasts+{envelope['from']}", entries)
        except MailError as exc:
            warnings.warn(f"{exc}; broadcast {envelope['id']} lacks receipts", RuntimeWarning,
                          stacklevel=3)  # fmt: skip

    def broadcast(
        self,
        content: str,
        metadata: Mapping[str, str] | None = None,
        *,
        type: MessageType | str = MessageType.BROADCAST,
        id: str | None = None,
        priority: str | None = None,
        ack: bool = False,
        visibility: str | None = None,
    ) -> Message:
        """Append one message (one id) to every member's inbox but the sender's.

        Each inbox gets the line with the ts taken under its own lock; the message
        returned carries the last of them. If an inbox cannot be written, `BroadcastError`
        names the inboxes that did and did not receive it.
        """
        envelope = self.envelope(BROADCAST_ADDRESS, type, content, metadata, None, id,
                                 priority=priority, ack=ack, visibility=visibility)  # fmt: skip
        head, tail = encode_parts(envelope, self.max_message_bytes)
        held = self.gate.check(envelope)
        if held:
            return self.gate.hold(envelope, held)
        if self.seal(envelope):  # one signature for every copy: the ts is not signed
            head, tail = encode_parts(envelope, self.max_message_bytes)
        self.touch()
        delivered: list[str] = []
        failed: list[str] = []
        copies: list[tuple[str, int]] = []
        reason = ""
        for member in self.refresh_team().names:
            if member == self.agent:
                continue
            try:
                envelope["ts"], offset = self._store.append(member, head, tail)
            except MailError as exc:
                failed.append(member)
                reason = str(exc)
            else:
                delivered.append(member)
                copies.append((member, offset))
        self._index_copies(envelope, copies, len(head) + len(TS_PLACEHOLDER) + len(tail))
        if failed:
            raise BroadcastError(
                f"broadcast {envelope['id']} reached {', '.join(delivered) or 'no inbox'} "
                f"but not {', '.join(failed)}: {reason}",
                delivered,
                failed,
            )
        return from_envelope(envelope)

    def release(self, envelope: dict[str, object], sender: str, since: int) -> None:
        """Deliver a message the Gate held, once approved: unchanged, same id, to the
        inboxes that lack it (from logical offset ``since`` on)."""
        if envelope["to"] != BROADCAST_ADDRESS:
            if not self.delivered(str(envelope["to"]), str(envelope["id"]), since):
                self._deliver(dict(envelope))
            return
        head, tail = encode_parts(dict(envelope), self.max_message_bytes)
        for member in self.refresh_team().names:
            if member != sender and not self.delivered(member, str(envelope["id"]), since):
                _, offset = self._store.append(member, head, tail)
                length = len(head) + len(TS_PLACEHOLDER) + len(tail)
                self._index_copies(envelope, [(member, offset)], length)

    # -- signatures -------------------------------------------------------------------------

    def signer(self, shared: Signer | None = None) -> Signer:
        """What signs my agent's messages (its key file is read on the first use);
        ``shared``: use that one from now on (a process's buses read the key once)."""
        if shared is not None:
            self._signer = shared
        if self._signer is None:
            from ralph_mail.signing import Signer

            self._signer = Signer(self._team.name, self.agent, self._team.home)
        return self._signer

    def seal(self, envelope: dict[str, object]) -> bool:
        """Sign ``envelope`` if my agent sends it, has a key and it is not signed yet
        (a held message released by its approver keeps its sender's signature); return
        whether it was signed now. Call once everything but the ts is final."""
        if envelope["from"] != self.agent or "sig" in envelope:
            return False
        return self.signer().sign(envelope)

    def _trust(self, messages: Sequence[Message | str], signed: bool, *,
               refuse: bool = True) -> bool:  # fmt: skip
        """Check the signatures of ``messages`` (``signed``: one of them may carry a
        signature, `may_be_signed`), setting
        `Message.verified`; under ``require_signed`` (and ``refuse``: ``messages`` is then
        a list) put in place of each message not signed by its sender's roster key why
        it is set aside. Return whether none was. Costs a look at the policy (cached)
        when the team signs nothing."""
        require = self.gate.requires_signed()
        if self._signs[0] is not self._team:
            self._signs = (self._team, any(m.key for m in self._team.members))
        if not (require or self._signs[1] or signed):
            return True
        from ralph_mail import signing

        found = [m for m in messages if isinstance(m, Message)]
        signing.verify(found, self._team, require=require)
        if any(m.verified is False for m in found):  # a key newer than my roster?
            signing.verify(found, self.refresh_team(), require=require)
        clean = True
        for n, message in enumerate(messages) if require and refuse else ():
            why = signing.refusal(message) if isinstance(message, Message) else ""
            if why:
                cast("list[Message | str]", messages)[n] = why
                clean = False
        return clean

    # -- looking things up ------------------------------------------------------------------

    def indexed(self, key: str, limit: int) -> list[Message]:
        """The last ``limit`` messages of index ``key`` (a pair, a thread), oldest first."""
        found: list[Message] = []
        signed = False
        for agent, offset, length in self._store.index_tail(key, limit):
            line = self._store.read_line(agent, offset, length)
            if line is None:
                continue  # collected by gc
            message = decode_lines([line])[0][0]
            if isinstance(message, Message):
                found.append(message)
                signed = signed or "sig" in message.__dict__
        self._trust(found, signed, refuse=False)
        # Entries are written just after their message, so two senders racing can note
        # them out of order; the timestamps, taken under each inbox's lock, cannot.
        found.sort(key=lambda message: message.ts)
        return found

    def find(self, message_id: str, between: tuple[str, str]) -> Message | None:
        """The direct message ``message_id`` between the two agents ``between``, ``(its
        sender, its recipient)``, or None.

        Every direct message is in its pair's index once its sender noted it there, just
        after the append: one not noted yet (an answer can come in between; a kill there
        leaves it so) is looked for among its recipient's last lines (`arrived`)."""
        # What is answered is most often recent: the pair's last few first, all of it last.
        pair = pair_key(*between)
        for message in reversed(self.indexed(pair, _RECENT)):
            if message.id == message_id:
                return message
        unnoted = self.arrived(between[1], message_id)
        if unnoted is not None and unnoted.from_agent == between[0]:
            return unnoted
        for message in reversed(self.indexed(pair, ALL)):
            if message.id == message_id:
                return message
        return None

    def arrived(self, agent: str, message_id: str) -> Message | None:
        """``message_id`` among the last `settings.RESPOND_LOOKBACK_LINES` lines of
        ``agent``'s inbox, read or not, or None: where a message is before its sender
        notes it in the indexes (`_index`, just after the append), and stays when a kill
        comes in between."""
        lines, _ = self._store.read_tail(agent, settings.RESPOND_LOOKBACK_LINES)
        needle = message_id.encode()
        for message in reversed(decode_lines([line for line in lines if needle in line])[0]):
            if isinstance(message, Message) and message.id == message_id:
                return message
        return None

    def delivered(
        self,
        agent: str,
        message_id: str,
        since: int,
        *,
        collected: bool = False,
        audit: bool = False,
    ) -> bool:
        """Whether a line with ``message_id`` is in ``agent``'s inbox from ``since`` on
        (with ``audit``: in its audit trail, what gc archived included).

        When that part is no longer kept (gc collected it; with ``audit``, a purge), the
        answer is ``collected``: the caller says which way to err.
        """
        needle = b'"id":"' + message_id.encode() + b'"'
        offset = since
        while True:
            if audit:
                data, start = self._store.read_audit(agent, offset)
            else:
                data, start = self._store.read(agent, offset, skip_collected=True)
            if start > offset:
                return collected
            offset = start
            if not data:
                return False
            if needle in data:
                return True
            offset += len(data)

    # -- presence -------------------------------------------------------------------------

    def touch(self) -> bool:
        """Note that my agent is active (at most once a second per mailbox: cheap in a
        loop); return whether it did."""
        now = time.monotonic()
        if now - self._touched < _TOUCH_EVERY_S:
            return False
        self._touched = now
        try:
            raw = self._store.load_presence(self.agent)
            record = codec.loads(raw) if raw else {}
            record["last_seen"] = format_ts(time.time_ns() // 1000)
            self._store.save_presence(self.agent, codec.dumps(record))
        except (MailError, ValueError) as exc:  # presence is a hint: never stop mail for it
            warnings.warn(f"cannot note {self.agent!r} as active: {exc}", RuntimeWarning,
                          stacklevel=3)  # fmt: skip
        return True

    def touched_now(self) -> None:
        """Note that presence was just saved (no second save within the second)."""
        self._touched = time.monotonic()

    def _before_read(self) -> None:
        """Run before a read, at most once a second: the rooms' deferred work (a subclass
        releases assignments held for a sleeping agent)."""

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Release descriptors and stop the watcher; the mailbox can be used again after."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        with self._lock:
            for _, waiter in self._ask_waiters:
                waiter.close()
            self._ask_waiters.clear()
            self._local = threading.local()
        self._cursor = None  # the next read claims the inbox again and starts from disk
        self._store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        team, home = self._team.name, str(self._team.home)
        return f"{type(self).__name__}(team={team!r}, agent={self.agent!r}, home={home!r})"
