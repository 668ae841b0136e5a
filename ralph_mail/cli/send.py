"""Identity, message bodies and ``send``, shared by the commands.

Nothing here imports rich: this module is on the path of every shell send.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ralph_mail.errors import InvalidMessage, MailError

if TYPE_CHECKING:
    from ralph_mail.bus import MessageBus
    from ralph_mail.message import Message


@dataclass
class Identity:
    """Where and who: from options, else ``RALPH_HOME``/``RALPH_TEAM``/``RALPH_AGENT``."""

    home: str | None = None
    team: str | None = None
    agent: str | None = None

    def need_team(self) -> str:
        team = self.team or os.environ.get("RALPH_TEAM")
        if not team:
            raise MailError("no team given: pass --team NAME or set RALPH_TEAM")
        return team

    def need_agent(self) -> str:
        fixed = os.environ.get("RALPH_AGENT")
        agent = self.agent or fixed
        if not agent:
            raise MailError("who is sending? pass --agent NAME or set RALPH_AGENT")
        if os.environ.get("RALPH_AGENT_FIXED") and fixed and agent != fixed:
            # A job of `ralph-mail run` speaks for its agent alone: it may not approve its
            # own held message as its manager, nor change the rules as the lead.
            from ralph_mail.errors import PermissionDenied

            raise PermissionDenied(
                f"this process acts for {fixed} (fixed by 'ralph-mail run'): it cannot act as "
                f"{agent}; leave out --agent"
            )
        return agent

    def bus(self) -> MessageBus:
        from ralph_mail.bus import MessageBus

        return MessageBus(self.need_team(), self.need_agent(), self.home)

    def anonymous(self) -> bool:
        """No agent given: a read-only view then shows the whole team."""
        return not (self.agent or os.environ.get("RALPH_AGENT"))

    def viewer(self) -> MessageBus:
        """A bus for a read-only view (`thread`, `presence`, `agents`): mine, or with no
        agent given the team's lead's. A view writes nothing and shows what the team's
        files hold for anyone who can read them, so it needs no identity."""
        if not self.anonymous():
            return self.bus()
        from ralph_mail.bus import MessageBus
        from ralph_mail.team import load_team

        roster = load_team(self.need_team(), self.home)
        return MessageBus(roster.name, roster.lead, self.home)

    def lead(self, act: str) -> MessageBus:
        """The lead's bus, for a governance act (DESIGN §9.3a): `PermissionDenied` from
        any other identity, and from none."""
        from ralph_mail.errors import PermissionDenied

        if not (self.agent or os.environ.get("RALPH_AGENT")):
            raise PermissionDenied(
                f"{act} is the lead's to do: run it as the team's lead (--agent LEAD)"
            )
        bus = self.bus()
        try:
            bus.gate.require_lead(act)
        except BaseException:
            bus.close()
            raise
        return bus


def read_body(content: str | None, limit: int, *, empty_ok: bool = False) -> str:
    """The message body: ``content``; standard input for ``-`` or when input is piped.

    Standard input must be UTF-8 and no larger than ``limit``; one trailing newline is
    dropped, so ``echo hi | ralph-mail send lead`` sends ``hi``. An empty body is refused
    (`InvalidMessage`) unless ``empty_ok`` (a task's result, a status may be empty).
    """
    body = _read_body(content, limit)
    if not body and not empty_ok:
        raise InvalidMessage(
            "empty message: write what to say (an argument, or a pipe to standard input)"
        )
    return body


def _read_body(content: str | None, limit: int) -> str:
    if content is not None and content != "-":
        return content
    if content is None and sys.stdin.isatty():
        raise MailError("no content: pass CONTENT, or '-' or a pipe to read standard input")
    try:
        raw = sys.stdin.buffer.read(limit + 1)
    except OSError as exc:
        raise MailError(
            f"cannot read the body from standard input ({exc.strerror or exc}): pass CONTENT"
        ) from None
    if len(raw) > limit:
        raise InvalidMessage(
            f"standard input is over the {limit}-byte message limit: send a shorter body "
            "or raise RALPH_MAX_MESSAGE_BYTES"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidMessage(
            f"standard input is not UTF-8 (byte {raw[exc.start]:#04x} at offset {exc.start}): "
            "convert it, e.g. with iconv -t UTF-8"
        ) from None
    return text[:-1] if text.endswith("\n") else text


def parse_meta(pairs: Sequence[str]) -> dict[str, str]:
    """``k=v`` strings into a dict; a pair without ``=``, or a key given twice, is refused."""
    metadata: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise MailError(f"invalid --meta {pair!r}: write it as KEY=VALUE")
        if key in metadata:
            raise MailError(f"--meta {key!r} is given twice: give each key once")
        metadata[key] = value
    return metadata


@dataclass
class SendRequest:
    """One ``send`` as the command line gave it."""

    to: str
    content: str | None = None
    type: str = "text"
    meta: list[str] = field(default_factory=list)
    reply_to: str | None = None
    id: str | None = None
    json: bool = False
    identity: Identity = field(default_factory=Identity)
    priority: str | None = None
    ack: bool = False
    visibility: str | None = None
    thread: str | None = None
    wait: float | None = None
    wait_consumed: float | None = None

    def run(self) -> int:
        """Send; print the id (or the envelope with ``--json``)."""
        from ralph_mail import settings

        check_wait(self.wait)
        check_wait(self.wait_consumed, "--wait-consumed")
        metadata = parse_meta(self.meta)
        body = read_body(self.content, settings.max_message_bytes())
        bus = self.identity.bus()
        try:
            since = bus.store.size(bus.agent)
            message = bus.send(
                self.to, self.type, body, metadata, reply_to=self.reply_to, id=self.id,
                priority=self.priority, ack=self.ack, visibility=self.visibility,
                thread=self.thread,
            )  # fmt: skip
            from ralph_mail.cli import say

            if self.json:
                from ralph_mail.message import encode

                say(encode(message).decode())
            else:
                say(message.id + "\n")
            return after_send(bus, message, since, self.wait, self.wait_consumed)
        finally:
            bus.close()


def check_wait(wait: float | None, option: str = "--wait") -> None:
    """``--wait S`` (or ``option``): a number of seconds >= 0."""
    if wait is not None and not wait >= 0:
        raise MailError(f"invalid {option} {wait}: give a number of seconds >= 0")


def after_send(
    bus: MessageBus, message: Message, since: int, wait: float | None, consumed: float | None
) -> int:
    """After a send: for a message the policy held, see `held_exit`; for one delivered, a
    note naming the recipients that are offline. With ``consumed`` (``--wait-consumed``),
    then `consumed_exit`."""
    if message.ts:
        note_offline(bus, message)
        code = 0
    else:
        code = held_exit(bus, message.id, since, wait, f"message {message.id}")
    return code if code or consumed is None else consumed_exit(bus, message, consumed)


def note_offline(bus: MessageBus, message: Message) -> None:
    """One note on stderr naming the recipients of ``message`` that are offline: it is
    stored, and they read it when they come back."""
    from ralph_mail.cli import error_line
    from ralph_mail.govern.presence import offline
    from ralph_mail.message import BROADCAST_ADDRESS

    names = [message.to_agent]
    if message.to_agent == BROADCAST_ADDRESS:
        names = [name for name in bus.team.names if name != bus.agent]
    away = offline(bus.team, names)
    if len(away) == 1:
        name, seen = away[0]
        when = f"last seen {seen}" if seen else "never seen"
        error_line(f"{name} is offline ({when}): the message waits in its inbox", "note")
    elif away:
        listed = ", ".join(name for name, _ in away)
        error_line(f"{listed} are offline: the message waits in their inboxes", "note")


def consumed_exit(bus: MessageBus, message: Message, seconds: float) -> int:
    """``--wait-consumed S``: 0 once every recipient consumed ``message``, 1 when one did
    not within S seconds, 3 when its approver denied it; a line on stderr says which."""
    from ralph_mail.cli import EXIT_NO, EXIT_NOTHING, error_line

    if bus.wait_consumed(message, seconds):
        return 0
    left = [r for r in bus.receipts(message) if r.state in ("held", "denied", "stored")]
    if any(r.state == "denied" for r in left):
        error_line(f"message {message.id} was denied: it is never delivered")
        return EXIT_NO
    if not left:  # consumed since the wait ran out
        return 0
    names = ", ".join(r.to for r in left)
    error_line(f"message {message.id} was not consumed by {names} within {seconds:g} s")
    return EXIT_NOTHING


def held_exit(bus: MessageBus, message_id: str, since: int, wait: float | None, what: str) -> int:
    """A note naming the approver of held ``message_id`` on stderr; with ``wait``, the
    decision: 0 approved (delivered), 3 denied, 1 none in time (0 without ``wait``)."""
    from ralph_mail.cli import EXIT_NO, EXIT_NOTHING, error_line

    held = bus.approval_of(message_id)
    approver = held.approver if held is not None else "the approver"
    reason = f" ({held.reason})" if held is not None and held.reason else ""
    error_line(f"{what} is held for {approver}'s approval{reason}", "note")
    if wait is None:
        return 0
    decided = bus.wait_for_decision(message_id, since, wait)
    if decided is None:
        error_line(f"no decision on {what} within {wait:g} s")
        return EXIT_NOTHING
    if not decided:
        error_line(f"{what} was denied by {approver}")
        return EXIT_NO
    return 0
