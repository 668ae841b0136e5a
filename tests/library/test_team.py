"""Teams: the roster, the directory layout, permissions, deletion."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import orjson
import pytest

from ralph_mail import (
    InvalidName,
    Team,
    TeamExists,
    TeamNotFound,
    UnknownAgent,
    create_team,
    delete_team,
    list_teams,
    load_team,
)


def test_create_team_writes_roster_and_one_empty_inbox_per_member(team: Team) -> None:
    """team.json lists members, descriptions and roles; mailbox/ holds one empty inbox each."""
    roster = orjson.loads((team.store.root / "team.json").read_bytes())
    assert roster["lead"] == "lead"
    assert [(m["name"], m["description"], m["role"]) for m in roster["members"]] == [
        ("lead", "", "lead"),
        ("worker-1", "parses logs", "member"),
        ("worker-2", "", "member"),
    ]
    inboxes = sorted(p.name for p in (team.store.root / "mailbox").iterdir())
    assert inboxes == ["lead.jsonl", "worker-1.jsonl", "worker-2.jsonl"]
    assert all((team.store.root / "mailbox" / n).stat().st_size == 0 for n in inboxes)


def test_lead_can_be_named(home: Path) -> None:
    """--lead picks the lead; by default it is the first member."""
    assert create_team("t1", ["a", "b"], home=home).lead == "a"
    assert create_team("t2", ["a", "b"], home=home, lead="b").lead == "b"
    assert load_team("t2", home).member("b").role == "lead"


def test_permissions_are_private_whatever_the_umask(home: Path) -> None:
    """Directories are 0700 and files 0600 even under umask 000."""
    old = os.umask(0)
    try:
        team = create_team("open", ["a", "b"], home=home)
    finally:
        os.umask(old)
    for path in [home, home / "teams", *team.store.root.rglob("*"), team.store.root]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), path


@pytest.mark.parametrize(
    "members, error",
    [
        ([], InvalidName),
        (["a", "a"], InvalidName),
        (["ok", "../x"], InvalidName),
        (["*"], InvalidName),
    ],
)
def test_bad_rosters_write_nothing(home: Path, members: list[str], error: type[Exception]) -> None:
    """An invalid roster is refused before any file is touched."""
    with pytest.raises(error):
        create_team("bad", members, home=home)
    assert not (home / "teams" / "bad").exists()


def test_unknown_lead_is_refused(home: Path) -> None:
    """A lead who is not a member is refused, naming the members."""
    with pytest.raises(UnknownAgent, match="members: a, b"):
        create_team("t", ["a", "b"], home=home, lead="c")


def test_existing_team_is_not_overwritten(team: Team) -> None:
    """Creating a team that exists fails and keeps the old one."""
    with pytest.raises(TeamExists):
        create_team("demo", ["x"], home=team.home)
    assert load_team("demo", team.home).names == team.names


def test_missing_team_names_the_known_ones(team: Team) -> None:
    """Loading a missing team says which teams exist and how to create one."""
    with pytest.raises(TeamNotFound, match=r"teams: demo.*team create"):
        load_team("nope", team.home)


def test_list_and_delete(team: Team) -> None:
    """list_teams finds the team; delete_team removes its whole directory."""
    assert [t.name for t in list_teams(team.home)] == ["demo"]
    delete_team("demo", team.home)
    assert list_teams(team.home) == []
    assert not team.store.root.exists()
