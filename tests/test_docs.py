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
from conftest import BOUND_S, cli_env

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``text`` in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def console_commands(text: str) -> list[tuple[str, int]]:
    """Every ``$ command`` of the console blocks, with its expected exit code."""
    commands = []
    for block in blocks(text, "console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                command, _, expect = line[2:].partition("  # exit ")
                commands.append((command, int(expect or 0)))
    return commands


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
    script = []
    for number, (command, expect) in enumerate(console_commands(page(name))):
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


@pytest.mark.parametrize(("name", "number"), PYTHON_EXAMPLES)
def test_python_examples_of_each_page_run(tmp_path: Path, name: str, number: int) -> None:
    """Each Python example of a page runs to completion in a fresh home."""
    done = subprocess.run(
        [sys.executable, "-c", blocks(page(name), "python")[number]],
        cwd=tmp_path,
        env=cli_env(tmp_path / "home"),
        capture_output=True,
        timeout=BOUND_S,
    )
    assert done.returncode == 0, done.stderr.decode()


def test_the_pages_run_examples() -> None:
    """The pages hold the examples the README used to (so moving them lost none)."""
    assert sum(len(console_commands(page(name))) for name in PAGES) >= 100
    assert len(PYTHON_EXAMPLES) >= 7


def test_every_page_is_in_the_nav() -> None:
    """mkdocs.yml's nav names each page of docs/ once, and no page that is not there."""
    nav = re.findall(r" (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert sorted(nav) == PAGES


def test_the_readme_links_to_pages_that_exist() -> None:
    """Each docs/ link of the README names a page (or picture) of docs/ that exists."""
    readme = (ROOT / "README.md").read_text()
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
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BOUND_S * 2,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "top.svg").is_file()
