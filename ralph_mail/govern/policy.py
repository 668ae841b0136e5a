"""Who may contact whom, and how often: the team's policy (DESIGN §9.3-9.4).

A policy is a list of rules ``{from, to, permission: allow|deny, approval: bool}``, where
``from`` and ``to`` name a member or ``*``, and rates ``{agent or *: messages per minute}``.
It is kept through the storage seam (state key ``policy``; in the file backend,
``state/policy.json`` in the team's folder) and applies to contact an agent starts: a
send, a broadcast, an ask, a delegation, a post and its mentions. The Gate
(`ralph_mail.govern.gate`) asks it about everything but true answers (a reply, ack,
result or approval that answers what its sender received).

The decision for ``sender`` contacting ``target`` is OpenCompany's, in this order:

1. ``target`` is the sender's manager, or the sender is the target's manager: allowed,
   no approval (the hierarchy bypasses the rules and the ``supervised`` mode);
2. an explicit deny (a rule naming the target) → refused;
3. an explicit allow → allowed, held for approval if its ``approval`` flag says so;
4. a wildcard deny (``to: *``) → refused;
5. a wildcard allow → allowed, with its approval flag;
6. no rule → allowed.

A rule applies to the sender when its ``from`` names it or is ``*``; a rule naming the
sender wins over a ``*`` rule at the same step. On top, a sender in mode ``supervised``
needs approval for contact, and one in mode ``strict`` for everything it sends but acks,
task results and protocol messages (its replies too), even to its manager.

Budgets ``{agent or *: {"usd": AMOUNT, "per": "hour" | "day"}}`` cap what an agent's jobs
may cost in a rolling hour or day (`ralph_mail.govern.budget` enforces them).

A policy that cannot be read or parsed fails closed: every agent-initiated contact is
refused (`PermissionDenied`) naming the problem, never allowed.

Example:
    >>> policy = parse(b'{"rules": [{"from": "*", "to": "archive", "permission": "deny"}]}')
    >>> policy.rules[0].permission
    'deny'
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, Literal

from ralph_mail import codec
from ralph_mail.errors import InvalidMessage, MailError
from ralph_mail.message import check_name

if TYPE_CHECKING:
    from collections.abc import Callable

    from ralph_mail.mailbox import Mailbox
    from ralph_mail.store.base import TeamStore
    from ralph_mail.team import Team

#: The state key the policy is kept under.
KEY: Final = "policy"
#: A policy bigger than this is refused unread: it is not one a person wrote.
MAX_BYTES: Final = 1024 * 1024
#: The highest rate a policy may set (messages per minute); above it, set none.
MAX_RATE: Final = 100_000
#: The rolling window of a rate limit (s).
RATE_WINDOW_S: Final = 60.0
_RULE_KEYS: Final = frozenset({"from", "to", "permission", "approval"})
_TOP_KEYS: Final = frozenset({"version", "rules", "rates", "budgets", "require_signed"})
#: The largest budget a policy may set (USD), and each window's length (s).
MAX_BUDGET_USD: Final = 1_000_000.0
WINDOWS: Final = {"hour": 3600.0, "day": 86400.0}

Verdict = Literal["allow", "hold", "deny"]


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: may ``sender`` (a name or ``*``) contact ``target`` (a name or ``*``)."""

    sender: str
    target: str
    permission: Literal["allow", "deny"]
    approval: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"from": self.sender, "to": self.target, "permission": self.permission,
                "approval": self.approval}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Budget:
    """What an agent's jobs may cost: ``usd`` (US dollars) per rolling ``per`` (``hour``
    or ``day``)."""

    usd: float
    per: Literal["hour", "day"]

    @property
    def window_s(self) -> float:
        return WINDOWS[self.per]

    def to_dict(self) -> dict[str, Any]:
        return {"usd": self.usd, "per": self.per}


@dataclass(frozen=True, slots=True)
class Decision:
    """What the policy says of one message: ``verdict`` and, unless allowed, why."""

    verdict: Verdict
    reason: str = ""


_ALLOW: Final = Decision("allow")


