"""Discovery and presence: the roster's new fields, team settings, and who is online."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ralph_mail import InvalidMessage, InvalidName, MessageBus, Team, load_team
from ralph_mail.team import update_team
from tests.helpers.processes import BOUND_S, Processes, cli_env

WAITER = """
from ralph_mail import MessageBus
bus = MessageBus("demo", "worker-1")
bus.poll()  # claims the inbox: the process is attached from here on
print("ready", flush=True)
bus.wait_for_messages(timeout=60)
"""


def test_agents_lists_the_teammates_with_their_roster_fields(team: Team) -> None:
    """agents() is every member but me, with description, role, manager and mode."""
    update_team("demo", member="worker-1", manager="lead", mode="supervised")
    found = {a.name: a for a in MessageBus("demo", "lead").agents()}
    assert sorted(found) == ["worker-1", "worker-2"]
    one = found["worker-1"]
    assert (one.description, one.role, one.manager, one.mode) == (
        "parses logs", "member", "lead", "supervised"
    )  # fmt: skip
    assert next(a.name for a in MessageBus("demo", "lead").agents(include_self=True)) == "lead"


def test_update_team_sets_config_and_clears_a_manager(team: Team) -> None:
    """Team settings are saved; an empty manager clears it."""
    update_team("demo", member="worker-1", manager="lead", config={"max_depth": "5"})
    update_team("demo", member="worker-1", manager="")
    saved = load_team("demo")
    assert saved.config == {"max_depth": "5"} and saved.member("worker-1").manager is None


@pytest.mark.parametrize(
    "change",
    [
        {"member": "worker-1", "mode": "anarchy"},
        {"member": "worker-1", "manager": "nobody"},
        {"member": "worker-1", "manager": "worker-1"},
        {"member": "ghost", "description": "x"},
        {"config": {"max_depth": "three"}},
        {"config": {"colour": "1"}},
    ],
)
def test_bad_team_changes_are_refused_and_nothing_is_written(team: Team, change: dict) -> None:  # type: ignore[type-arg]
    """An unknown member, manager, mode or setting is refused; team.json is unchanged."""
    before = (team.store.root / "team.json").read_bytes()
    with pytest.raises((InvalidName, LookupError)):
        update_team("demo", **change)
    assert (team.store.root / "team.json").read_bytes() == before


def test_an_agent_never_seen_is_offline(team: Team) -> None:
    """A member that never did anything is offline."""
    found = {a.name: a.presence for a in MessageBus("demo", "lead").agents()}
    assert found == {"worker-1": "offline", "worker-2": "offline"}


def test_an_agent_that_just_sent_is_online(team: Team) -> None:
    """Any send makes its agent idle (online) for the presence window."""
    MessageBus("demo", "worker-1").send("lead", "text", "hi")
    found = {a.name: a.presence for a in MessageBus("demo", "lead").agents()}
    assert found["worker-1"] == "idle"


def test_the_activity_window_passes(team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a presence timeout of 0 s, an agent with no live process is offline at once."""
    MessageBus("demo", "worker-1").send("lead", "text", "hi")
    monkeypatch.setenv("RALPH_PRESENCE_TIMEOUT", "0")
    found = {a.name: a.presence for a in MessageBus("demo", "lead").agents()}
    assert found["worker-1"] == "offline"


def test_set_presence_states(team: Team) -> None:
    """working is reported as set; sleeping until a future time is reported with until."""
    worker = MessageBus("demo", "worker-1")
    worker.set_presence("working")
    assert MessageBus("demo", "lead").agents()[0].presence == "working"
    worker.set_presence("sleeping", until="+15m")
    info = MessageBus("demo", "lead").agents()[0]
    assert info.presence == "sleeping" and info.until.endswith("Z")


@pytest.mark.parametrize(
    "state, until, match",
    [("napping", None, "invalid presence"), ("sleeping", None, "needs until"),
     ("sleeping", "+15x", "invalid duration"), ("sleeping", "tomorrow", "invalid time")],
)  # fmt: skip
def test_bad_presence_is_refused(team: Team, state: str, until: str | None, match: str) -> None:
    """Unknown states, sleeping without until, and bad times are refused, naming the fix."""
    with pytest.raises(InvalidMessage, match=match):
        MessageBus("demo", "worker-1").set_presence(state, until)


def test_a_live_consumer_is_online_and_offline_once_killed(
    team: Team, procs: Processes, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    """A process waiting on its inbox keeps its agent online past the activity window;
    killed with -9, the agent is offline: a dead process never looks alive."""
    monkeypatch.setenv("RALPH_PRESENCE_TIMEOUT", "0")
    child = procs.python(WAITER, env=cli_env(home))
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    presence = {a.name: a.presence for a in MessageBus("demo", "lead").agents()}
    assert presence["worker-1"] == "idle"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=BOUND_S)
    presence = {a.name: a.presence for a in MessageBus("demo", "lead").agents()}
    assert presence["worker-1"] == "offline"
