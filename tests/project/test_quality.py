"""The code base stays lint-clean, formatted and strictly typed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    found = BIN / name
    if found.exists():
        return str(found)
    located = shutil.which(name)
    if located is None:
        pytest.fail(f"{name} is not installed: pip install '.[test]'")
    return located


@pytest.mark.parametrize(
    "args",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy"]],
    ids=" ".join,
)
def test_tool_is_clean(args: list[str]) -> None:
    """ruff (lint and format) and mypy --strict report nothing."""
    done = subprocess.run(
        [tool(args[0]), *args[1:]], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
