"""A shutdown round's bookkeeping: whom the lead asked, with which requests, what each
answered, and when to ask again an agent that deferred.

`TeamOrchestrator.request_shutdown` sends the requests and handles the mail; this
module only decides, from what came back, who is done and whose turn it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from ralph_mail.orchestrator.records import ShutdownReport
from ralph_mail.protocols import ShutdownAnswer


@dataclass
class _Ask:
    """One agent's part of a shutdown round."""

    requests: set[str]
    answer: bool | None = None
    reason: str = ""
    deferred: bool = False
    next_ask: float | None = None


class ShutdownRound:
    """The asks of one shutdown round, agent by agent.

    An agent that defers is due to be asked again ``retry_s`` seconds later, or at once
    when it reports itself available; an answer to a request of an earlier round, or one
    after the agent's final answer, changes nothing.

    Example:
        >>> shutdown = ShutdownRound(["w1"], retry_s=5.0)
        >>> shutdown.asked("w1", "m-1"), shutdown.answered()
        (False, False)
        >>> shutdown.answer("w1", ShutdownAnswer(True, False, "idle", "m-1"))
        >>> shutdown.answered(), dict(shutdown.report())
        (True, {'w1': True})
    """

    def __init__(self, agents: Iterable[str], retry_s: float) -> None:
        self.retry_s = retry_s
        self._asks = {agent: _Ask(set()) for agent in agents}

    def asked(self, agent: str, request_id: str) -> bool:
        """Record that ``agent`` was sent the request ``request_id``; return whether it
        had been asked before in this round."""
        ask = self._asks[agent]
        ask.requests.add(request_id)
        ask.next_ask = None
        return len(ask.requests) > 1

    def answered(self) -> bool:
        """Whether every agent has given its final answer (accepted or refused)."""
        return all(ask.answer is not None for ask in self._asks.values())

    def due(self, now: float) -> tuple[list[str], float | None]:
        """The deferring agents whose turn has come at ``now`` (monotonic), and the
        next turn of the others (None: no other is waiting for one)."""
        ready: list[str] = []
        following: float | None = None
        for agent, ask in self._asks.items():
            if ask.answer is not None or ask.next_ask is None:
                continue
            if ask.next_ask <= now:
                ready.append(agent)
                continue
            following = ask.next_ask if following is None else min(following, ask.next_ask)
        return ready, following

    def available(self, agent: str) -> None:
        """``agent`` reported itself available: if it deferred, its turn is now (it
        finished what it deferred for)."""
        ask = self._asks.get(agent)
        if ask is not None and ask.answer is None and ask.deferred:
            ask.next_ask = time.monotonic()

    def answer(self, agent: str, answer: ShutdownAnswer) -> None:
        """Record ``agent``'s ``answer`` to one of this round's requests."""
        ask = self._asks.get(agent)
        if ask is None or answer.request_id not in ask.requests or ask.answer is not None:
            return
        ask.reason = answer.reason
        if answer.accepted:
            ask.answer = True
        elif answer.deferred:
            ask.deferred = True
            ask.next_ask = time.monotonic() + self.retry_s
        else:
            ask.answer = False

    def report(self) -> ShutdownReport:
        """The round's outcome: each agent's final answer, or None and why there is none."""
        answers: dict[str, bool | None] = {}
        reasons: dict[str, str] = {}
        for agent, ask in self._asks.items():
            answers[agent] = ask.answer
            if ask.answer is not None:
                reasons[agent] = ask.reason
            elif ask.deferred:
                reasons[agent] = f"still deferring at the deadline: {ask.reason}"
            else:
                reasons[agent] = "no answer by the deadline"
        return ShutdownReport(answers, reasons)
