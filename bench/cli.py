"""Command line: wall time of the commands agents call in loops (``send``, ``read``,
``wait --timeout 0``, ``tail -n 5``, ``status``, and the conversation's ``ask`` answered
by a replier process, ``reply``, ``history``, ``task done``) against a bare start of the
very same interpreter (``python -S -c pass``).

Agents that shell out once per message pay the process start-up on every message, so
this is the figure a bash loop sees. Each command runs its console script with ``-S``,
as the bare start does (`NOSITE_NOTE`); one more pair, the bare start and ``send`` with
site, shows what an install's start-up hooks add to both. Runs are interleaved (bare,
send, read, wait, …) so a burst of outside load hits all of them alike. Each run is one
fork/exec timed from spawn to reap; peak RSS comes from one more run under GNU time.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Final

from bench.ask import REPLIER
from bench.common import Row, Section, Sizes, Workspace, child_env, ralph

NOSITE_NOTE: Final = (
    "without site on both sides: an editable install (pip install -e) adds an import hook "
    "to every start of this venv's interpreter, which would flatter the ratio; a regular "
    "install has none"
)
WARM_NOTE: Final = (
    "the command hands itself to a server started by `ralph-mail warm start`, which runs "
    "it in a worker forked from a process that imported everything (ralph_mail/cli/relay.py)"
)
#: Untimed runs of each command first: they fill the page cache and write .pyc files.
WARMUP: Final = 2


@dataclass(frozen=True, slots=True)
class Run:
    """One finished command: wall ``seconds``, exit ``code`` and ``stderr``."""

    seconds: float
    code: int
    stderr: str


def executable() -> Path | str:
    """The ``ralph-mail`` script next to the running interpreter, or why there is none."""
    exe = Path(sys.executable).parent / "ralph-mail"
    if not exe.exists():
        return f"unavailable: no {exe} (is ralph_mail installed in this environment?)"
    return exe


def nosite_path(rm: ModuleType) -> str:
    """PYTHONPATH that finds ralph_mail and its dependencies without ``site``."""
    package_parent = Path(rm.__file__ or ".").resolve().parent.parent
    return os.pathsep.join([str(package_parent), sysconfig.get_paths()["purelib"]])


def run_cmd(argv: list[str], env: dict[str, str]) -> Run:
    """Spawn ``argv``, wait for it, and return its wall time (spawn to reap)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        check=False,
        timeout=120,
    )
    dt = time.perf_counter() - t0
    return Run(dt, proc.returncode, proc.stderr.decode(errors="replace"))


