"""`ralph-mail serve` over HTTP, without a browser: the access token, the page's state
and live feed, its acts (approve, deny, answer) and a clean stop, against a real server
process and in process with Starlette's TestClient."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="needs the serve extra: pip install 'ralph_mail[serve]'")
pytest.importorskip("uvicorn", reason="needs the serve extra: pip install 'ralph_mail[serve]'")

import httpx
from starlette.testclient import TestClient

from ralph_mail import MessageBus, Team, create_team
from ralph_mail.govern.policy import Rule
from ralph_mail.serve import loopback
from ralph_mail.serve.app import COOKIE, build
from ralph_mail.serve.team import TeamView
from ralph_mail.team import load_team, update_team
from tests.helpers.processes import BOUND_S, Processes, cli_env, ralph
from tests.helpers.serving import first_line, serve

TOKEN = "test-token-0123456789"


@pytest.fixture
def people(home: Path) -> Team:
    """Team 'demo': lead, alice (a person), writer."""
    create_team("demo", ["lead", ("alice", "decides releases"), ("writer", "writes")], home=home)
    update_team("demo", home, member="alice", human=True)
    return load_team("demo", home)


@pytest.fixture
def client(people: Team) -> Iterator[TestClient]:
    """The app in process (its lifespan run: the team followed), with the token."""
    view = TeamView("demo", str(people.home))
    with TestClient(build(view, TOKEN), headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def hold_a_send(home: Path) -> str:
    """writer's message to lead held for approval (a rule says so); its id."""
    lead = MessageBus("demo", "lead", home)
    lead.change_policy(lambda p: p.with_rule(Rule("writer", "lead", "allow", approval=True)))
    lead.close()
    with MessageBus("demo", "writer", home) as writer:
        held = writer.send("lead", "text", "may I publish the draft?")
    assert not held.ts  # held, not delivered
    return held.id


# -- the token ------------------------------------------------------------------------------


