"""The NATS store's one consumer per inbox: the claim, a lease in the team's bucket, and
the owner's cursor beside it, both fenced.

A claim (``claim.<agent>``) names its holder (pid and host) and lasts `lease_s`
seconds; its holder renews it every third of that, so a consumer killed -9 is released
within the lease (on files, at once). A holder that went quiet past its lease (stopped
with SIGSTOP, a long GC pause, a laptop lid closed) may find its claim taken by a
successor that has since delivered the same messages: it must neither hand them out
again nor move the cursor. So:

* before a read hands lines to the owner (`hold`), a claim last confirmed more than half
  a lease ago is confirmed again (its key looked at, then renewed over its revision:
  two round trips; see `_confirm`);
* a cursor (``cursor.<agent>``) is written over the revision its holder last saw, and a
  new holder writes it once when it claims: a cursor write by a holder that lost its
  claim meets a revision it did not see, and fails.

Either way the fenced holder gets `ClaimLost`, never the messages it reads after.

A commit sends its cursor and goes on: its answer is read with the next thing the
thread asks of the server (`Wire.send`), and looked at before the holder's next read,
its next commit, a look at its cursor or its release (`settle_cursor`). So a commit
costs no round trip of its own, and the message just consumed reaches its consumer
(returned, printed, answered) while the cursor is stored. A write that was refused
over another's revision is a claim lost, said then (the lines read before it were
delivered once already); one whose answer did not come (the connection broke) is made
again, waited for. A crash leaves the cursor before the commit or after it. A key of
the wrong shape (written by hand) is a damaged cursor (refused, in one line, with its
fix) or a lapsed claim (taken over).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import warnings
from typing import Any, NamedTuple

import orjson

from ralph_mail.errors import ClaimLost, InboxBusy, MailError, StoreError
from ralph_mail.store.base import Cursor
from ralph_mail.store.nats.bucket import Bucket
from ralph_mail.store.nats.names import kv_key
from ralph_mail.store.nats.stream import EXPECTED, lease_s
from ralph_mail.store.nats.wire import REQUEST_S, Wire

#: Tries of a cursor write that meets another store of this process (see `save_cursor`).
_CURSOR_TRIES = 100
_HOST = socket.gethostname()


def _half_lease_on() -> float:
    """Half a lease from now (monotonic): how long a claim confirmed now is sure."""
    return time.monotonic() + lease_s() / 2


class _Sent(NamedTuple):
    """A cursor write whose answer is read later (see the module docstring)."""

    wire: Wire  # the connection it went over (its thread's)
    reply: bytes  # where its answer comes
    value: bytes  # what it wrote


def whole(value: object) -> bool:
    """Whether ``value`` (from JSON) is a whole number >= 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def record_of(raw: bytes | None) -> dict[str, Any] | None:
    """A key's JSON object, or None when it holds anything else."""
    if raw is None:
        return None
    try:
        found = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None


def cursor_of(raw: bytes) -> tuple[Cursor, int] | None:
    """A stored cursor and the stream sequence of its floor (0: unknown); None when the
    record is of the wrong shape."""
    saved = record_of(raw)
    if saved is None or not whole(saved.get("floor")):
        return None
    acked, seq = saved.get("acked", []), saved.get("seq", 0)
    if not isinstance(acked, list) or not all(map(whole, acked)) or not whole(seq):
        return None
    return Cursor(saved["floor"], set(acked)), seq


def holder_of(raw: bytes | None) -> tuple[int, str, float] | None:
    """A claim's (pid, host, until); None when there is none, or of the wrong shape (a
    lease no one can be said to hold: lapsed)."""
    saved = record_of(raw)
    if saved is None:
        return None
    pid, host, until = saved.get("pid"), saved.get("host"), saved.get("until")
    if not isinstance(pid, int) or not whole(pid) or not isinstance(host, str):
        return None
    if not isinstance(until, (int, float)) or isinstance(until, bool):
        return None
    return pid, host, float(until)


