"""What tests import (fixtures stay in tests/conftest.py): processes (running ralph-mail
and Python children, bounded and reaped), backends (the contract suites' backends, a
nats-server), faultkit (the fault suite's sizes and figures), protocol_helpers (children
followed line by line), team_programs (lead and worker programs run as processes) and
markdown_examples (running the console and Python examples of README.md and docs/)."""

from pathlib import Path

#: The repository's root: README.md, docs/, bench/, examples/, pyproject.toml.
REPO = Path(__file__).resolve().parents[2]
