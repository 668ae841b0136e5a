"""The virtual environment MCP Agent Mail runs in for the ask section's peer row.

``mcp-agent-mail`` 0.1.0 pins ``mcp`` 1.x (through fastmcp 2.13), which conflicts with
this project's ``mcp`` extra, so it never shares our environment: bench drives it with
the Python of an environment of its own (`bench.agent_mail_driver`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

PACKAGE: Final = "mcp-agent-mail==0.1.0"
DRIVER: Final = Path(__file__).with_name("agent_mail_driver.py")


def python(venv: Path | None) -> Path | str:
    """The peer environment's interpreter, or why there is none ("not installed: …")."""
    if venv is None:
        return "not installed: pass --peer-venv PATH (--make-peer-venv creates it)"
    exe = venv / "bin" / "python"
    if not exe.exists():
        return f"not installed: no {exe} (--make-peer-venv creates it)"
    probe = subprocess.run([str(exe), "-c", "import mcp_agent_mail"], capture_output=True,
                           check=False, timeout=120)  # fmt: skip
    if probe.returncode != 0:
        return f"not installed: {venv} lacks mcp_agent_mail (pip install {PACKAGE})"
    return exe


def make(venv: Path) -> str:
    """Create ``venv`` with the peer installed, unless it already has it; "" when done,
    else why not."""
    if not isinstance(python(venv), str):
        return ""
    steps = ([sys.executable, "-m", "venv", str(venv)],
             [str(venv / "bin" / "pip"), "install", "-q", PACKAGE])  # fmt: skip
    for step in steps:
        done = subprocess.run(step, capture_output=True, check=False, timeout=1800)
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip()[-300:]
            return f"cannot make the peer environment ({' '.join(step[:3])}): {tail}"
    return ""


def drive(
    exe: Path, scratch: Path, count: int, poll: float, env: dict[str, str]
) -> dict[str, Any] | str:
    """Run the driver (`DRIVER`) with the peer's Python: its JSON result, or why it failed."""
    done = subprocess.run(
        [str(exe), str(DRIVER), str(scratch), str(count), str(poll)],
        capture_output=True, check=False, timeout=1800, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        return f"failed: exit {done.returncode}: {done.stderr.decode(errors='replace')[-300:]}"
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result