def test_every_request_needs_the_token(people: Team) -> None:
    app = build(TeamView("demo", str(people.home)), TOKEN)
    with TestClient(app) as anyone:
        for path in ("/", "/api/state", "/events", "/page.js"):
            refused = anyone.get(path)
            assert refused.status_code == 401, path
            assert "access token" in refused.text
        assert (
            anyone.get("/api/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
        )
        assert anyone.get("/?token=wrong").status_code == 401
        assert anyone.post("/api/approve", json={"id": "0" * 12}).status_code == 401
        # once in the query, then the cookie alone
        page = anyone.get(f"/?token={TOKEN}")
        assert page.status_code == 200 and "team demo" in page.text
        assert "SameSite=Strict" in page.headers["set-cookie"]
        assert "HttpOnly" in page.headers["set-cookie"]
        assert anyone.cookies.get(COOKIE) == TOKEN
        assert anyone.get("/api/state").status_code == 200


def test_the_state_shows_roster_tasks_messages_approvals_and_questions(
    client: TestClient, people: Team
) -> None:
    with MessageBus("demo", "lead", people.home) as lead:
        lead.send("writer", "text", "draft the post", visibility="user_visible")
        lead.send("writer", "text", "internal note")
    held = hold_a_send(people.home)
    state = client.get("/api/state").json()
    assert [(m["name"], m["human"]) for m in state["members"]] == [
        ("lead", False), ("alice", True), ("writer", False)]  # fmt: skip
    alice = next(m for m in state["members"] if m["name"] == "alice")
    assert alice["presence"] != "offline"  # the page serves her: she is reachable
    kinds = [(m["type"], m["visibility"]) for m in state["messages"]]
    assert kinds == [("text", "user_visible"), ("text", "internal"),
                     ("approval_request", "internal")]  # fmt: skip
    assert [m["content"] for m in state["messages"][:2]] == ["draft the post", "internal note"]
    (waiting,) = state["approvals"]
    assert (waiting["id"], waiting["from"], waiting["to"], waiting["approver"]) == (
        held, "writer", "lead", "lead")  # fmt: skip
    assert state["questions"] == [] and state["tasks"] == []


def test_approve_delivers_the_held_message_and_deny_does_not(
    client: TestClient, people: Team
) -> None:
    first = hold_a_send(people.home)
    answer = client.post("/api/approve", json={"id": first})
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == first
    with MessageBus("demo", "lead", people.home) as lead:
        delivered = [(m.id, m.content) for m in lead.peek() if m.type == "text"]
        assert delivered == [(first, "may I publish the draft?")]
    with MessageBus("demo", "writer", people.home) as writer:
        second = writer.send("lead", "text", "and this one?").id
    assert client.post("/api/deny", json={"id": second, "reason": "no"}).status_code == 200
    with MessageBus("demo", "lead", people.home) as lead:
        assert [m.id for m in lead.peek() if m.type == "text"] == [first]
    assert client.get("/api/state").json()["approvals"] == []
    # twice, or unknown, or badly posted: one line why, and nothing happens
    again = client.post("/api/deny", json={"id": first})
    assert again.status_code == 400 and "already approved" in again.json()["error"]
    assert client.post("/api/approve", json={"id": "0" * 12}).status_code == 400
    assert client.post("/api/approve", json={"id": 5}).status_code == 400
    assert client.post("/api/approve", content=b"id=1").status_code == 415
    bad = client.post("/api/approve", content=b"[", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "not a JSON object" in bad.json()["error"]


def test_an_answer_from_the_page_reaches_a_real_ask(client: TestClient, people: Team) -> None:
    asking = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "ask", "alice", "Ship on Friday?", "--team",
         "demo", "--agent", "writer", "--timeout", str(BOUND_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(people.home),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + BOUND_S
        while not (questions := client.get("/api/state").json()["questions"]):
            assert asking.poll() is None, asking.communicate()
            assert time.monotonic() < deadline, "the question never showed"
            time.sleep(0.05)
        (question,) = questions
        assert (question["from"], question["to"], question["content"]) == (
            "writer", "alice", "Ship on Friday?")  # fmt: skip
        said = client.post("/api/answer", json={"id": question["id"], "text": "Yes, ship it"})
        assert said.status_code == 200, said.text
        out, err = asking.communicate(timeout=BOUND_S)
        assert asking.returncode == 0, err
        assert out.decode().strip() == "Yes, ship it"
        assert client.get("/api/state").json()["questions"] == []
        again = client.post("/api/answer", json={"id": question["id"], "text": "again"})
        assert again.status_code == 404
    finally:
        if asking.poll() is None:
            asking.kill()
        asking.communicate()


def test_only_a_human_members_questions_are_the_pages(client: TestClient, people: Team) -> None:
    with MessageBus("demo", "writer", people.home) as writer:
        writer.send("lead", "request", "a question for a program")
    assert client.get("/api/state").json()["questions"] == []


# -- a real server --------------------------------------------------------------------------


def feed_events(served_base: str, headers: dict[str, str], count: int, found: list[dict]) -> None:
    """Read ``count`` events of the live feed into ``found``."""
    with httpx.stream("GET", f"{served_base}/events", headers=headers, timeout=BOUND_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                found.append(json.loads(line[6:]))
                if len(found) >= count:
                    return


def test_the_live_feed_sends_what_changed_and_sigterm_stops_the_server(
    procs: Processes, people: Team
) -> None:
    served = serve(procs, people.home)
    found: list[dict] = []
    reader = threading.Thread(target=feed_events, args=(served.base, served.auth, 2, found))
    reader.start()
    deadline = time.monotonic() + BOUND_S
    while not found:
        assert time.monotonic() < deadline, "no first event"
        time.sleep(0.02)
    assert found[0]["messages"] == []
    with MessageBus("demo", "lead", people.home) as lead:
        lead.send("writer", "text", "hello, page", visibility="user_visible")
    reader.join(BOUND_S)
    assert not reader.is_alive(), "the change never came over the feed"
    assert [m["content"] for m in found[1]["messages"]] == ["hello, page"]
    # a feed is open while it is told to stop: it still ends at once, exit 0
    still: list[dict] = []
    threading.Thread(target=feed_events, args=(served.base, served.auth, 99, still),
                     daemon=True).start()  # fmt: skip
    while not still:
        assert time.monotonic() < deadline, "no event on the second feed"
        time.sleep(0.02)
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=BOUND_S) == 0, served.proc.stderr.read()
    assert served.proc.stderr.read() == b""
    state = load_team("demo", people.home)
    from ralph_mail.govern.presence import presence_of

    assert presence_of(state, "alice")[0] == "offline"  # no page serves her now


def test_the_server_refuses_without_the_token(procs: Processes, people: Team) -> None:
    served = serve(procs, people.home)
    assert httpx.get(f"{served.base}/api/state", timeout=BOUND_S).status_code == 401
    ok = httpx.get(f"{served.base}/api/state", headers=served.auth, timeout=BOUND_S)
    assert ok.status_code == 200 and ok.json()["team"] == "demo"
    other = serve(procs, people.home)
    assert other.token != served.token  # a fresh token each run
    wrong = {"Authorization": f"Bearer {served.token}"}
    assert httpx.get(f"{other.base}/api/state", headers=wrong, timeout=BOUND_S).status_code == 401


def test_beyond_loopback_it_warns(procs: Processes, people: Team) -> None:
    child = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "serve", "--team", "demo", "--host", "0.0.0.0",
         "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(people.home),
    )  # fmt: skip
    procs.started.append(child)
    warning = first_line(child, "stderr").decode()
    assert warning.startswith("ralph-mail: warning: serving on 0.0.0.0, beyond this machine")
    assert first_line(child).startswith(b"serving team demo at http://0.0.0.0:")
    assert [loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost")] == [True] * 4
    assert [loopback(h) for h in ("0.0.0.0", "::", "192.168.1.2", "example.org")] == [False] * 4


def test_bad_input_is_one_line_and_its_exit_code(people: Team) -> None:
    unknown = ralph(people.home, "serve", "--team", "nope", "--port", "0")
    assert unknown.returncode == 2
    assert unknown.stderr.decode().startswith("ralph-mail: error: no team 'nope'")
    assert b"Traceback" not in unknown.stderr
    port = ralph(people.home, "serve", "--team", "demo", "--port", "70000")
    assert port.returncode == 2 and b"--port" in port.stderr
    host = ralph(people.home, "serve", "--team", "demo", "--host", "192.0.2.1", "--port", "0")
    assert host.returncode == 2, host.stderr
    assert host.stderr.decode().startswith("ralph-mail: error: cannot listen on 192.0.2.1:0")
    assert host.stderr.count(b"\n") <= 2  # the warning, then the one line why


def test_team_set_marks_a_member_human(people: Team) -> None:
    assert load_team("demo", people.home).member("alice").human
    done = ralph(people.home, "team", "set", "demo", "alice", "--human", "no", "--agent", "lead")
    assert done.returncode == 0, done.stderr
    assert not load_team("demo", people.home).member("alice").human
    shown = ralph(people.home, "team", "set", "demo", "writer", "--human", "yes", "--agent", "lead")
    assert shown.returncode == 0
    assert b"writer\tmember (human)" in ralph(people.home, "team", "show", "demo").stdout
    refused = ralph(people.home, "team", "set", "demo", "writer", "--human", "no",
                    "--agent", "writer")  # fmt: skip
    assert refused.returncode == 4, refused.stderr
    bad = ralph(people.home, "team", "set", "demo", "writer", "--human", "maybe", "--agent", "lead")
    assert bad.returncode == 2 and b"give yes or no" in bad.stderr


def test_the_page_marks_a_bad_signature(client: TestClient, people: Team) -> None:
    """writer signs; its line edited on disk comes to the page with seal BAD-SIGNATURE,
    its untouched one with none."""
    from ralph_mail.govern import keys

    with MessageBus("demo", "writer", people.home) as writer:
        keys.create(writer)
        writer.send("lead", "text", "pay 10")
        writer.send("lead", "text", "all good")
    inbox = people.home / "teams" / "demo" / "mailbox" / "lead.jsonl"
    inbox.write_bytes(inbox.read_bytes().replace(b"pay 10", b"pay 99"))
    seals = {m["content"]: m["seal"] for m in client.get("/api/state").json()["messages"]}
    assert seals["pay 99"] == "BAD-SIGNATURE"
    assert seals["all good"] == ""
