"""A team of three `TeamAgent` workers and the Python lead (``../lead.py``), as processes,
in a temporary mailbox home that is removed at the end::

    python examples/python_team/run.py

Exits with the lead's code: 0 when every task was done and every worker shut down.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ralph_mail import create_team

HERE = Path(__file__).resolve().parent
WORKERS = [
    ("worker-1", "parses logs"),
    ("worker-2", "writes reports"),
    ("worker-3", "checks numbers"),
]


def main() -> int:
    home = tempfile.mkdtemp(prefix="ralph-python-team.")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALPH_")}
    env.update(RALPH_HOME=home, RALPH_TEAM="python-team")
    create_team("python-team", ["lead", *WORKERS], home=home)
    children: list[subprocess.Popen[bytes]] = []
    try:
        # Each child in a process group of its own, so that it can be stopped whole.
        lead = subprocess.Popen(
            [sys.executable, str(HERE.parent / "lead.py")], env=env, process_group=0
        )
        children.append(lead)
        for name, _ in WORKERS:
            worker_env = dict(env, RALPH_AGENT=name)
            children.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "worker.py")], env=worker_env, process_group=0
                )
            )
        status = lead.wait()
        if status == 0:  # every worker accepted the shutdown: they are exiting
            codes = [child.wait(timeout=60) for child in children[1:]]
            status = 1 if any(codes) else 0
        return status
    finally:
        for child in children:  # only after a failure or Ctrl-C is anything still running
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
                child.wait()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
