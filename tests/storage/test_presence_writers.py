"""An agent's presence is saved by every process of the agent (its runner, its MCP
server, a `ralph-mail presence` command): the last saved is the one read, whichever
process saved it and however many records the others saved before, on every backend."""

from __future__ import annotations

from pathlib import Path

from ralph_mail import Team, load_team


def test_the_last_presence_saved_wins_whoever_saved_it(
    team_on_every_backend: Team, home: Path
) -> None:
    """A process that saved many records, then a new one that saves one, then the first
    again: each time the newest save is what every reader reads."""
    one, other, reader = (load_team("demo", home).store for _ in range(3))
    try:
        for n in range(5):
            one.save_presence("worker-1", f"one {n}".encode())
        other.save_presence("worker-1", b"other, once")
        assert reader.load_presence("worker-1") == b"other, once"
        for n in range(10):
            other.save_presence("worker-1", f"other {n}".encode())
        one.save_presence("worker-1", b"one again")
        assert reader.load_presence("worker-1") == b"one again"
    finally:
        for store in (one, other, reader):
            store.close()
