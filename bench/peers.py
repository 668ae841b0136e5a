"""The peer queues people would otherwise pick, each opened with its default settings.

They live in the ``bench`` extra, never in the runtime dependencies. A peer that is
not installed yields a row saying so; nothing here may crash the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.common import optional_module

Put = Callable[[dict[str, Any]], object]
Opened = tuple[Put, Callable[[], None]]


@dataclass(frozen=True, slots=True)
class Peer:
    """One peer store: ``key`` for the JSON, ``label`` for people, the ``module`` to
    import, and ``open`` which makes a store in a directory and returns (put, close).
    """

    key: str
    label: str
    module: str
    open: Callable[[Any, Path], Opened]


def _sqlitequeue(mod: Any, path: Path) -> Opened:
    q = mod.SQLiteQueue(str(path), auto_commit=True, multithreading=False)
    return q.put, q.close


def _litequeue(mod: Any, path: Path) -> Opened:
    q = mod.LiteQueue(str(path / "queue.sqlite3"))

    def put(msg: dict[str, Any]) -> object:
        return q.put(orjson.dumps(msg).decode())  # litequeue stores strings only

    return put, q.close


def _diskcache_deque(mod: Any, path: Path) -> Opened:
    d = mod.Deque(directory=str(path))
    return d.append, d.cache.close


PEERS: tuple[Peer, ...] = (
    Peer("persistqueue_sqlite", "persist-queue SQLiteQueue.put", "persistqueue", _sqlitequeue),
    Peer("litequeue", "litequeue LiteQueue.put", "litequeue", _litequeue),
    Peer("diskcache_deque", "diskcache Deque.append", "diskcache", _diskcache_deque),
)


def open_peer(peer: Peer, path: Path) -> Opened | str:
    """Open ``peer`` in ``path``, or return why it cannot be ("not installed: …")."""
    mod = optional_module(peer.module)
    if isinstance(mod, str):
        return mod
    return peer.open(mod, path)
