"""The README is executable: its commands and its Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.markdown_examples import blocks, console_commands, run_console, run_python

README = (REPO / "README.md").read_text()


def test_readme_console_commands_run_in_order(tmp_path: Path) -> None:
    """Every console command of the README exits as documented, with no traceback."""
    run_console(README, tmp_path)
    assert len(console_commands(README)) >= 12


@pytest.mark.parametrize("number", range(len(blocks(README, "python"))))
def test_readme_python_examples_run(tmp_path: Path, number: int) -> None:
    """Each Python example of the README runs to completion in a fresh home."""
    run_python(blocks(README, "python")[number], tmp_path)


def test_quick_start_test_command_is_what_ci_runs() -> None:
    """The README's test command is the one .ci/run runs; its first command runs the demo."""
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    demo, tests = re.findall(r"^```sh\n(.*?)\n```", quick_start, flags=re.S | re.M)
    assert demo.endswith("ralph-mail demo")
    ci = (REPO / ".ci" / "run").read_text()
    assert tests.split("&& ", 1)[1] in ci.replace('"$venv"/bin', ".venv/bin")


def test_readme_is_a_short_front_page() -> None:
    """The README stays a front page (at most 300 lines); the rest is on the site."""
    assert len(README.splitlines()) <= 300
