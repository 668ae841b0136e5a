"""The NATS store's key/value side: the team's bucket, keeping the roster, presence,
state and rates here, and the cursors and the one-consumer claims (`claims`). Presence,
claims, state versions and inbox starts are pushed to each process once it looks at
them often (`Keys`).
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from ralph_mail.errors import StoreError
from ralph_mail.store.base import check_key
from ralph_mail.store.nats.names import kv_key
from ralph_mail.store.nats.stream import APPEND_TRIES, EXPECTED, WATCH_AFTER, TeamStream
from ralph_mail.store.nats.wire import REQUEST_S

if TYPE_CHECKING:  # push (nats-py, asyncio) is imported when first needed
    from ralph_mail.store.nats.push import Keys


def start_of(raw: bytes | None) -> int | None:
    """An inbox's start (``base.<agent>``: where gc moved it up to), or None when there
    is none or it is of the wrong shape (then taken as 0: gc writes it again)."""
    if raw is None or not (raw.isascii() and raw.isdigit()) or len(raw) > 19:
        return None
    return int(raw)


class Bucket(TeamStream):
    """The team's key-value bucket (see the module docstring)."""

    def __init__(self, url: str, team: str, *, durable: bool = False) -> None:
        super().__init__(url, team, durable=durable)
        self._looks = 0  # keys looked up before the bucket's watch started (see _watched)
        self._watching = False
        self._cache: dict[str, tuple[bytes, int] | None] | None = None  # see _watched
        self._keys: Keys | None = None

    # -- the bucket, over the wire --------------------------------------------------------

    def _kv_get(self, key: str) -> bytes | None:
        return self._kv_entry(key)[0]

    def _kv_entry(self, key: str) -> tuple[bytes | None, int]:
        """``key``'s value and revision: None and the revision of its deletion when it
        was deleted, None and 0 when it never was."""
        got = self._api(f"STREAM.MSG.GET.KV_{self.stream}",
                        {"last_by_subj": f"$KV.{self.stream}.{key}"})  # fmt: skip
        if "error" in got:
            if got["error"].get("err_code") == 10037:  # no message: never set
                return None, 0
            raise StoreError(f"NATS {self.shown}: {got['error'].get('description', got)}")
        message = got["message"]
        marks = base64.b64decode(message.get("hdrs") or b"")
        if b"KV-Operation: DEL" in marks or b"KV-Operation: PURGE" in marks:
            return None, int(message["seq"])
        return base64.b64decode(message.get("data") or b""), int(message["seq"])

    def _kv_write(
        self, key: str, value: bytes, last: int | None = None, *, timeout: float = REQUEST_S
    ) -> int | None:
        """Put ``value`` (``last``: only over that revision; 0, only when ``key`` was
        never set); its revision, or None when ``last`` was not the last."""
        headers = {EXPECTED: str(last)} if last is not None else {}
        return self._kv_send(key, value, headers, timeout)

    def _kv_delete(self, key: str, *, timeout: float = REQUEST_S) -> None:
        self._kv_send(key, b"", {"KV-Operation": "DEL"}, timeout)
        if self._cache is not None:
            self._cache[key] = None

    def _kv_send(
        self, key: str, value: bytes, headers: dict[str, str], timeout: float
    ) -> int | None:
        ack = self._acked(f"$KV.{self.stream}.{key}", value, headers or None, timeout)
        return None if ack is None else int(ack["seq"])

    def _kv_put(self, key: str, value: bytes) -> None:
        revision = self._kv_write(key, value)
        assert revision is not None
        self._saw(key, value, revision)

    def _saw(self, key: str, value: bytes, revision: int) -> None:
        """Note my own write in the watch's cache at once: what this process wrote, it
        reads (the watch brings the same revision a moment later)."""
        if self._cache is not None:
            known = self._cache.get(key)
            if known is None or known[1] < revision:
                self._cache[key] = (value, revision)

    def _kv_update(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        """Replace ``key`` with ``change(value)``, retried until no other update came
        between the read and the write."""
        for _ in range(APPEND_TRIES):
            raw, revision = self._kv_entry(key)
            value = change(raw)
            written = self._kv_write(key, value, last=revision)
            if written is not None:
                self._saw(key, value, written)
                return
        raise StoreError(f"NATS {self.shown}: {key} kept changing under {APPEND_TRIES} updates")

    # -- the bucket's watch ---------------------------------------------------------------

    def _watched(self, key: str) -> tuple[bytes, int] | None:
        """``key``'s value and revision as a watch of the bucket has them (`Keys`): the
        server pushes every change, so presence, claims, state versions and an inbox's
        start cost no round trip (a change reaches this process within the server's
        delivery time). A short life (a command) never needs it: the watch is started
        at the `WATCH_AFTER`-th look, on a thread of its own (nats-py to import, a
        connection to make), and until it is ready each look asks the server."""
        if self._cache is None:
            self._looks += 1
            if self._looks >= WATCH_AFTER and not self._watching:
                self._watching = True
                threading.Thread(target=self._watch, name="ralph-nats-watch", daemon=True).start()
            raw, revision = self._kv_entry(key)
            return None if raw is None else (raw, revision)
        return self._cache.get(key)

    def _watch(self) -> None:
        from ralph_mail.store.nats.push import Keys

        with contextlib.suppress(StoreError):  # else looks go on asking the server
            keys = Keys(self._link, self.stream)
            self._run(keys.start())
            if keys.ready.wait(REQUEST_S) and not self._closed.is_set():
                self._keys, self._cache = keys, keys.values
            else:
                self._run(keys.stop())

    # -- the roster, presence -------------------------------------------------------------

    def roster(self) -> bytes:
        return self._kv_get("roster") or b""

    def update_roster(self, change: Callable[[bytes], bytes]) -> None:
        self._kv_update("roster", lambda raw: change(raw or b""))

    def save_presence(self, agent: str, record: bytes) -> None:
        self._kv_put(f"presence.{kv_key(agent)}", record)

    def load_presence(self, agent: str) -> bytes | None:
        return self._looked(f"presence.{kv_key(agent)}")

    def _looked(self, key: str) -> bytes | None:
        """``key``'s value from the watch, asked of the server when the watch has not
        heard of it (a watch can start a moment behind a write)."""
        found = self._watched(key)
        if found is None and self._keys is not None:
            return self._kv_get(key)
        return found[0] if found is not None else None

    # -- an inbox's start -----------------------------------------------------------------

    def _base(self, agent: str) -> int:
        return start_of(self._kv_get(f"base.{kv_key(agent)}")) or 0

    # -- state, rates ---------------------------------------------------------------------

    def load_state(self, key: str) -> bytes | None:
        check_key(key, "state key")
        return self._kv_get(f"state.{kv_key(key)}")

    def save_state(self, key: str, data: bytes) -> None:
        check_key(key, "state key")
        self._kv_put(f"state.{kv_key(key)}", data)

    def update_state(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        check_key(key, "state key")
        self._kv_update(f"state.{kv_key(key)}", change)

    def state_version(self, key: str) -> tuple[int, ...] | None:
        """From the bucket's watch (see `_watched`): no round trip."""
        check_key(key, "state key")
        found = self._watched(f"state.{kv_key(key)}")
        return None if found is None else (found[1],)

    def state_where(self, key: str) -> str:
        return f"{self.shown} bucket {self.stream} key state.{kv_key(key)}"

    def take(self, key: str, limit: int, window: float) -> float:
        wait = 0.0

        def change(raw: bytes | None) -> bytes:
            nonlocal wait
            now = time.time()
            times = [t for t in (orjson.loads(raw) if raw else []) if t > now - window]
            wait = 0.0
            if len(times) >= limit:
                wait = times[len(times) - limit] + window - now
                return orjson.dumps(times)
            return orjson.dumps([*times, now])

        self._kv_update(f"rate.{kv_key(key)}", change)
        return wait
