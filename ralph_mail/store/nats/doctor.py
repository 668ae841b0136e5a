"""What ``ralph-mail doctor`` checks of one team on a NATS server, beside its stream
(`NatsBackend.health`): the keys of its bucket the store reads (cursors, claims, inbox
starts) have the shape it writes; no log ends in messages published by anything but the
store (the next read sets them aside); which logs have dead letters. Nothing is changed.
"""

from __future__ import annotations

from collections.abc import Iterator

from ralph_mail.store.nats.bucket import start_of
from ralph_mail.store.nats.claims import cursor_of, holder_of
from ralph_mail.store.nats.logs import placed
from ralph_mail.store.nats.names import untoken
from ralph_mail.store.nats.stream import TeamStream
from ralph_mail.store.nats.team import NatsStore

#: ``(level, message)``: what `NatsBackend.health` makes a `Finding` of.
Found = tuple[str, str]


def team_findings(store: NatsStore) -> list[Found]:
    """Every problem of team ``store.team`` that the store would meet (see the module
    docstring); one ``ok`` line when there is none."""
    found = [*_keys(store), *_logs(store)]
    if not any(level != "ok" for level, _ in found):
        found.append(("ok", f"team {store.team!r}: its bucket's keys and its logs are whole"))
    return found


def _keys(store: NatsStore) -> Iterator[Found]:
    for key, raw in _bucket(store, "cursor"):
        cursor = cursor_of(raw)
        if cursor is None:
            yield ("fail", f"team {store.team!r}: the cursor {key} is damaged ({raw[:60]!r}): "
                   f"its owner cannot read; delete it ('nats kv del {store.stream} {key}') "
                   "to read its inbox again from "
                   "its start")  # fmt: skip
            continue
        owner = _named(key[len("cursor.") :])
        if cursor[0].floor > store.size(owner.partition("@")[0]):
            yield ("warn", f"team {store.team!r}: the cursor {key} ({cursor[0].floor}) is past "
                   "the end of its log (made again since?): its owner reads it again from "
                   "its start")  # fmt: skip
    for key, raw in _bucket(store, "claim"):
        if holder_of(raw) is None:
            yield ("warn", f"team {store.team!r}: the claim {key} is damaged ({raw[:60]!r}): "
                   "it counts as lapsed, and the next consumer takes it over")  # fmt: skip
    for key, raw in _bucket(store, "base"):
        if start_of(raw) is None:
            yield ("warn", f"team {store.team!r}: the inbox start {key} is damaged "
                   f"({raw[:60]!r}): it counts as 0 until gc writes it again")  # fmt: skip


def _bucket(store: NatsStore, kind: str) -> Iterator[tuple[str, bytes]]:
    """Every key of ``kind`` (``cursor``...) in the team's bucket and its value (those
    deleted left out): the keys listed, then each read."""
    prefix = f"$KV.{store.stream}."
    info = store._api(f"STREAM.INFO.KV_{store.stream}", {"subjects_filter": f"{prefix}{kind}.>"})
    for subject in sorted(info.get("state", {}).get("subjects") or {}):
        key = subject[len(prefix) :]
        raw = store._kv_get(key)
        if raw is not None:
            yield key, raw


def _logs(store: NatsStore) -> Iterator[Found]:
    """Logs ending in messages published by anything but the store, and dead letters."""
    info = store._api(f"STREAM.INFO.{store.stream}", {"subjects_filter": f"{store._prefix}.>"})
    subjects = info.get("state", {}).get("subjects") or {}
    for subject in sorted(subjects):
        tail = subject[len(store._prefix) + 1 :]
        kind, _, name = tail.partition(".")
        if kind == "tl" and name.startswith("dead."):
            what = _named(name[len("dead.") :])
            yield ("warn", f"team {store.team!r}: {subjects[subject]} dead letter(s) of "
                   f"{what!r} (lines set aside): bus.store.dead_letters({what!r}) lists "
                   "them")  # fmt: skip
        elif kind in ("in", "ch", "tl"):
            last = TeamStream._get(store, subject)  # (not the store's own: it sets aside)
            if last is not None and not placed(last):
                yield ("warn", f"team {store.team!r}: the log {untoken(name)!r} ({kind}) ends "
                       "in a message published without the store's headers (a raw 'nats "
                       "pub'?): the next read sets it aside as a dead letter")  # fmt: skip


def _named(key: str) -> str:
    """The name `kv_key` made ``key`` of."""
    return bytes.fromhex(key[1:]).decode() if key.startswith("x") else key
