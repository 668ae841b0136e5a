"""Search over the audit trail: the index built from ``search_n`` messages (the indexing
rate), a query for a rare word among them (p50), the cost of the next query after 1,000
new messages, and, as the floor, the same query asked of SQLite FTS5 directly (the
index's own table, no bringing up to date, no decoding).
"""

from __future__ import annotations

import sqlite3
import time

from bench.common import Row, Section, Sizes, Workspace, percentile, ralph

#: Messages with the rare word, spread among the others.
NEEDLES = 100
#: Queries timed per repetition.
QUERIES = 30


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Index ``sizes.search_n`` messages once, then time queries and an update."""
    n = sizes.search_n
    sec = Section("search", f"Search over {n:,} messages")
    rm = ralph()
    status = rm if isinstance(rm, str) else "ok"
    rate = sec.add(Row("search_index_rate", f"building the index of {n:,} messages",
                       "msg/s", "higher", status=status))  # fmt: skip
    floor = sec.add(Row("fts5_direct", "SQLite FTS5 asked directly (the floor, p50)", "ms",
                        "lower", status=status))  # fmt: skip
    query = sec.add(Row("search_query", f"bus.search of a rare word among {n:,} (p50)", "ms",
                        "lower", anchor=floor.key, status=status))  # fmt: skip
    update = sec.add(Row("search_after_1000", "bus.search after 1,000 new messages", "ms",
                         "lower", anchor=floor.key, status=status))  # fmt: skip
    if isinstance(rm, str):
        return sec
    home = ws.fresh("search")
    rm.create_team("find", ["sender", "reader"], home=home)
    inbox = home / "teams" / "find" / "mailbox" / "reader.jsonl"
    step = max(1, n // NEEDLES)
    bus = rm.MessageBus("find", "sender", home=home)
    try:
        for start in range(0, n, step):  # the bulk as raw lines, a needle after each part
            ws.place_inbox(inbox, min(step, n - start) - 1)
            bus.send("reader", "text", f"the needle {start} is here")
        t0 = time.perf_counter()
        bus.search("warmup-word-not-there")  # builds the index from nothing
        rate.values.append(n / (time.perf_counter() - t0))
        db = sqlite3.connect(str(home / "teams" / "find" / "index" / "search.sqlite3"))
        sql = ("SELECT inbox, offset, length FROM messages WHERE messages MATCH '\"needle\"' "
               "ORDER BY ts DESC LIMIT 20")  # fmt: skip
        for _ in range(sizes.reps):
            direct, ours = [], []
            for _ in range(QUERIES):
                t0 = time.perf_counter()
                db.execute(sql).fetchall()
                direct.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                found = bus.search("needle")
                ours.append((time.perf_counter() - t0) * 1e3)
                assert len(found) == 20
            floor.values.append(percentile(direct, 50))
            query.values.append(percentile(ours, 50))
            for k in range(1000):
                bus.send("reader", "text", f"fresh {k}")
            t0 = time.perf_counter()
            bus.search("needle")
            update.values.append((time.perf_counter() - t0) * 1e3)
        db.close()
    finally:
        bus.close()
    return sec
