"""The documentation site is executable and builds: every console example of each page of
docs/ runs in order, each page in a fresh home, as do its Python examples, and
`mkdocs build --strict` finds no broken page, link or anchor."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.markdown_examples import blocks, console_commands, run_console, run_python
from tests.helpers.processes import BOUND_S

DOCS = REPO / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))


def page(name: str) -> str:
    return (DOCS / name).read_text()


CONSOLE_PAGES = [name for name in PAGES if console_commands(page(name))]
PYTHON_EXAMPLES = [
    (name, number) for name in PAGES for number in range(len(blocks(page(name), "python")))
]


@pytest.mark.parametrize("name", CONSOLE_PAGES)
def test_console_commands_of_each_page_run_in_order(tmp_path: Path, name: str) -> None:
    """Every console command of a page exits as documented, with no traceback, in a home
    of its own (a page that needs a team makes it first)."""
    run_console(page(name), tmp_path)


@pytest.mark.parametrize(("name", "number"), PYTHON_EXAMPLES)
def test_python_examples_of_each_page_run(tmp_path: Path, name: str, number: int) -> None:
    """Each Python example of a page runs to completion in a fresh home."""
    run_python(blocks(page(name), "python")[number], tmp_path)


def test_the_pages_run_examples() -> None:
    """The pages hold the examples the README used to (so moving them lost none)."""
    assert sum(len(console_commands(page(name))) for name in PAGES) >= 100
    assert len(PYTHON_EXAMPLES) >= 7


def test_every_page_is_in_the_nav() -> None:
    """mkdocs.yml's nav names each page of docs/ once, and no page that is not there."""
    nav = re.findall(r" (\S+\.md)$", (REPO / "mkdocs.yml").read_text(), re.M)
    assert sorted(nav) == PAGES


def test_the_readme_links_to_pages_that_exist() -> None:
    """Each docs/ link of the README names a page (or picture) of docs/ that exists."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(docs/([^)#]+)", readme)
    assert links
    for link in links:
        assert (DOCS / link).is_file(), link


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`: no warning (a broken link or anchor, a page out of the nav)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material is not installed (pip install '.[test]' brings it)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=BOUND_S * 2,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "top.svg").is_file()
