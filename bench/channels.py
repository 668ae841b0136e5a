"""Channels and the responder: what a post and a read cost beside an inbox's send and
poll, what ``ralph-mail run`` adds around a child, and what a turn of a standup costs.

* Channel post and read rates against inbox send and poll of the same messages, in one
  process, alternately.
* The responder's overhead (a real ``ralph-mail run`` process whose command is
  ``date +%s%N``, which prints the moment it ran): request arrival (its ``ts``) to the
  child running, and the child running to the reply delivered (its ``ts``); the floor
  is ``subprocess.run`` of the same child, from the call to the child's time and from
  the child's time to the call's return.
* A post mentioning ``turn_agents`` runners (``channel_delay`` 0): the time between
  consecutive answers, less ``subprocess.run`` of the same child, per turn.
* Cancel: a task whose ``ralph-mail run`` job runs (``sleep``, its pid written first)
  is canceled; how long ``bus.cancel`` takes, and from its return to the job's process
  being gone (a pidfd of it becomes readable: Linux).
"""

from __future__ import annotations

import itertools
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from bench.cli import executable
from bench.common import Row, Section, Sizes, Workspace, child_env, ralph

#: The child every runner runs: prints the wall-clock time it ran at, in ns.
CLOCK = ["date", "+%s%N"]
#: How long a runner may take to come online, or an answer to come (s).
BOUND_S = 60.0


