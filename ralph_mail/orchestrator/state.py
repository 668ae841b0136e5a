"""The lead's persisted state: what `TeamOrchestrator` saves through the store and
loads at its start, and what views that only look (``ralph-mail top``) read of it.

One record per lead, under the store key ``orchestrator.<lead>``: the recently handled
message keys (so a redelivered message is a no-op), the derived ids of the replies sent
with where the recipient's inbox ended before each (so a reply is never sent twice), and
the agents' progress. The store replaces it atomically.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from ralph_mail.errors import StoreError
from ralph_mail.orchestrator.records import AgentProgress
from ralph_mail.settings import HANDLED_IDS_KEPT
from ralph_mail.store.base import TeamStore

_STATE_VERSION = 2


def state_key(lead: str) -> str:
    """The store key of the lead ``lead``'s state."""
    return f"orchestrator.{lead}"


@dataclass(frozen=True, slots=True)
class SavedState:
    """What a lead saved, as it loads back.

    Attributes:
        handled: the "sender:id" keys of the messages handled, oldest first.
        sent: derived reply id -> the recipient's inbox size before it was sent.
        progress: agent -> what the lead knew of it.
    """

    handled: dict[str, None]
    sent: dict[str, int]
    progress: dict[str, AgentProgress]


def save_state(
    store: TeamStore,
    key: str,
    handled: Iterable[str],
    sent: Mapping[str, int],
    progress: Mapping[str, AgentProgress],
) -> None:
    """Replace the state under ``key``; a `MailError` when the store cannot."""
    state = {
        "version": _STATE_VERSION,
        "handled": list(handled),
        "sent": [[reply_id, since] for reply_id, since in sent.items()],
        "progress": {name: asdict(item) for name, item in progress.items()},
    }
    store.save_state(key, orjson.dumps(state))


def load_state(store: TeamStore, key: str) -> SavedState | None:
    """The state under ``key`` (its newest `HANDLED_IDS_KEPT` ids), or None if there is
    none; `StoreError` saying how to start afresh when it is damaged."""
    raw = store.load_state(key)
    if raw is None:
        return None
    try:
        state: Any = orjson.loads(raw)
        handled = [str(item) for item in state["handled"]]
        sent = [(str(item[0]), int(item[1])) for item in state.get("sent", [])]
        progress = {name: AgentProgress(**item) for name, item in state["progress"].items()}
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise StoreError(
            f"the lead's state {key!r} is damaged ({exc}): delete "
            f"state/{key}.json in the team to start afresh (messages still "
            "unread will be answered again)"
        ) from None
    return SavedState(
        dict.fromkeys(handled[-HANDLED_IDS_KEPT:]), dict(sent[-HANDLED_IDS_KEPT:]), progress
    )


def saved_progress(store: TeamStore, lead: str) -> dict[str, AgentProgress]:
    """What the lead ``lead`` last saved about each teammate (empty when it never ran or
    its state is unreadable): for views that only look, such as ``ralph-mail top``."""
    raw = store.load_state(state_key(lead))
    try:
        state: Any = orjson.loads(raw) if raw else {}
        return {name: AgentProgress(**item) for name, item in state.get("progress", {}).items()}
    except (orjson.JSONDecodeError, TypeError, AttributeError, ValueError):
        return {}
