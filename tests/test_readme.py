"""The README is executable: its commands and its Python examples run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BOUND_S, cli_env

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    """The fenced code blocks of the README in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def console_commands() -> list[tuple[str, int]]:
    """Every ``$ command`` of the console blocks, with its expected exit code."""
    commands = []
    for block in blocks("console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                command, _, expect = line[2:].partition("  # exit ")
                commands.append((command, int(expect or 0)))
    return commands


def test_readme_console_commands_run_in_order(tmp_path: Path) -> None:
    """Every console command of the README exits as documented, with no traceback."""
    script = []
    for number, (command, expect) in enumerate(console_commands()):
        script.append(command)
        script.append(
            f'rc=$?; if [ $rc -ne {expect} ]; then echo "command {number} exited $rc, '
            f'not {expect}: {command!r}" >&2; exit 99; fi'
        )
    env = cli_env(tmp_path / "home")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=BOUND_S * 4,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert b"Traceback" not in done.stderr
    assert len(console_commands()) >= 12


@pytest.mark.parametrize("number", range(len(blocks("python"))))
def test_readme_python_examples_run(tmp_path: Path, number: int) -> None:
    """Each Python example of the README runs to completion in a fresh home."""
    done = subprocess.run(
        [sys.executable, "-c", blocks("python")[number]],
        cwd=tmp_path,
        env=cli_env(tmp_path / "home"),
        capture_output=True,
        timeout=BOUND_S,
    )
    assert done.returncode == 0, done.stderr.decode()


def test_quick_start_test_command_is_what_ci_runs() -> None:
    """The README's test command is the one .ci/run runs; its first command runs the demo."""
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    demo, tests = re.findall(r"^```sh\n(.*?)\n```", quick_start, flags=re.S | re.M)
    assert demo.endswith("ralph-mail demo")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests.split("&& ", 1)[1] in ci.replace('"$venv"/bin', ".venv/bin")