def peak_rss_mib(argv: list[str], env: dict[str, str], scratch: Path) -> float:
    """Peak resident memory of one run of ``argv`` in MiB, or NaN without GNU time.

    Not ``os.wait4`` on our own child: Linux carries the forking process's peak RSS
    across exec (``signal->maxrss``), so every child of this 40 MiB bench would report
    at least 40 MiB. GNU time forks the command from a 1 MiB process instead.
    """
    gnu_time = Path("/usr/bin/time")
    if not gnu_time.exists():
        return math.nan
    out = scratch / "rss.txt"
    proc = subprocess.run(
        [str(gnu_time), "-f", "%M", "-o", str(out), *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        check=False,
        timeout=120,
    )
    try:
        kib = int(out.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return math.nan
    return kib / 1024 if proc.returncode in (0, 1) else math.nan  # 1: a wait found nothing


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Time a bare start and each command, interleaved over ``sizes.cli_runs`` runs."""
    sec = Section("cli", "Command line: one process per command (ms)")
    rm, exe = ralph(), executable()
    status = rm if isinstance(rm, str) else (exe if isinstance(exe, str) else "ok")

    def row(key: str, label: str, anchor: str | None = None, note: str = "") -> Row:
        return sec.add(Row(key, label, "ms", "lower", anchor=anchor, extra={"rss_mib": []},
                           status="ok" if anchor is None else status, note=note))  # fmt: skip

    python = Path(sys.executable).name
    bare = row("bare_python_nosite", f"{python} -S -c pass (same venv, no site)", note=NOSITE_NOTE)
    commands = (
        ("cli_send", "send"),
        ("cli_read", "read (one new message)"),
        ("cli_wait", "wait --timeout 0 (nothing new)"),
        ("cli_tail", "tail -n 5"),
        ("cli_status", "status"),
        ("cli_ask", "ask (answered by a replier process)"),
        ("cli_reply", "reply"),
        ("cli_history", "history -n 20"),
        ("cli_task_done", "task done"),
    )
    rows = {key: row(key, f"ralph-mail {label}, run with -S", bare.key) for key, label in commands}
    warm_rows = {
        key: row(f"{key}_warm", f"ralph-mail {label}, run with -S, through `warm start`'s "
                 "server", bare.key, note=WARM_NOTE)
        for key, label in commands
    }  # fmt: skip
    bare_site = row("bare_python", f"{python} -c pass (same venv, with site)")
    send_site = row("cli_send_site", "ralph-mail send, as installed (with site)", bare_site.key)
    bare_env = child_env()
    #: (row, argv, env, what to do before each run: it may return the argv to run)
    cases: list[tuple[Row, list[str], dict[str, str], Callable[[], list[str] | None]]] = [
        (bare, [sys.executable, "-S", "-c", "pass"], bare_env, _nothing),
        (bare_site, [sys.executable, "-c", "pass"], bare_env, _nothing),
    ]
    feeder = replier = None
    stop_warm: Callable[[], None] | None = None
    if status == "ok":
        assert not isinstance(rm, str) and not isinstance(exe, str)
        home = ws.fresh("cli")
        rm.create_team("cli", ["reader", "sender", "oracle"], home=home)
        feeder = rm.MessageBus("cli", "sender", home=home)
        reader = rm.MessageBus("cli", "reader", home=home)
        env = {"RALPH_HOME": str(home), "RALPH_TEAM": "cli", "PYTHONPATH": nosite_path(rm)}
        replier = subprocess.Popen(
            [sys.executable, "-c", REPLIER, str(home), str(1 << 30), "cli", "oracle"],
            stdout=subprocess.PIPE, env=child_env(),
        )  # fmt: skip
        assert replier.stdout is not None and replier.stdout.readline() == b"ready\n"
        counter = iter(range(1 << 30))
        script = [sys.executable, "-S", str(exe)]  # the console script, without site

        def one_new() -> None:
            feeder.send("reader", "text", "one new message")  # type: ignore[union-attr]

        def request() -> list[str]:
            sent = feeder.send("reader", "request", "is the build green?")  # type: ignore[union-attr]
            return [*script, "reply", sent.id, "yes, green"]

        def task() -> list[str]:
            reader.set_presence("idle")  # the delegator asks an agent that is online
            given = feeder.delegate("reader", "parse the logs", id=f"T-{next(counter)}")  # type: ignore[union-attr]
            return [*script, "task", "done", given.id, "parsed"]

        as_reader = child_env(env | {"RALPH_AGENT": "reader"})
        as_sender = child_env(env | {"RALPH_AGENT": "sender"})
        send = ["send", "reader", "status: parsing done, 3 warnings"]
        cold: list[tuple[Row, list[str], dict[str, str], Callable[[], list[str] | None]]] = [
            (rows["cli_send"], [*script, *send], as_sender, _nothing),
            (rows["cli_read"], [*script, "read"], as_reader, one_new),
            (rows["cli_wait"], [*script, "wait", "--timeout", "0"], as_sender, _nothing),
            (rows["cli_tail"], [*script, "tail", "reader", "-n", "5"], as_sender, _nothing),
            (
                rows["cli_status"],
                [*script, "status", "parsing", "--state", "working"],
                as_sender,
                _nothing,
            ),
            (
                rows["cli_ask"],
                [*script, "ask", "oracle", "is the build green?", "--timeout", "30"],
                as_sender,
                _nothing,
            ),
            (rows["cli_reply"], [], as_reader, request),
            (rows["cli_history"], [*script, "history", "reader", "-n", "20"], as_sender, _nothing),
            (rows["cli_task_done"], [], as_reader, task),
        ]
        warm_dir = ws.fresh("warm")
        warm_dir.chmod(0o700)
        warm = {"RALPH_WARM": "1", "RALPH_WARM_DIR": str(warm_dir)}
        server = _start_warm(script, as_sender | warm)
        stop_warm = partial(_stop_warm, script, as_sender | warm)
        for warm_row in warm_rows.values():
            warm_row.status = "ok" if server is None else server
        cases += cold + [(warm_rows[row.key], argv, env | warm, prepare)
                         for row, argv, env, prepare in cold]  # fmt: skip
        cases += [
            (
                send_site,
                [str(exe), *send],
                child_env({"RALPH_HOME": str(home), "RALPH_TEAM": "cli", "RALPH_AGENT": "sender"}),
                _nothing,
            ),
        ]
    try:
        for i in range(WARMUP + sizes.cli_runs):
            for row, argv, env, prepare in cases:
                if row.status != "ok":
                    continue
                result = run_cmd(prepare() or argv, env)
                if result.code not in (0, 1):  # 1: wait --timeout 0 found nothing
                    row.status = f"failed: exit {result.code}: {result.stderr.strip()[-300:]}"
                elif i >= WARMUP:
                    row.values.append(result.seconds * 1e3)
        scratch = ws.fresh("rss")
        for row, argv, env, prepare in cases:  # one more run each, through GNU time
            if row.status == "ok":
                row.extra["rss_mib"].append(peak_rss_mib(prepare() or argv, env, scratch))
    finally:
        if feeder is not None:
            feeder.close()
            reader.close()
        if stop_warm is not None:
            stop_warm()
        if replier is not None:
            replier.terminate()  # our own child, answering until told to stop
            replier.wait(timeout=60)
    return sec


def _nothing() -> None:
    return None


def _start_warm(script: list[str], env: dict[str, str]) -> str | None:
    """Start a warm server for the commands run with ``env``; None, or why it did not."""
    done = subprocess.run([*script, "warm", "start", "--idle", "600"], env=env,
                          capture_output=True, timeout=120, check=False)  # fmt: skip
    if done.returncode != 0:
        return f"failed: warm start: {done.stderr.decode(errors='replace').strip()[-300:]}"
    return None


def _stop_warm(script: list[str], env: dict[str, str]) -> None:
    """Stop the server `_start_warm` started (exit 1: there was none)."""
    subprocess.run([*script, "warm", "stop"], env=env, capture_output=True, timeout=120,
                   check=False)  # fmt: skip
