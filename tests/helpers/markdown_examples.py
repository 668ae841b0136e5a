"""Running the examples of a Markdown page (the README, the pages of docs/): its console
commands in order in one fresh home, each of its Python blocks in another."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.processes import BOUND_S, cli_env


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``text`` in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def console_commands(text: str) -> list[tuple[str, int]]:
    """Every ``$ command`` of the console blocks, with its expected exit code (a command
    ending in ``  # exit N`` expects N)."""
    commands = []
    for block in blocks(text, "console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                command, _, expect = line[2:].partition("  # exit ")
                commands.append((command, int(expect or 0)))
    return commands


def run_console(text: str, tmp_path: Path) -> None:
    """Run the console commands of ``text`` in order in bash, in a home under
    ``tmp_path``; fail naming the first that exits otherwise than documented, or any
    traceback."""
    script = []
    for number, (command, expect) in enumerate(console_commands(text)):
        script.append(command)
        script.append(
            f'rc=$?; if [ $rc -ne {expect} ]; then echo "command {number} exited $rc, '
            f'not {expect}: {command!r}" >&2; exit 99; fi'
        )
    env = cli_env(tmp_path / "home", RALPH_WARM_DIR=str(tmp_path / "warm"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    try:
        done = subprocess.run(
            ["bash", "-c", "\n".join(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            timeout=BOUND_S * 4,
            stdin=subprocess.DEVNULL,
        )
    finally:  # a page that starts a warm server and fails before it stops it
        subprocess.run([sys.executable, "-m", "ralph_mail", "warm", "stop"], env=env,
                       capture_output=True, timeout=BOUND_S, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert b"Traceback" not in done.stderr


def run_python(code: str, tmp_path: Path) -> None:
    """Run one Python example to completion in a fresh home under ``tmp_path``."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=cli_env(tmp_path / "home"),
        capture_output=True,
        timeout=BOUND_S,
    )
    assert done.returncode == 0, done.stderr.decode()
