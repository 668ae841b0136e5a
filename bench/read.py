"""Read side: ``poll`` of many new messages against a raw parse of the same bytes, and
``poll`` of a few new messages behind backlogs of growing size (it must stay flat).

Inboxes are filled with valid lines shaped exactly like the ones ralph_mail writes
(bench.common.Workspace.inbox_file), because sending a million messages one by one
would only measure the send again. ralph_mail's poll is timed with the cyclic GC in
its default state: that is what its users get.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Final

import orjson

from bench.common import (
    CONTENT,
    METADATA,
    Row,
    Section,
    Sizes,
    Workspace,
    interleave,
    optional_module,
    ralph,
)
from bench.send import guarded

#: New messages per small poll behind a backlog.
FEW: Final = 10


def raw_parse(path: Path, gc_off: bool) -> float:
    """The anchor: seek + read + split + ``orjson.loads`` of every line, in ms."""
    fd = os.open(path, os.O_RDONLY)
    try:
        gc.collect()
        if gc_off:
            gc.disable()
        t0 = time.perf_counter()
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 24):
            chunks.append(chunk)
        parsed = [orjson.loads(line) for line in b"".join(chunks).split(b"\n") if line]
        dt = time.perf_counter() - t0
    finally:
        gc.enable()
        os.close(fd)
    del parsed
    return dt * 1e3


def _reader(ws: Workspace, name: str) -> tuple[Any, Any, Path]:
    """A fresh team with a reader and a sender; the reader has polled once (empty)."""
    rm = ralph()
    assert not isinstance(rm, str)
    home = ws.fresh(name)
    rm.create_team("rd", ["reader", "sender"], home=home)
    reader = rm.MessageBus("rd", "reader", home=home)
    reader.poll()
    sender = rm.MessageBus("rd", "sender", home=home)
    return reader, sender, home / "teams/rd/mailbox/reader.jsonl"


#: What a timed poll's team gets before the poll: (reader, sender, the reader's inbox).
Fill = Callable[[Any, Any, Path], object]


def _timed_poll(ws: Workspace, name: str, fill: Fill) -> tuple[list[Any], float]:
    """A fresh `_reader` team, ``fill(reader, sender, inbox)``, then one poll: what it
    returned and how long it took (ms)."""
    reader, sender, inbox = _reader(ws, name)
    try:
        fill(reader, sender, inbox)
        gc.collect()
        t0 = time.perf_counter()
        msgs = reader.poll()
        dt = time.perf_counter() - t0
    finally:
        reader.close()
        sender.close()
    return msgs, dt * 1e3


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Measure big polls against the raw parse, then small polls behind backlogs."""
    sec = Section("read", "Read: poll against a raw parse (ms), and behind a backlog (µs)")
    rm = ralph()
    ralph_status = rm if isinstance(rm, str) else "ok"
    cases: list[Callable[[], None]] = []
    for n in sizes.read_sizes:

        def poll_n(n: int = n) -> float:
            msgs, ms = _timed_poll(ws, f"poll{n}", lambda _r, _s, inbox: ws.place_inbox(inbox, n))
            if len(msgs) != n:
                raise RuntimeError(f"poll returned {len(msgs)} of {n} messages")
            return ms

        def raw_n(n: int = n, gc_off: bool = False) -> float:
            return raw_parse(ws.inbox_file(n), gc_off)

        raw = sec.add(
            Row(f"raw_parse_{n}", f"raw read + split + orjson.loads, {n:,} lines", "ms", "lower")
        )
        nogc = sec.add(
            Row(
                f"raw_parse_{n}_nogc",
                f"same, cyclic GC off, {n:,} lines",
                "ms",
                "lower",
                anchor=raw.key,
            )
        )
        poll = sec.add(
            Row(
                f"poll_{n}",
                f"ralph_mail poll of {n:,} new messages",
                "ms",
                "lower",
                anchor=raw.key,
                status=ralph_status,
            )
        )
        cases += [
            guarded(raw, raw_n),
            guarded(nogc, partial(raw_n, n, True)),
            guarded(poll, poll_n),
        ]
    _signed(sec, cases, ws, min(sizes.read_sizes), ralph_status)
    interleave(sizes.reps, cases)
    _backlogs(sec, sizes, ws, ralph_status)
    return sec


def _signed(sec: Section, cases: list[Callable[[], None]], ws: Workspace, n: int,
            status: str) -> None:  # fmt: skip
    """A poll of ``n`` messages signed by their sender (Ed25519), each verified against
    the roster, next to the poll of as many unsigned ones."""
    crypto = optional_module("cryptography")

    def poll_signed() -> float:
        from ralph_mail.govern import keys

        def signed(_reader: Any, sender: Any, _inbox: Path) -> None:
            keys.create(sender)
            for _ in range(n):
                sender.send("reader", "text", CONTENT, metadata=METADATA)

        msgs, ms = _timed_poll(ws, f"signed{n}", signed)
        if len(msgs) != n or not all(m.verified for m in msgs):
            raise RuntimeError(f"poll returned {len(msgs)} of {n} verified messages")
        return ms

    row = sec.add(Row(f"signed_poll_{n}", f"ralph_mail poll of {n:,} signed messages, verified",
                      "ms", "lower", anchor=f"poll_{n}",
                      status=crypto if isinstance(crypto, str) else status))  # fmt: skip
    cases.append(guarded(row, poll_signed))


def _backlogs(sec: Section, sizes: Sizes, ws: Workspace, status: str) -> None:
    """Poll FEW new messages behind each backlog, round-robin across the backlogs."""
    first = sizes.backlogs[0]
    rows = {
        b: sec.add(
            Row(
                f"backlog_{b}",
                f"ralph_mail poll of {FEW} new, backlog {b:,}",
                "µs",
                "lower",
                anchor=None if b == first else f"backlog_{first}",
                status=status,
            )
        )
        for b in sizes.backlogs
    }
    biggest = sizes.backlogs[-1]
    consume = sec.add(
        Row(
            f"consume_{biggest}",
            f"ralph_mail poll of {biggest:,} new messages (the backlog, once)",
            "ms",
            "lower",
            status=status,
        )
    )
    if status != "ok":
        return
    rm = ralph()
    assert not isinstance(rm, str)
    text = rm.MessageType.TEXT
    opened: dict[int, tuple[Any, Any]] = {}
    try:
        for b in sizes.backlogs:
            reader, sender, inbox = _reader(ws, f"backlog{b}")
            opened[b] = (reader, sender)
            ws.place_inbox(inbox, b)
            gc.collect()
            t0 = time.perf_counter()
            consumed = len(reader.poll())
            if b == biggest:
                consume.values.append((time.perf_counter() - t0) * 1e3)
            if consumed != b:
                rows[b].status = f"failed: consuming the backlog returned {consumed} of {b}"
            gc.collect()
        for _ in range(sizes.backlog_polls):
            for b, (reader, sender) in opened.items():
                if rows[b].status != "ok":
                    continue
                for i in range(FEW):
                    sender.send("reader", text, f"new {i}")
                t0 = time.perf_counter()
                got = len(reader.poll())
                dt = time.perf_counter() - t0
                if got != FEW:
                    rows[b].status = f"failed: poll returned {got} of {FEW}"
                rows[b].values.append(dt * 1e6)
    except Exception as exc:
        for row in rows.values():
            if row.status == "ok":
                row.status = f"failed: {type(exc).__name__}: {exc}"
    finally:
        for reader, sender in opened.values():
            reader.close()
            sender.close()


__all__ = ["raw_parse", "run"]
