"""Budgets: what an agent's jobs may cost in a rolling hour or day (``policy budget``).

What the jobs cost is what ``ralph-mail run`` recorded of them (`ralph_mail.usage`).
Once an agent's spend in its window reaches its budget, the Gate refuses the contact it
starts (`BudgetExceeded`, exit 4) and ``ralph-mail run`` answers each new request with
that error instead of running its command, until enough of the spend has left the window
(the error says when, to the minute). Jobs already running finish: a budget can be
overshot by what runs at once.

The lead is told once per exhaustion, by a ``budget_exceeded`` message from the agent
(the Gate's own message, as an approval request is): when a job's cost reaches the
budget, or when the budget is first found reached. State ``budget.AGENT`` keeps until
when the lead knows, so that many refusals make one message.

Example:
    >>> check(box, policy)    # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

from ralph_mail import usage
from ralph_mail.errors import BudgetExceeded, MailError

if TYPE_CHECKING:
    from ralph_mail.govern.policy import Budget, Policy
    from ralph_mail.mailbox import Mailbox
    from ralph_mail.store.base import TeamStore

#: The type of the message that tells the lead.
KIND: Final = "budget_exceeded"
#: State: until when the lead knows an agent's budget is spent.
_TOLD: Final = "budget."


def _minute_ts(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def exhausted(
    store: TeamStore, agent: str, budget: Budget, now: float | None = None
) -> tuple[int, str] | None:
    """What ``agent`` spent in ``budget``'s window (millionths of a dollar) and until
    when it stays at or over the budget, when it is; None while it is under."""
    now = time.time() if now is None else now
    spent, minutes = usage.spend_in(store, agent, budget.window_s, now)
    limit = round(budget.usd * 1_000_000)
    if spent < limit:
        return None
    span = int(budget.window_s // 60)
    left = spent
    for minute, cost in minutes:  # the oldest spend leaves the window first
        left -= cost
        if left < limit:
            return spent, _minute_ts((minute + span) * 60)
    return spent, _minute_ts(now + budget.window_s)  # (never: limit is above 0)


def check(box: Mailbox, policy: Policy, now: float | None = None) -> None:
    """`BudgetExceeded` when ``box``'s agent has spent its budget (the lead is told
    first, once); nothing when it has none or is under it."""
    agent = box.agent
    budget = policy.budget_of(agent)
    if budget is None:
        return
    found = exhausted(box.store, agent, budget, now)
    if found is None:
        return
    spent, until = found
    _tell_lead(box, budget, spent, until, now)
    raise BudgetExceeded(
        f"budget exhausted until {until}: {agent} spent ${usage.usd(spent / 1e6)} of its "
        f"${usage.usd(budget.usd)} per {budget.per} (see 'ralph-mail usage'); the lead can "
        f"raise it: ralph-mail policy budget {agent} AMOUNT --per {budget.per}",
        agent,
        until,
    )


def _tell_lead(box: Mailbox, budget: Budget, spent: int, until: str, now: float | None) -> None:
    """Send the lead a ``budget_exceeded`` message, unless it was told of this exhaustion
    already (best effort: a store failing here must not hide the refusal)."""
    now_ts = _minute_ts(time.time() if now is None else now)
    told: list[bool] = []

    def mark(raw: bytes | None) -> bytes:
        if raw is not None and raw.decode("utf-8", "replace") > now_ts:
            return raw  # the lead knows until a later time: nothing new to say
        told.append(True)
        return until.encode()

    try:
        box.store.update_state(f"{_TOLD}{box.agent}", mark)
        if not told:
            return
        lead, agent = box.team.lead, box.agent
        text = (f"{agent} spent ${usage.usd(spent / 1e6)} of its ${usage.usd(budget.usd)} "
                f"per {budget.per}: its runs answer with an error and its contact is refused "
                f"until {until}")  # fmt: skip
        metadata = {"agent": agent, "spent_usd": usage.usd(spent / 1e6), "per": budget.per,
                    "budget_usd": usage.usd(budget.usd), "until": until}  # fmt: skip
        box._deliver(box.envelope(lead, KIND, text, metadata))
    except MailError:
        pass