class Claims(Bucket):
    """Claims and cursors (see the module docstring)."""

    def __init__(self, url: str, team: str, *, durable: bool = False) -> None:
        super().__init__(url, team, durable=durable)
        self._claims: dict[str, int] = {}  # agent -> revision of my claim
        self._sure_until: dict[str, float] = {}  # agent -> half a lease after its last
        # confirmation (monotonic): until then, a claim needs no look (see `hold`)
        self._lost: dict[str, str] = {}  # agent -> why my claim is gone to another
        self._cursors: dict[str, int] = {}  # agent (claimed) -> its cursor's revision
        self._stamped: dict[str, Cursor] = {}  # agent -> the cursor its claim read
        self._sent: dict[str, _Sent] = {}  # agent -> its cursor write not yet answered
        self._claim_lock = threading.RLock()
        self._renewer: threading.Thread | None = None

    # -- cursors --------------------------------------------------------------------------

    def load_cursor(self, agent: str) -> Cursor:
        stamped = self._stamped.pop(agent, None)
        if stamped is not None:
            return stamped
        self.settle_cursor(agent)
        return self._cursor_entry(agent)[0]

    def _cursor_entry(self, agent: str) -> tuple[Cursor, int]:
        """The stored cursor and its revision; a damaged one refused in one line."""
        key = f"cursor.{kv_key(agent)}"
        raw, revision = self._kv_entry(key)
        if raw is None:
            return Cursor(0), revision
        found = cursor_of(raw)
        if found is None:
            raise StoreError(
                f"the cursor of {agent!r} ({self.shown} bucket {self.stream} key {key}) is "
                f"damaged ({raw[:60]!r}): delete it ('nats kv del {self.stream} {key}') to "
                "read the inbox again from its start"
            )
        cursor, seq = found
        if seq:
            self._remember(self._subject(agent.partition("@")[0]), cursor.floor, seq)
        return cursor, revision

    def save_cursor(self, agent: str, cursor: Cursor) -> None:
        subject = self._subject(agent.partition("@")[0])
        seq = self._seqs.get(subject, {}).get(cursor.floor, 0)
        record = {"floor": cursor.floor, "acked": sorted(cursor.acked), "seq": seq}
        key = f"cursor.{kv_key(agent)}"
        if agent not in self._claims and agent not in self._lost:
            self._kv_write(key, orjson.dumps(record))  # no claim to fence: a channel's
            return
        self.hold(agent)
        self._stamped.pop(agent, None)  # (what the claim read is no longer the cursor)
        record["by"] = self._by()
        value = orjson.dumps(record)
        with self._claim_lock:
            last = self._cursors.get(agent, 0)
        where, over = f"$KV.{self.stream}.{key}", {EXPECTED: str(last)}
        reply = self._on_wire(lambda wire: wire.send(where, value, over), REQUEST_S)
        self._sent[agent] = _Sent(Wire.for_thread(self.url), reply, value)

    def settle_cursor(self, agent: str) -> None:
        """Look at the answer to ``agent``'s cursor write still unanswered, if one:
        `ClaimLost` when another consumer's revision refused it; made again, waited
        for, when its answer did not come (see the module docstring)."""
        sent = self._sent.pop(agent, None)
        if sent is None or agent in self._lost:  # (a claim lost: its answer is no news)
            return
        if sent.wire is Wire.for_thread(self.url):
            try:
                answer = sent.wire.answer(sent.reply)
                ack = orjson.loads(answer.data) if answer.status is None else {}
            except (OSError, orjson.JSONDecodeError):
                ack = {}  # (no answer: the write is made again below)
            if "seq" in ack and "error" not in ack:
                with self._claim_lock:
                    self._cursors[agent] = int(ack["seq"])
                return
        self._write_cursor(agent, f"cursor.{kv_key(agent)}", sent.value)

    def _write_cursor(self, agent: str, key: str, value: bytes) -> None:
        """Write the cursor ``value`` over the revision this holder last saw, waited for;
        `ClaimLost` when another consumer moved it."""
        for _ in range(_CURSOR_TRIES):
            with self._claim_lock:
                last = self._cursors.get(agent, 0)
            written = self._kv_write(key, value, last=last)
            if written is not None:
                with self._claim_lock:
                    self._cursors[agent] = written
                return
            # Another revision: my successor's (fenced), or another store of mine.
            raw, revision = self._kv_entry(key)
            if (record_of(raw) or {}).get("by") != self._by():
                raise self._lose(agent, "its cursor was moved by another consumer")
            with self._claim_lock:
                self._cursors[agent] = revision
        raise StoreError(f"NATS {self.shown}: {key} kept changing under {_CURSOR_TRIES} writes")

    def drop_cursor(self, key: str) -> None:
        self._kv_delete(f"cursor.{kv_key(key)}")

    @property
    def _me(self) -> tuple[int, str]:
        """Who holds a claim of this process's: its pid (a forked child is another) and
        host."""
        return os.getpid(), _HOST

    def _by(self) -> str:
        return f"{self._me[1]}:{self._me[0]}"

    # -- claims ---------------------------------------------------------------------------

    def claim(self, agent: str) -> None:
        if agent in self._claims:
            if agent not in self._cursors:  # (claimed, but its cursor not yet written)
                self._stamp(agent)
            return
        key = f"claim.{kv_key(agent)}"
        for _ in range(3):
            raw, revision = self._kv_entry(key)
            holder = holder_of(raw)
            if holder is not None and holder[2] > time.time() and holder[:2] != self._me:
                raise InboxBusy(
                    f"the inbox of {agent!r} is consumed by pid {holder[0]} on "
                    f"{holder[1]}: stop it first (its claim lapses {lease_s():g} s "
                    "after it dies)",
                    holder[0],
                )
            value = self._lease()
            taken = self._kv_write(key, value, last=revision)
            if taken is None:  # another process took it meanwhile (look again), or not
                raw, now = self._kv_entry(key)
                if now == revision:  # no one wrote it: the server did not take the write
                    raise StoreError(self._unavailable("the claim could not be written"))
                now_held = holder_of(raw)
                if now_held is None or now_held[:2] != self._me:
                    continue
                taken = now  # (a try of mine whose answer was lost)
            with self._claim_lock:
                self._claims[agent], self._sure_until[agent] = taken, _half_lease_on()
                self._lost.pop(agent, None)
            self._saw(key, value, taken)
            self._stamp(agent)
            self._renew()
            return
        raise InboxBusy(f"the inbox of {agent!r} is being claimed by another process")

    def _stamp(self, agent: str) -> None:
        """Write the cursor once as its new holder: a cursor write of a holder before
        me now meets a revision it did not see (see the module docstring)."""
        key = f"cursor.{kv_key(agent)}"
        for _ in range(3):  # (the holder before me may write it meanwhile: read it again)
            cursor, revision = self._cursor_entry(agent)
            record = {"floor": cursor.floor, "acked": sorted(cursor.acked), "by": self._by()}
            written = self._kv_write(key, orjson.dumps(record), last=revision)
            if written is not None:
                with self._claim_lock:
                    self._cursors[agent] = written
                self._stamped[agent] = cursor
                return
        raise StoreError(self._unavailable("the cursor could not be written"))

    def _lease(self) -> bytes:
        return orjson.dumps({"pid": self._me[0], "host": self._me[1],
                             "until": time.time() + lease_s()})  # fmt: skip

    def hold(self, agent: str) -> None:
        """Make sure this store still holds ``agent``'s claim before it hands out lines
        or moves the cursor: at once while it was confirmed within half a lease; else
        renewed now (a round trip). `ClaimLost` when another process took it over (or
        refused the last cursor write, `settle_cursor`)."""
        self.settle_cursor(agent)
        with self._claim_lock:
            lost = self._lost.get(agent)
            if lost is not None:
                raise ClaimLost(lost)
            if agent not in self._claims:
                return
            if time.monotonic() < self._sure_until[agent]:
                return
        if not self._confirm(agent):
            raise ClaimLost(self._lost[agent])

    def _confirm(self, agent: str) -> bool:
        """Renew my claim, once the key still names me, over the revision it has; False
        when another process holds it now (it is then lost). Called by `hold` and the
        renewing thread. The look comes first: a revision alone is no proof, since a
        team deleted and made again numbers its writes from 1 again, and a stale
        holder's revision can be that of another's claim."""
        key = f"claim.{kv_key(agent)}"
        with self._claim_lock:
            if agent not in self._claims:
                return agent not in self._lost
        renewed = None
        for _ in range(2):  # (a write between my look and mine: look again)
            raw, revision = self._kv_entry(key)
            holder = holder_of(raw)
            if holder is None or holder[:2] != self._me:  # (another store of mine: mine)
                self._lose(
                    agent,
                    "its claim was taken by "
                    + (f"pid {holder[0]} on {holder[1]}" if holder else "no one (released)"),
                )
                return False
            renewed = self._kv_write(key, self._lease(), last=revision)
            if renewed is not None:
                break
        if renewed is None:
            return True  # (mine at the last look; renewed at the next)
        with self._claim_lock:
            if agent in self._claims:
                self._claims[agent], self._sure_until[agent] = renewed, _half_lease_on()
        return True

    def _lose(self, agent: str, why: str) -> ClaimLost:
        """Mark ``agent``'s claim lost to another consumer; the error to raise."""
        text = (f"this process no longer consumes the inbox of {agent!r}: {why} after "
                f"this one went quiet past its {lease_s():g} s lease (stopped, paused or "
                "cut off); it hands out and commits nothing more: start it again")  # fmt: skip
        with self._claim_lock:
            self._claims.pop(agent, None)
            self._cursors.pop(agent, None)
            self._sent.pop(agent, None)
            self._lost[agent] = text
        return ClaimLost(text)

    def _renew(self) -> None:
        """Keep my claims alive (a thread, once)."""
        if self._renewer is not None:
            return

        def renew() -> None:
            while not self._closed.wait(lease_s() / 3):
                for agent in list(self._claims):
                    with contextlib.suppress(Exception):  # (a server away: next time)
                        self._confirm(agent)

        self._renewer = threading.Thread(target=renew, name="ralph-nats-lease", daemon=True)
        self._renewer.start()

    def release(self, agent: str) -> None:
        try:  # (its last commit is stored before another may claim the inbox)
            self.settle_cursor(agent)
        except MailError as exc:
            warnings.warn(f"{exc}: the last commit of {agent!r} may not be stored (what "
                          "it consumed may come again)", RuntimeWarning, stacklevel=3)  # fmt: skip
        with self._claim_lock:
            held = self._claims.pop(agent, None)
            self._cursors.pop(agent, None)
            self._lost.pop(agent, None)
            self._stamped.pop(agent, None)
        if held is not None:
            with contextlib.suppress(StoreError):  # else the lease lapses by itself
                self._kv_delete(f"claim.{kv_key(agent)}", timeout=2.0)

    def consumer(self, agent: str) -> int | None:
        holder = holder_of(self._looked(f"claim.{kv_key(agent)}"))
        if holder is None or holder[2] <= time.time():
            return None
        return holder[0]
