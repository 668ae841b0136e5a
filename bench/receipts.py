"""Receipts: what a lookup costs as the inbox grows, and what recording commit times
adds to a commit.

* ``bus.receipt(id)`` of the newest message once ``read_sizes`` messages were sent to
  the recipient and consumed one commit each, every size timed alternately in one run:
  the lookup reads the pair's index back from its end, and bisects the commit times, so
  its cost should not follow the inbox.
* ``store.consumed_at`` of the middle message of the biggest inbox: a bisection of its
  commit times.
* A commit of one peeked message (the cursor saved, then its time recorded), and the
  record alone (``store.note_commit``), each as a mean over a whole backlog.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

from bench.common import Row, Section, Sizes, Workspace, ralph


def _team(rm: ModuleType, ws: Workspace, count: int) -> tuple[Any, Any, list[float]]:
    """A team where w1 sent lead ``count`` messages, and lead consumed them one commit
    each; return w1's bus, lead's bus and the time of each commit (µs)."""
    home = ws.fresh(f"receipts-{count}")
    rm.create_team("rc", ["lead", "w1"], home=home)
    sender, lead = rm.MessageBus("rc", "w1", home=home), rm.MessageBus("rc", "lead", home=home)
    for n in range(count):
        sender.send("lead", "text", f"message {n}")
    commits = []
    for message in lead.peek():
        t0 = time.perf_counter()
        lead.commit(message)
        commits.append((time.perf_counter() - t0) * 1e6)
    return sender, lead, commits


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Receipt lookups behind small and big inboxes; a commit with and without its time."""
    sec = Section("receipts", "Receipts: lookup cost by inbox size, and the commit path")
    rm = ralph()
    status = rm if isinstance(rm, str) else "ok"
    first, biggest = sizes.read_sizes[0], sizes.read_sizes[-1]
    rows = {}
    for n in sizes.read_sizes:
        label = f"bus.receipt(id) of the newest, {n:,} messages in the inbox"
        anchor = None if n == first else f"receipt_{first}"
        rows[n] = sec.add(Row(f"receipt_{n}", label, "µs", "lower", anchor=anchor, status=status))
    consumed = sec.add(Row("consumed_at", f"store.consumed_at: {biggest:,} commit times "
                           "bisected", "µs", "lower", status=status))  # fmt: skip
    commit = sec.add(Row("commit_one", "commit() of one peeked message, its time recorded",
                         "µs", "lower", status=status))  # fmt: skip
    note = sec.add(Row("note_commit", "recording a commit's time alone (store.note_commit)",
                       "µs", "lower", anchor=commit.key, status=status))  # fmt: skip
    if isinstance(rm, str):
        return sec
    teams = {n: _team(rm, ws, n) for n in sizes.read_sizes}
    try:
        newest = {n: sender.send("lead", "text", "newest") for n, (sender, _, _) in teams.items()}
        for n, (sender, _, _) in teams.items():  # warm: page cache, index descriptors
            assert sender.receipt(newest[n].id).state == "stored"
        for _ in range(sizes.history_runs):
            for n, (sender, _, _) in teams.items():
                t0 = time.perf_counter()
                sender.receipt(newest[n].id)
                rows[n].values.append((time.perf_counter() - t0) * 1e6)
        sender, lead, commits = teams[biggest]
        commit.values.append(sum(commits) / len(commits))
        middle = sender.history("lead", biggest // 2 + 1)[0]
        found = sender.receipt(middle)
        store = lead.store
        offset = _offset(store, middle.id)
        for _ in range(sizes.history_runs):
            t0 = time.perf_counter()
            at = store.consumed_at("lead", offset, middle.ts)
            consumed.values.append((time.perf_counter() - t0) * 1e6)
        if at != found.consumed_at or at is None:
            consumed.status = f"failed: consumed_at {at} is not the receipt's {found.consumed_at}"
        count = max(1000, biggest // 10)
        t0 = time.perf_counter()
        from ralph_mail.store.base import Cursor

        end = Cursor(store.size("lead"))
        for _ in range(count):
            store.note_commit("lead", end, end)
        note.values.append((time.perf_counter() - t0) * 1e6 / count)
    finally:
        for sender, lead, _ in teams.values():
            sender.close()
            lead.close()
    return sec


def _offset(store: Any, message_id: str) -> int:
    """Where message ``message_id`` starts in lead's inbox (a scan: setup, not timed)."""
    offset = 0
    needle = f'"id":"{message_id}"'.encode()
    while True:
        data, offset = store.read("lead", offset)
        for line in data.splitlines(keepends=True):
            if needle in line:
                return int(offset)
            offset += len(line)
        if not data:
            raise LookupError(message_id)


__all__ = ["run"]