@dataclass(frozen=True)
class Policy:
    """A team's rules and rates. Build with `parse`; `decide` answers one contact."""

    rules: tuple[Rule, ...] = ()
    rates: dict[str, int] = field(default_factory=dict)
    budgets: dict[str, Budget] = field(default_factory=dict)
    #: Every message must be signed by its sender's roster key (`ralph_mail.signing`):
    #: the writer's Gate refuses any other, and readers set it aside.
    require_signed: bool = False

    def __post_init__(self) -> None:
        # (sender, target) -> the rules for it, so a decision costs a few dict lookups
        # however many rules there are.
        index: dict[tuple[str, str], list[Rule]] = {}
        for rule in self.rules:
            index.setdefault((rule.sender, rule.target), []).append(rule)
        object.__setattr__(self, "_index", index)

    def rate_of(self, sender: str) -> int | None:
        """Messages per minute ``sender`` may start, or None: no limit."""
        return self.rates.get(sender, self.rates.get("*"))

    def budget_of(self, agent: str) -> Budget | None:
        """What ``agent``'s jobs may cost, or None: no limit."""
        return self.budgets.get(agent, self.budgets.get("*"))

    def decide(self, team: Team, sender: str, target: str, *, reply: bool = False) -> Decision:
        """The verdict for ``sender`` contacting ``target`` (``reply``: answering it)."""
        me = team.member(sender)
        if me.mode == "strict":
            return Decision("hold", f"{sender} is in strict mode: everything it sends is approved")
        if reply or (not self.rules and me.mode == "autonomous"):
            return _ALLOW
        if target == me.manager or team.member(target).manager == sender:
            return _ALLOW
        decision = self._rules(sender, target)
        if decision.verdict == "allow" and me.mode == "supervised":
            return Decision("hold", f"{sender} is supervised: its contact is approved")
        return decision

    def _rules(self, sender: str, target: str) -> Decision:
        index: dict[tuple[str, str], list[Rule]] = self._index  # type: ignore[attr-defined]
        for to in (target, "*"):
            kind = "explicit" if to != "*" else "wildcard"
            mine, everyone = index.get((sender, to), []), index.get(("*", to), [])
            for permission in ("deny", "allow"):
                found = [r for r in mine if r.permission == permission] or [
                    r for r in everyone if r.permission == permission
                ]
                if not found:
                    continue
                rule = found[0]
                said = f"{kind} rule {rule.sender} -> {rule.target}: {permission}"
                if permission == "deny":
                    return Decision("deny", f"{sender} may not contact {target} ({said})")
                if any(r.approval for r in found):
                    return Decision("hold", f"{said} with approval")
                return _ALLOW
        return _ALLOW

    def to_json(self) -> bytes:
        """The policy as it is saved."""
        document: dict[str, Any] = {"version": 1, "rules": [r.to_dict() for r in self.rules],
                                    "rates": dict(sorted(self.rates.items()))}  # fmt: skip
        if self.budgets:
            document["budgets"] = {k: v.to_dict() for k, v in sorted(self.budgets.items())}
        if self.require_signed:
            document["require_signed"] = True
        return codec.dumps_indented(document, newline=True)

    def with_rule(self, rule: Rule) -> Policy:
        """This policy with ``rule`` in place of any rule for the same sender and target."""
        kept = [r for r in self.rules if (r.sender, r.target) != (rule.sender, rule.target)]
        return replace(self, rules=(*kept, rule))

    def with_rate(self, sender: str, per_minute: int | None) -> Policy:
        """This policy with ``sender``'s rate set (None: removed)."""
        rates = {k: v for k, v in self.rates.items() if k != sender}
        if per_minute is not None:
            rates[sender] = per_minute
        return replace(self, rates=rates)

    def with_budget(self, agent: str, budget: Budget | None) -> Policy:
        """This policy with ``agent``'s budget set (None: removed)."""
        budgets = {k: v for k, v in self.budgets.items() if k != agent}
        if budget is not None:
            budgets[agent] = budget
        return replace(self, budgets=budgets)


def reach(policy: Policy, team: Team, *, answers: bool = False) -> dict[str, set[str]]:
    """For each member, the members whose inboxes it may write to under ``policy`` (what
    a server enforcing it lets through, ``ralph-mail nats config``): itself, those it may
    contact (allowed, or held for approval), and, as it releases what it approves,
    those its direct reports may contact. With ``answers``, also those that may contact
    it: its replies, acks and task results then reach them, and a deny rule holds on
    the server one way only (the Gate still refuses the contact it forbids)."""
    names = team.names
    may = {a: {t for t in names if policy.decide(team, a, t).verdict != "deny"} | {a}
           for a in names}  # fmt: skip
    found = {a: set(may[a]) for a in names}
    for agent in names:
        manager = team.member(agent).manager
        if manager in found:
            found[manager] |= may[agent]
    if answers:
        for agent in names:
            found[agent] |= {other for other in names if agent in may[other]}
    return found


def change(store: TeamStore, edit: Callable[[Policy], Policy]) -> Policy:
    """Replace the policy kept in ``store`` with ``edit(policy)``, with no other change
    in between; return it. A broken policy is not edited: `InvalidMessage` naming it
    (remove it, or fix it by hand)."""
    done: list[Policy] = []

    def apply(raw: bytes | None) -> bytes:
        try:
            current = Policy() if raw is None else parse(raw)
        except InvalidMessage as exc:
            raise InvalidMessage(
                f"the team's policy {store.state_where(KEY)} is broken ({exc}): no agent "
                "may start contact until it is fixed or removed"
            ) from None
        done.append(edit(current))
        return done[-1].to_json()

    store.update_state(KEY, apply)
    return done[-1]


