"""What `ralph-mail serve` knows of its team: a snapshot for the page, and the acts a
person takes there (approve, deny, answer), each done by the member whose act it is.

Everything goes through `MessageBus` and the store's records: nothing here touches a
file. A snapshot is bounded (`SHOWN` messages, the tasks of the log, what waits), so a
long-lived server holds nothing that grows with the team's mail.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Final

from ralph_mail.bus import MessageBus
from ralph_mail.errors import MailError, UnknownAgent
from ralph_mail.govern import approvals, presence
from ralph_mail.govern.policy import requires_signed
from ralph_mail.message import Message, MessageType, decode_lines
from ralph_mail.signing import Marks
from ralph_mail.talk import tasks
from ralph_mail.team import Team

if TYPE_CHECKING:
    from collections.abc import Callable

    from ralph_mail.store.base import TeamStore

#: Messages the conversation shows at most (the newest), and requests looked at per human.
SHOWN: Final = 200


class TeamView:
    """One team as the server sees it: read through the lead's bus, acted on through the
    bus of the member who acts. Safe to use from many threads: its reads and acts take
    turns (a bus is not shared between threads at once)."""

    def __init__(self, team: str, home: str | None = None) -> None:
        self._home = home
        self._lead = MessageBus(team, _lead_of(team, home), home)
        self._buses: dict[str, MessageBus] = {}
        self._lock = threading.RLock()
        self._marks = Marks()  # each shown message's signature, checked once

    @property
    def store(self) -> TeamStore:
        return self._lead.store

    @property
    def home(self) -> str | None:
        """The mailbox home given (None: the default)."""
        return self._home

    @property
    def name(self) -> str:
        return self._lead.team.name

    def team(self) -> Team:
        """The roster now (parsed again only when it changed)."""
        with self._lock:  # (the lead's bus is used by one thread at a time)
            return self._lead.refresh_team()

    def bus(self, agent: str) -> MessageBus:
        """The bus of member ``agent`` (`UnknownAgent` for anyone else), made once."""
        self.team().member(agent)
        with self._lock:
            if agent not in self._buses:
                self._buses[agent] = MessageBus(self.name, agent, self._home)
            return self._buses[agent]

    def waiter_keys(self) -> list[str]:
        """What a change of the page is seen in: every inbox, the task and approval logs."""
        return [*self.team().names, f"log:{tasks.LOG}", f"log:{approvals.LOG}"]

    def follow(self, changed: Callable[[], None], stop: threading.Event, period: float) -> None:
        """Call ``changed`` after each change of the team (a waiter on `waiter_keys`, so
        nothing runs while the team is quiet), and every ``period`` s for presence, which
        ages without any event; until ``stop`` is set. Meanwhile the human members are
        present: the page is where they answer."""
        waiter = self.store.waiter(self.waiter_keys())
        try:
            while not stop.is_set():
                self.keep_humans_present()
                waiter.wait(period, stop)
                if not stop.is_set():
                    changed()
        finally:
            waiter.close()

    def keep_humans_present(self) -> None:
        """Note each human member as active (what is asked of it reaches the page)."""
        with self._lock:
            for member in self.team().members:
                if member.human:
                    self.bus(member.name).touch()

    # -- the snapshot ---------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, as JSON-ready data."""
        with self._lock:
            return self._snapshot()

    def task_log(self) -> dict[str, tasks.Task]:
        """The team's tasks, from its task log."""
        with self._lock:
            return tasks.load(self.store)[0]

    def _snapshot(self) -> dict[str, Any]:
        team = self.team()
        now = time.time()
        tree = tasks.tree_lines(tasks.load(self.store)[0])
        return {
            "team": team.name,
            "members": [_member(team, m.name, now) for m in team.members],
            "tasks": [{"prefix": prefix, **task.to_dict()} for prefix, task in tree],
            "messages": self._shown(self.conversation(team)),
            "approvals": [_held(h) for h in self.waiting()],
            "questions": self._shown(self.questions(team)),
        }

    def _shown(self, messages: list[Message]) -> list[dict[str, Any]]:
        """``messages`` for the page, each with its signature's mark (`signing.seal`)."""
        marks = self._marks.of(messages, self.team, requires_signed(self.store))
        return [{**_message(m), "seal": mark} for m, mark in zip(messages, marks, strict=True)]

    def conversation(self, team: Team) -> list[Message]:
        """The team's last `SHOWN` messages, every inbox merged, oldest first."""
        found: list[Message] = []
        for name in team.names:
            lines, _ = self.store.read_tail(name, SHOWN)
            found += [m for m in decode_lines(lines)[0] if isinstance(m, Message)]
        found.sort(key=lambda message: message.ts)
        return found[-SHOWN:]

    def waiting(self) -> list[approvals.Held]:
        """The held messages not decided yet, oldest first, whoever approves them."""
        log = approvals.fold(self.store.log_read(approvals.LOG))
        return [held for held in log.values() if held.decision is None]

    def questions(self, team: Team) -> list[Message]:
        """The requests to a human member that it has not answered, oldest first."""
        open_: list[Message] = []
        for member in team.members:
            if not member.human:
                continue
            lines, _ = self.store.read_tail(member.name, SHOWN)
            for message in decode_lines(lines)[0]:
                if (isinstance(message, Message) and message.type == MessageType.REQUEST
                        and not self._answered(message)):  # fmt: skip
                    open_.append(message)
        return open_

    def _answered(self, request: Message) -> bool:
        return any(m.type == MessageType.REPLY and m.reply_to == request.id
                   and m.from_agent == request.to_agent
                   for m in self._lead.indexed(f"thread+{request.thread}", SHOWN))  # fmt: skip

    # -- acts -----------------------------------------------------------------------------

    def decide(self, message_id: str, approved: bool, reason: str = "") -> approvals.Held:
        """Approve or deny a held message, as its approver."""
        with self._lock:
            held = self._lead.approval_of(message_id)
            if held is None:
                raise MailError(f"no message {message_id!r} is held for approval")
            bus = self.bus(held.approver)
            return bus.approve(message_id) if approved else bus.deny(message_id, reason)

    def delegate(self, caller: str, to: str, text: str) -> tasks.Task:
        """Give ``to`` a task from ``caller`` (the policy and the Gate judge it)."""
        with self._lock:
            return self.bus(caller).delegate(to, text)

    def cancel(self, caller: str, task_id: str, reason: str) -> tasks.Task:
        """Cancel task ``task_id`` as ``caller`` (its delegator, or the lead)."""
        with self._lock:
            return self.bus(caller).cancel(task_id, reason)

    def answer(self, request_id: str, text: str) -> Message:
        """Answer a question put to a human member, as that member, in its thread."""
        with self._lock:
            for request in self.questions(self.team()):
                if request.id == request_id:
                    return self.bus(request.to_agent).reply(request, text)
        raise UnknownAgent(f"no open question {request_id!r} to a human member")

    def close(self) -> None:
        """Close the buses; the human members are offline again (no page serves them)."""
        with self._lock:
            team = self.team()
            for name, bus in self._buses.items():
                if name in team.names and team.member(name).human:
                    presence.went_offline(self.store, name)
                bus.close()
            self._buses.clear()
        self._lead.close()


def _lead_of(team: str, home: str | None) -> str:
    from ralph_mail.team import load_team

    return load_team(team, home).lead


def _member(team: Team, name: str, now: float) -> dict[str, Any]:
    member = team.member(name)
    here, last_seen, until = presence.presence_of(team, name, now)
    return {"name": name, "role": member.role, "description": member.description,
            "human": member.human, "presence": here, "last_seen": last_seen,
            "until": until}  # fmt: skip


def _message(message: Message) -> dict[str, Any]:
    return {"id": message.id, "from": message.from_agent, "to": message.to_agent,
            "type": str(message.type), "content": message.content, "ts": message.ts,
            "visibility": message.visibility, "thread": message.thread}  # fmt: skip


def _held(held: approvals.Held) -> dict[str, Any]:
    envelope = held.envelope
    return {"id": held.id, "from": held.sender, "to": str(envelope.get("to", "")),
            "type": str(envelope.get("type", "")), "content": str(envelope.get("content", "")),
            "approver": held.approver, "reason": held.reason, "held_at": held.held_at}  # fmt: skip
