"""Send, one process: ralph_mail against the raw append, the original design and the peers.

Each case sends into a fresh file per repetition, and the cases run round-robin
(bench.common.interleave) so that one burst of outside load hits them all alike.
Rates are messages per second over the whole batch: one timer around the loop, so
the clock's own cost is not in the figure.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import struct
import time
import zlib
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import Any

import orjson

from bench.common import (
    CONTENT,
    METADATA,
    Row,
    Section,
    Sizes,
    Workspace,
    interleave,
    message_dict,
    optional_module,
    ralph,
)
from bench.peers import PEERS, Peer, open_peer

#: Sends made before the timer starts, so first-call costs (lazy opens) stay out.
WARMUP = 10


def guarded(row: Row, measure: Callable[[], float]) -> Callable[[], None]:
    """A case that appends one figure to ``row``, or marks the row failed and stops.

    A failing case must not take the other rows with it: the report says what failed.
    """

    def case() -> None:
        if row.status != "ok":
            return
        try:
            row.values.append(measure())
        except Exception as exc:
            row.status = f"failed: {type(exc).__name__}: {exc}"

    return case


def raw_write(ws: Workspace, n: int, sync: bool) -> float:
    """The limit: one pre-encoded line per ``os.write`` on a kept O_APPEND descriptor."""
    path = ws.fresh("raw") / "inbox.jsonl"
    line = ws.line()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        t0 = time.perf_counter()
        if sync:
            for _ in range(n):
                os.write(fd, line)
                os.fsync(fd)
        else:
            for _ in range(n):
                os.write(fd, line)
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)


#: An index entry of the Python floor: magic, inbox name, offset, length (then a crc32).
_FLOOR_ENTRY = struct.Struct("<2s64sqI")


def python_floor(ws: Workspace, n: int) -> float:
    """The least a send in Python can do and still be a mailbox's: a fresh id and ts (ids
    drawn 64 at a time, the ts's second cached, as ralph_mail does), the envelope encoded
    with orjson, appended under ``flock`` with an ``fstat`` for the line's offset (where a
    torn tail would show), one index entry written with its checksum, and a look for a
    waiter's doorbell (one ``faccessat``). No check of any kind, no policy, no threads:
    what the interpreter costs, not what ralph_mail adds (see docs/performance.md)."""
    d = ws.fresh("floor")
    fd = os.open(d / "reader.jsonl", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    index = os.open(d / "pair.idx", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    root = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    head = _FLOOR_ENTRY.pack(b"\xa5\x5a", b"reader", 0, 0)[:-12]
    position = struct.Struct("<qI")
    ids: list[str] = []
    prefixes: dict[int, str] = {}

    def send(content: str, metadata: dict[str, str]) -> None:
        if not ids:
            drawn = os.urandom(6 * 64).hex()
            ids.extend(drawn[at : at + 12] for at in range(0, len(drawn), 12))
        envelope = {"id": ids.pop(), "from": "sender", "to": "reader", "type": "text",
                    "content": content, "metadata": metadata, "ts": ""}  # fmt: skip
        encoded = orjson.dumps(envelope)[:-3]  # ends in "ts":, the ts put there under the lock
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            offset = os.fstat(fd).st_size
            second, fraction = divmod(time.time_ns() // 1000, 1_000_000)
            prefix = prefixes.get(second)
            if prefix is None:
                prefix = prefixes[second] = time.strftime("%Y-%m-%dT%H:%M:%S",
                                                          time.gmtime(second))  # fmt: skip
            line = encoded + f'"{prefix}.{fraction:06d}Z"}}\n'.encode()
            os.write(fd, line)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.access("bells/reader", os.F_OK, dir_fd=root, follow_symlinks=False)
        body = head + position.pack(offset, len(line))
        os.write(index, body + struct.pack("<I", zlib.crc32(body)))

    try:
        for _ in range(WARMUP):
            send(CONTENT, METADATA)
        t0 = time.perf_counter()
        for _ in range(n):
            send(CONTENT, METADATA)
        return n / (time.perf_counter() - t0)
    finally:
        for opened in (fd, index, root):
            os.close(opened)


#: The governed send: a policy of this many rules (none about the pair that talks), and a
#: rate limit high enough never to refuse during the run.
POLICY_RULES = 100
POLICY_RATE = 100_000


def ralph_send(
    ws: Workspace, n: int, durable: bool, governed: bool = False, signed: bool = False
) -> float:
    """ralph_mail's ``bus.send`` in a loop, the way an agent sends (``governed``: under a
    100-rule policy and a rate limit, which every send checks; ``signed``: the sender
    has an Ed25519 key, so every envelope is signed)."""
    rm = ralph()
    assert not isinstance(rm, str)
    home = ws.fresh("send")
    rm.create_team("bench", ["sender", "reader"], home=home)
    bus = rm.MessageBus("bench", "sender", home=home, durable=durable)
    if signed:
        from ralph_mail.govern import keys

        keys.create(bus)
    if governed:
        from ralph_mail.govern.policy import Policy, Rule

        rules = tuple(Rule(f"a{i}", f"b{i}", "deny" if i % 2 else "allow")
                      for i in range(POLICY_RULES))  # fmt: skip
        bus.store.save_state("policy", Policy(rules, {"*": POLICY_RATE}).to_json())
    text = rm.MessageType.TEXT
    try:
        for _ in range(WARMUP):
            bus.send("reader", text, CONTENT, metadata=METADATA)
        t0 = time.perf_counter()
        for _ in range(n):
            bus.send("reader", text, CONTENT, metadata=METADATA)
        return n / (time.perf_counter() - t0)
    finally:
        bus.close()


def original_design(ws: Workspace, n: int, filelock: Any) -> float:
    """A literal reading of the original design: ``json.dumps``, a new FileLock per
    message, a text-mode append; id and timestamp made per message as a send must.
    """
    d = ws.fresh("original")
    path, lock_path = d / "reader.jsonl", str(d / "reader.jsonl.lock")

    def send() -> None:
        msg = {
            "id": secrets.token_hex(6),
            "from": "sender",
            "to": "reader",
            "type": "text",
            "content": CONTENT,
            "metadata": METADATA,
            "ts": datetime.now(UTC).isoformat(),
        }
        with filelock.FileLock(lock_path), open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(msg) + "\n")

    for _ in range(WARMUP):
        send()
    t0 = time.perf_counter()
    for _ in range(n):
        send()
    return n / (time.perf_counter() - t0)


def json_array(ws: Workspace, size: int, n: int) -> float:
    """The anti-pattern: the inbox is one JSON array, read and rewritten per message.

    Locked with ``fcntl.flock`` (not filelock) so the figure is the rewrite's cost
    alone; a temp file plus ``os.replace`` makes it crash-safe, as such tools do.
    """
    d = ws.fresh(f"array{size}")
    path, tmp, lock_path = d / "inbox.json", d / "inbox.json.tmp", d / "inbox.lock"
    path.write_text(json.dumps([message_dict(i) for i in range(size)]))
    lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    i = size

    def send() -> None:
        nonlocal i
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            inbox = json.loads(path.read_text(encoding="utf-8"))
            inbox.append(message_dict(i))
            i += 1
            tmp.write_text(json.dumps(inbox), encoding="utf-8")
            os.replace(tmp, path)
        finally:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)

    try:
        t0 = time.perf_counter()
        for _ in range(n):
            send()
        return n / (time.perf_counter() - t0)
    finally:
        os.close(lock_fd)


def peer_put(ws: Workspace, peer: Peer, n: int) -> float:
    """``n`` puts of the same message dict into a fresh peer store."""
    opened = open_peer(peer, ws.fresh(peer.key))
    assert not isinstance(opened, str)
    put, close = opened
    msg = message_dict(0, ws.template())
    try:
        for _ in range(WARMUP):
            put(msg)
        t0 = time.perf_counter()
        for _ in range(n):
            put(msg)
        return n / (time.perf_counter() - t0)
    finally:
        close()


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Measure every single-process send case, round-robin over ``sizes.reps``."""
    sec = Section("send", "Send, one process (messages/s)")
    cases: list[Callable[[], None]] = []

    def add(
        key: str, label: str, measure: Callable[[], float], anchor: str | None, status: str
    ) -> None:
        row = sec.add(Row(key, label, "msg/s", "higher", anchor=anchor, status=status))
        cases.append(guarded(row, measure))

    rm = ralph()
    ralph_status = rm if isinstance(rm, str) else "ok"
    add(
        "raw_write",
        "raw os.write, O_APPEND (the limit)",
        lambda: raw_write(ws, sizes.send_n, False),
        None,
        "ok",
    )
    add(
        "raw_write_fsync",
        "raw os.write + fsync",
        lambda: raw_write(ws, sizes.durable_n, True),
        "raw_write",
        "ok",
    )
    add(
        "python_floor",
        "the least a Python send does (lock, append, one index entry, no check)",
        lambda: python_floor(ws, sizes.send_n),
        "raw_write",
        "ok",
    )
    add(
        "ralph_send",
        "ralph_mail send",
        lambda: ralph_send(ws, sizes.send_n, False),
        "raw_write",
        ralph_status,
    )
    add(
        "ralph_send_policy",
        f"ralph_mail send, {POLICY_RULES}-rule policy + rate limit",
        lambda: ralph_send(ws, min(sizes.send_n, POLICY_RATE // 2), False, governed=True),
        "ralph_send",
        ralph_status,
    )
    crypto = optional_module("cryptography")
    add(
        "ralph_send_signed",
        "ralph_mail send, signed (Ed25519)",
        lambda: ralph_send(ws, sizes.send_n, False, signed=True),
        "ralph_send",
        crypto if isinstance(crypto, str) else ralph_status,
    )
    add(
        "ralph_send_durable",
        "ralph_mail send, durable (fsync)",
        lambda: ralph_send(ws, sizes.durable_n, True),
        "raw_write_fsync",
        ralph_status,
    )
    fl = optional_module("filelock")
    add(
        "original_design",
        "original design: json.dumps + new FileLock + text append",
        lambda: original_design(ws, sizes.peer_n, fl),
        "raw_write",
        fl if isinstance(fl, str) else "ok",
    )
    for peer in PEERS:
        mod = optional_module(peer.module)
        add(
            peer.key,
            peer.label,
            partial(peer_put, ws, peer, sizes.peer_n),
            "raw_write",
            mod if isinstance(mod, str) else "ok",
        )
    for size, n in sizes.array_sends.items():
        add(
            f"json_array_{size}",
            f"JSON-array inbox rewritten per message, {size:,} msgs",
            partial(json_array, ws, size, n),
            "raw_write",
            "ok",
        )
    interleave(sizes.reps, cases)
    return sec


def fastest_peer(sec: Section) -> Row | None:
    """The peer row with the highest median put rate, among those measured."""
    rows = [r for r in (sec.row(p.key) for p in PEERS) if r is not None and r.ok]
    return max(rows, key=lambda r: r.stat.median, default=None)


__all__ = ["fastest_peer", "run"]
