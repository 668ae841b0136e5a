"""Conversations at scale: ``history`` of one pair buried under the rest of the team's
mail, and the task tree of a long-lived team.

* ``history(X, 20)`` when X's 20 messages are buried under ``history_big`` others,
  against the same call with ``history_small`` others, timed alternately in one run:
  the index makes the cost follow what is returned, not the team's mail; and
  ``thread(X)`` of a thread of 10 buried alike, a tenth of the others in threads.
* ``ralph-mail tasks`` (one process, as a user runs it) and ``bus.tasks()`` over a task
  log of ``tree_tasks`` tasks and ``tree_events`` events, written with the log's own
  record encoders, against a bare interpreter start.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType

from bench.cli import executable, run_cmd
from bench.common import Row, Section, Sizes, Workspace, child_env, ralph


def _buried(rm: ModuleType, ws: Workspace, others: int) -> tuple[Path, object, str]:
    """A team where a and b exchanged 20 messages and a thread of 10 (a request, its reply
    and 8 more), then ``others`` went between c, d and a (half of them into a's own inbox;
    a tenth are requests c asks d, each answered: threads of their own); return its home,
    a's bus and the id of a and b's thread."""
    home = ws.fresh(f"history-{others}")
    rm.create_team("hist", ["a", "b", "c", "d"], home=home)
    a, b = rm.MessageBus("hist", "a", home=home), rm.MessageBus("hist", "b", home=home)
    c, d = rm.MessageBus("hist", "c", home=home), rm.MessageBus("hist", "d", home=home)
    for n in range(10):
        a.send("b", "text", f"question {n}")
        b.send("a", "text", f"answer {n}")
    first = a.send("b", "request", "the thread")
    b.reply(first, "its answer")
    for n in range(8):
        (a, b)[n % 2].send(("b", "a")[n % 2], "text", f"in the thread {n}", thread=first.id)
    request = None
    for n in range(others):
        if n % 10 == 0:
            request = c.send("d", "request", f"noise {n}")
        elif n % 10 == 1 and request is not None:
            d.reply(request, f"noise {n}")
        elif n % 2:
            c.send("a", "text", f"noise {n}")
        else:
            c.send("d", "text", f"noise {n}")
    for bus in (b, c, d):
        bus.close()
    return home, a, first.id


def _tree_log(rm: ModuleType, home: Path, tasks_n: int, events_n: int) -> None:
    """Write a task log of ``tasks_n`` tasks (a tenth of them parents) and ``events_n``
    events: each task created, reported active again and again, completed, notified."""
    from ralph_mail.talk import tasks

    rm.create_team("tree", ["lead", *(f"w{n}" for n in range(10))], home=home)
    team = rm.load_team("tree", home)
    per_task = max(3, events_n // max(1, tasks_n))
    ts = "2026-11-23T10:00:00.000000Z"
    chunk: list[bytes] = []
    for n in range(tasks_n):
        parent = None if n % 10 == 0 else f"T-{n - n % 10}"
        task = tasks.Task(f"T-{n}", f"step {n} of the release", "lead", f"w{n % 10}", parent,
                          "normal", "pending", "", ts, ts, f"{n:012x}")  # fmt: skip
        chunk.append(tasks.created(task))
        chunk += [tasks.changed(task.id, "active", ts)] * (per_task - 3)
        chunk.append(tasks.changed(task.id, "completed", ts, f"done {n}", 0))
        chunk.append(tasks.notified(task.id))
        if len(chunk) > 10_000:
            team.store.log_append(tasks.LOG, b"".join(chunk))
            chunk = []
    team.store.log_append(tasks.LOG, b"".join(chunk))


def run(sizes: Sizes, ws: Workspace) -> Section:
    """History buried deep and shallow; the task tree, in process and from the CLI."""
    sec = Section("conversation", "Conversations: history and the task tree")
    rm, exe = ralph(), executable()
    status = rm if isinstance(rm, str) else "ok"
    small = sec.add(Row("history_small", f"history(X, 20) under {sizes.history_small:,} "
                        "other messages", "µs", "lower", status=status))  # fmt: skip
    big = sec.add(Row("history_big", f"history(X, 20) under {sizes.history_big:,} other "
                      "messages", "µs", "lower", anchor=small.key, status=status))  # fmt: skip
    thread_small = sec.add(Row("thread_small", f"thread(X) of 10 under {sizes.history_small:,} "
                               "other messages", "µs", "lower", status=status))  # fmt: skip
    thread_big = sec.add(Row("thread_big", f"thread(X) of 10 under {sizes.history_big:,} other "
                             "messages (a tenth of them in threads)", "µs", "lower",
                             anchor=thread_small.key, status=status))  # fmt: skip
    bare = sec.add(Row("bare_python", f"{Path(sys.executable).name} -c pass", "ms", "lower"))
    cli = sec.add(Row("cli_tasks", f"ralph-mail tasks over {sizes.tree_tasks:,} tasks "
                      f"({sizes.tree_events:,} events)", "ms", "lower", anchor=bare.key,
                      status=status if not isinstance(exe, str) else exe))  # fmt: skip
    lib = sec.add(Row("bus_tasks", f"bus.tasks() over {sizes.tree_tasks:,} tasks", "ms",
                      "lower", status=status))  # fmt: skip
    if isinstance(rm, str):
        return sec
    made = [_buried(rm, ws, n) for n in (sizes.history_small, sizes.history_big)]
    buses = [bus for _, bus, _ in made]
    try:
        for bus, (_, _, thread) in zip(buses, made, strict=True):  # warm: page cache, files
            assert len(bus.history("b", 20)) == 20  # type: ignore[attr-defined]
            assert len(bus.thread(thread)) == 10  # type: ignore[attr-defined]
        for _ in range(sizes.history_runs):
            for row, bus in zip((small, big), buses, strict=True):
                t0 = time.perf_counter()
                bus.history("b", 20)  # type: ignore[attr-defined]
                row.values.append((time.perf_counter() - t0) * 1e6)
            for row, bus, (_, _, thread) in zip((thread_small, thread_big), buses, made,
                                                strict=True):  # fmt: skip
                t0 = time.perf_counter()
                bus.thread(thread)  # type: ignore[attr-defined]
                row.values.append((time.perf_counter() - t0) * 1e6)
    finally:
        for bus in buses:
            bus.close()  # type: ignore[attr-defined]
    home = ws.fresh("tree")
    _tree_log(rm, home, sizes.tree_tasks, sizes.tree_events)
    bus = rm.MessageBus("tree", "lead", home=home)
    argv = [str(exe), "tasks", "--home", str(home), "--team", "tree"]
    try:
        for _ in range(max(3, sizes.cli_runs // 4)):
            bare.values.append(run_cmd([sys.executable, "-c", "pass"], child_env()).seconds * 1e3)
            if not isinstance(exe, str):
                result = run_cmd(argv, child_env())
                if result.code != 0:
                    cli.status = f"failed: exit {result.code}: {result.stderr.strip()[-300:]}"
                else:
                    cli.values.append(result.seconds * 1e3)
            t0 = time.perf_counter()
            drawn = bus.tasks()
            lib.values.append((time.perf_counter() - t0) * 1e3)
            assert len(drawn) == sizes.tree_tasks
    finally:
        bus.close()
    return sec