def set_member(
    box: Mailbox, agent: str, description: str | None, manager: str | None, mode: str | None
) -> Team:
    """`MessageBus.set_member`: change a member's roster entry; a manager, a mode or
    another member's description is the lead's to change."""
    from ralph_mail.team import change_roster

    if manager is not None or mode is not None:
        box.gate.require_lead("changing a member's manager or mode")
    elif agent != box.agent:
        box.gate.require_lead("changing another member's description")
    change_roster(box.refresh_team(), member=agent, description=description,
                  manager=manager, mode=mode)  # fmt: skip
    return box.refresh_team()


def parse(raw: bytes) -> Policy:
    """The policy in ``raw``; `InvalidMessage` naming the first problem otherwise."""
    if len(raw) > MAX_BYTES:
        raise InvalidMessage(f"it is {len(raw):,} bytes, over {MAX_BYTES:,}")
    try:
        document = codec.loads(raw)
    except codec.DecodeError as exc:
        raise InvalidMessage(f"it is not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise InvalidMessage("it is not a JSON object")
    unknown = sorted(set(document) - _TOP_KEYS)
    if unknown:
        raise InvalidMessage(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(_TOP_KEYS))})")
    if document.get("version", 1) != 1:
        raise InvalidMessage(f"unknown version {document['version']!r} (this is 1)")
    rules = document.get("rules", [])
    if not isinstance(rules, list):
        raise InvalidMessage("rules is not a list")
    rates = document.get("rates", {})
    if not isinstance(rates, dict):
        raise InvalidMessage("rates is not an object")
    budgets = document.get("budgets", {})
    if not isinstance(budgets, dict):
        raise InvalidMessage("budgets is not an object")
    require_signed = document.get("require_signed", False)
    if not isinstance(require_signed, bool):
        raise InvalidMessage(f"require_signed is {require_signed!r}: true or false")
    return Policy(
        tuple(_rule(item, n) for n, item in enumerate(rules)),
        {_party(k, "rates key"): check_rate(v) for k, v in rates.items()},
        {_party(k, "budgets key"): _budget(v, k) for k, v in budgets.items()},
        require_signed,
    )


def requires_signed(store: TeamStore) -> bool:
    """Whether ``store``'s team requires signed messages (a policy that cannot be read
    does not: see `Gate.requires_signed`)."""
    try:
        raw = store.load_state(KEY)
        return raw is not None and parse(raw).require_signed
    except MailError:
        return False


def _budget(item: object, who: str) -> Budget:
    if not isinstance(item, dict) or set(item) != {"usd", "per"}:
        raise InvalidMessage(f"the budget of {who} is not an object of usd and per")
    per = item["per"]
    if per not in WINDOWS:
        raise InvalidMessage(f"the budget of {who}: per {per!r} is not hour or day")
    return Budget(check_budget(item["usd"]), per)


def check_budget(value: object) -> float:
    """A budget: US dollars, more than 0 and at most `MAX_BUDGET_USD`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (0 < value <= MAX_BUDGET_USD)
    ):
        raise InvalidMessage(
            f"invalid budget {value!r}: give US dollars above 0 and at most "
            f"{MAX_BUDGET_USD:,.0f}, e.g. 5 or 0.50"
        )
    return float(value)


def _rule(item: object, n: int) -> Rule:
    if not isinstance(item, dict):
        raise InvalidMessage(f"rule {n} is not an object")
    unknown = sorted(set(item) - _RULE_KEYS)
    if unknown:
        raise InvalidMessage(f"rule {n} has an unknown key {unknown[0]!r}")
    permission = item.get("permission")
    if permission not in ("allow", "deny"):
        raise InvalidMessage(f"rule {n}: permission {permission!r} is not allow or deny")
    approval = item.get("approval", False)
    if not isinstance(approval, bool):
        raise InvalidMessage(f"rule {n}: approval {approval!r} is not true or false")
    return Rule(_party(item.get("from"), f"rule {n} from"), _party(item.get("to"), f"rule {n} to"),
                permission, approval)  # fmt: skip


def _party(value: object, what: str) -> str:
    return "*" if value == "*" else check_name(value, what)


def check_rate(value: object) -> int:
    """A rate: a whole number of messages per minute, from 1 to `MAX_RATE`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RATE:
        raise InvalidMessage(
            f"invalid rate {value!r}: give a whole number of messages from 1 to {MAX_RATE:,}"
        )
    return value