def _rates(rm: ModuleType, ws: Workspace, sizes: Sizes, sec: Section) -> None:
    send = sec.add(Row("inbox_send", "inbox send", "msg/s", "higher"))
    post = sec.add(Row("channel_post", "channel post (no mention)", "msg/s", "higher",
                       anchor=send.key))  # fmt: skip
    poll = sec.add(Row("inbox_poll", f"inbox poll of {sizes.send_n:,}", "ms", "lower"))
    read = sec.add(Row("channel_read", f"channel read of {sizes.send_n:,}", "ms", "lower",
                       anchor=poll.key))  # fmt: skip
    for rep in range(sizes.reps):
        home = ws.fresh(f"channel-rates-{rep}")
        rm.create_team("ch", ["a", "b"], home=home)
        a, b = rm.MessageBus("ch", "a", home=home), rm.MessageBus("ch", "b", home=home)
        a.channels.create("c", ["b"])
        try:
            text = "x" * 100
            t0 = time.perf_counter()
            for _ in range(sizes.send_n):
                a.send("b", "text", text)
            send.values.append(sizes.send_n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for _ in range(sizes.send_n):
                a.channel_post("c", text)
            post.values.append(sizes.send_n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            assert len(b.poll()) == sizes.send_n
            poll.values.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            assert len(b.channel_read("c")) == sizes.send_n
            read.values.append((time.perf_counter() - t0) * 1e3)
        finally:
            a.close()
            b.close()


def _runner(
    exe: Path, home: Path, team: str, agent: str, command: list[str] = CLOCK
) -> subprocess.Popen[bytes]:
    """``ralph-mail run --agent AGENT -- COMMAND`` (``date +%s%N``), once it says it is
    online."""
    env = child_env({"RALPH_HOME": str(home), "RALPH_TEAM": team, "RALPH_CHANNEL_DELAY": "0"})
    proc = subprocess.Popen([str(exe), "run", "--agent", agent, "--", *command],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)  # fmt: skip
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if b"answers with" not in line:
        proc.kill()
        raise RuntimeError(f"runner {agent} did not start: {line!r}")
    return proc


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate ``procs`` and reap them (killed past `BOUND_S`)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ns(ts: str) -> int:
    from ralph_mail.message import parse_ts

    return round(parse_ts(ts) * 1e6) * 1000


def _floor() -> tuple[float, float]:
    """``subprocess.run`` of the child: call to child time, child time to return (ms)."""
    t0 = time.time_ns()
    out = subprocess.run(CLOCK, capture_output=True, check=True).stdout
    t1 = time.time_ns()
    ran = int(out)
    return (ran - t0) / 1e6, (t1 - ran) / 1e6


def _responder(rm: ModuleType, exe: Path, ws: Workspace, sizes: Sizes, sec: Section) -> None:
    floor_in = sec.add(Row("floor_start", "subprocess.run: call to child running", "ms", "lower"))
    floor_out = sec.add(Row("floor_exit", "subprocess.run: child to return", "ms", "lower"))
    start = sec.add(Row("run_start", "run: request arrival to child running", "ms", "lower"))
    finish = sec.add(Row("run_exit", "run: child to reply delivered", "ms", "lower"))
    home = ws.fresh("responder")
    rm.create_team("rr", ["lead", "w"], home=home)
    runner = _runner(exe, home, "rr", "w")
    lead = rm.MessageBus("rr", "lead", home=home)
    try:
        for _ in range(sizes.run_samples):
            a, b = _floor()
            floor_in.values.append(a)
            floor_out.values.append(b)
            reply = lead.ask("w", "what time is it?", timeout=BOUND_S)
            request = next(m for m in lead.thread(reply.thread) if m.type == "request")
            ran = int(reply.content)
            start.values.append((ran - _ns(request.ts)) / 1e6)
            finish.values.append((_ns(reply.ts) - ran) / 1e6)
    finally:
        lead.close()
        stop_all([runner])


def _turns(rm: ModuleType, exe: Path, ws: Workspace, sizes: Sizes, sec: Section) -> None:
    floor = sec.add(Row("floor_run", "subprocess.run of the child", "ms", "lower"))
    turn = sec.add(Row("turn_overhead", f"a turn of a post mentioning {sizes.turn_agents} "
                       "runners, less the floor", "ms", "lower"))  # fmt: skip
    home = ws.fresh("turns")
    agents = [f"a{n}" for n in range(sizes.turn_agents)]
    rm.create_team("tt", ["lead", *agents], home=home)
    lead = rm.MessageBus("tt", "lead", home=home)
    lead.channels.create("standup", agents)
    runners: list[subprocess.Popen[bytes]] = []
    try:
        runners += [_runner(exe, home, "tt", agent) for agent in agents]
        waiter = lead.store.waiter(["#standup"])
        mentions = " ".join(f"@{agent}" for agent in agents)
        for _ in range(sizes.turn_posts):
            t0 = time.perf_counter()
            subprocess.run(CLOCK, capture_output=True, check=True)
            child = (time.perf_counter() - t0) * 1e3
            floor.values.append(child)
            post = lead.channel_post("standup", f"{mentions} status?")
            deadline = time.monotonic() + BOUND_S
            while True:
                answers = [p for p in lead.channel_history("standup", len(agents) + 1)
                           if p.reply_to == post.id]  # fmt: skip
                if len(answers) == len(agents):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{len(answers)} of {len(agents)} answers came")
                waiter.wait(1.0)
            stamps = [_ns(post.ts)] + [_ns(p.ts) for p in answers]
            gaps = [(b - a) / 1e6 for a, b in itertools.pairwise(stamps)]
            turn.values += [gap - child for gap in gaps]
        waiter.close()
    finally:
        lead.close()
        stop_all(runners)


def _cancel(rm: ModuleType, exe: Path, ws: Workspace, sizes: Sizes, sec: Section) -> None:
    call = sec.add(Row("cancel_call", "bus.cancel of a task a run works on", "ms", "lower"))
    kill = sec.add(Row("cancel_kill", "run: cancel returned to the job's process gone", "ms",
                       "lower"))  # fmt: skip
    home = ws.fresh("cancel")
    rm.create_team("cc", ["lead", "w"], home=home)
    pid_file = home / "job.pid"
    job = ["sh", "-c", f"echo $$ > {pid_file}.new && mv {pid_file}.new {pid_file}; exec sleep 600"]
    runner = _runner(exe, home, "cc", "w", job)
    lead = rm.MessageBus("cc", "lead", home=home)
    try:
        for n in range(sizes.run_samples):
            pid_file.unlink(missing_ok=True)
            lead.delegate("w", "sleep on it", id=f"T-{n}")
            deadline = time.monotonic() + BOUND_S
            while not pid_file.exists():  # the job writes its pid once it runs
                if time.monotonic() > deadline:
                    raise RuntimeError("the job did not start")
                time.sleep(0.005)
            gone = os.pidfd_open(int(pid_file.read_text()))
            try:
                t0 = time.perf_counter()
                lead.cancel(f"T-{n}")
                t1 = time.perf_counter()
                if not select.select([gone], [], [], BOUND_S)[0]:
                    raise RuntimeError("the canceled job is still running")
                t2 = time.perf_counter()
            finally:
                os.close(gone)
            call.values.append((t1 - t0) * 1e3)
            kill.values.append((t2 - t1) * 1e3)
    finally:
        lead.close()
        stop_all([runner])


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Post and read beside send and poll; the responder's overhead; turns."""
    sec = Section("channels", "Channels and the responder")
    rm, exe = ralph(), executable()
    if isinstance(rm, str) or isinstance(exe, str):
        sec.add(Row("channel_post", "channel post", "msg/s", "higher", status=str(rm or exe)))
        return sec
    _rates(rm, ws, sizes, sec)
    if sys.platform.startswith("linux") or sys.platform == "darwin":
        _responder(rm, exe, ws, sizes, sec)
        _turns(rm, exe, ws, sizes, sec)
    if hasattr(os, "pidfd_open"):
        _cancel(rm, exe, ws, sizes, sec)
    return sec
