"""The package's shape (DESIGN §7) as tests: the layers and the module sizes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

#: DESIGN §7's ceilings: no module over 700 lines, and the bus a facade of 400.
MAX_LINES = 700
BUS_MAX_LINES = 400


def test_the_layers_of_design_7_hold() -> None:
    """import-linter's contracts (pyproject.toml): each layer imports only from below,
    and no backend module is imported above the store but through its factory."""
    linter = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(linter).exists():
        pytest.skip("import-linter is not installed (the test extra installs it)")
    done = subprocess.run([linter], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]


def test_no_module_grows_past_its_ceiling() -> None:
    """No module is over 700 lines, and MessageBus stays a facade (400)."""
    package = REPO / "ralph_mail"
    sizes = {
        str(path.relative_to(package)): len(path.read_text().splitlines())
        for path in package.rglob("*.py")
    }
    over = {
        name: lines
        for name, lines in sizes.items()
        if lines > (BUS_MAX_LINES if name == "bus.py" else MAX_LINES)
    }
    assert over == {}
