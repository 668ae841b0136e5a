"""Channels with @mentions (DESIGN §10): posts, per-member cursors, mentions and turns.

The library tests run on every backend; the command-line and cross-process tests on the
file backend, with real processes.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, MessageType, create_team
from ralph_mail.errors import InvalidMessage, PermissionDenied, RateLimited
from ralph_mail.talk.channels import delay_of, mentions
from tests.helpers.backends import BACKENDS, backend_url
from tests.helpers.processes import BOUND_S, Processes, cli_env, ralph


@pytest.fixture(params=BACKENDS)
def buses(
    request: pytest.FixtureRequest, home: Path, tmp_path: Path
) -> Iterator[dict[str, MessageBus]]:
    """Team 'demo' (lead, a, b, c) on the backend under test; a bus per member, and a
    channel #standup of all four."""
    url = backend_url(request.param, tmp_path) or None
    create_team("demo", ["lead", "a", "b", "c"], home=home, backend=url)
    made = {name: MessageBus("demo", name, home, backend=url) for name in ("lead", "a", "b", "c")}
    made["lead"].channels.create("standup", ["a", "b", "c"])
    yield made
    for bus in made.values():
        bus.close()


def test_posts_are_read_once_per_member_and_kept_in_history(buses: dict[str, MessageBus]) -> None:
    """Each member reads each post once from its own cursor, its own posts left out;
    history shows the last posts oldest first; ``to`` is ``#NAME``."""
    lead, a, b = buses["lead"], buses["a"], buses["b"]
    first = lead.channel_post("standup", "morning")
    a.channel_post("#standup", "hi", reply_to=first.id)
    assert first.to_agent == "#standup"
    assert [p.content for p in b.channel_read("standup")] == ["morning", "hi"]
    assert b.channel_read("standup") == []
    assert [p.content for p in a.channel_read("standup")] == ["morning"]
    assert [p.content for p in lead.channel_history("standup", 1)] == ["hi"]
    assert [p.reply_to for p in lead.channel_history("standup")] == [None, first.id]
    assert b.poll() == []  # a post without mentions triggers no one


def test_mentions_trigger_members_in_order_and_unknown_names_are_refused(
    buses: dict[str, MessageBus],
) -> None:
    """``@name`` puts a ``mention`` in that member's inbox with its turn; ``@all`` is
    everyone but the poster; an unknown ``@name`` is refused, naming the members, and
    nothing is posted."""
    lead = buses["lead"]
    post = lead.channel_post("standup", "@c and @a, then @b. (mail me@example.com)")
    assert post.metadata["mentions"] == "c,a,b"
    turns = {n: buses[n].poll() for n in "abc"}
    for turn, name in enumerate("cab"):
        (mention,) = turns[name]
        assert mention.type == MessageType.MENTION and mention.reply_to == post.id
        assert mention.metadata["turn"] == str(turn) and mention.metadata["channel"] == "standup"
    everyone = buses["b"].channel_post("standup", "@all standup time")
    assert everyone.metadata["mentions"] == "lead,a,c"
    with pytest.raises(InvalidMessage, match=r"@zed is not a member of #standup \(members: "):
        lead.channel_post("standup", "@zed hello")
    assert [p.id for p in lead.channel_history("standup")] == [post.id, everyone.id]


def test_answers_come_in_mention_order_each_after_the_earlier_ones(
    buses: dict[str, MessageBus],
) -> None:
    """The first mentioned goes at once; the next waits until every earlier one answered
    or passed; one who answered (or passed) is done."""
    lead, a, b, c = (buses[n] for n in ("lead", "a", "b", "c"))
    post = lead.channel_post("standup", "@a @b @c status?")
    got = {n: buses[n].poll()[0] for n in "abc"}
    assert [buses[n].channels.turn(got[n]).standing for n in "abc"] == ["go", "wait", "wait"]
    a.channel_post("standup", "parsing", reply_to=post.id)
    assert [buses[n].channels.turn(got[n]).standing for n in "abc"] == ["done", "go", "wait"]
    b.channels.pass_turn("standup", post.id)
    assert [buses[n].channels.turn(got[n]).standing for n in "abc"] == ["done", "done", "go"]
    assert c.channels.wait_turn(got["c"], timeout=BOUND_S) == "go"


def test_a_waiting_turn_wakes_when_the_earlier_member_answers(
    buses: dict[str, MessageBus],
) -> None:
    """wait_turn blocks on the channel's changes (no polling) and returns when it is my
    turn."""
    post = buses["lead"].channel_post("standup", "@a @b go")
    mention = buses["b"].poll()[0]
    timer = threading.Timer(0.1, lambda: buses["a"].channel_post("standup", "x", post.id))
    timer.start()
    try:
        assert buses["b"].channels.wait_turn(mention, timeout=BOUND_S) == "go"
    finally:
        timer.join()
    assert buses["b"].channels.wait_turn(mention, timeout=0) == "go"


def test_a_member_who_left_or_timed_out_takes_no_turn(
    buses: dict[str, MessageBus], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mentioned member who leaves mid-turn is skipped; with channel_turn_timeout 0 a
    silent earlier member's turn is over at once."""
    lead = buses["lead"]
    post = lead.channel_post("standup", "@a @b hello")
    mention = buses["b"].poll()[0]
    assert buses["b"].channels.turn(mention).standing == "wait"
    buses["a"].channels.leave("standup")
    assert buses["b"].channels.turn(mention).standing == "go"
    with pytest.raises(PermissionDenied, match="a is not a member of #standup: join it"):
        buses["a"].channel_post("standup", "late", reply_to=post.id)
    buses["a"].channels.join("standup")
    assert buses["a"].channel_read("standup") == []  # a joiner reads from now on
    monkeypatch.setenv("RALPH_CHANNEL_TURN_TIMEOUT", "0")
    lead.channel_post("standup", "@b @c again")
    later = buses["c"].poll()[0]
    assert buses["c"].channels.turn(later).standing == "go"


def test_policy_and_rates_apply_to_mentions(buses: dict[str, MessageBus]) -> None:
    """A mention is contact: a deny rule refuses it (exit 4), a rate limit counts it, and
    counts a post without mentions too (DESIGN §9.4: everything an agent starts)."""
    from ralph_mail.govern import policy

    lead = buses["lead"]
    rules = {"rules": [{"from": "lead", "to": "c", "permission": "deny"}], "rates": {"lead": 3}}
    lead.store.save_state(policy.KEY, orjson.dumps(rules))
    with pytest.raises(PermissionDenied):
        lead.channel_post("standup", "@c hi")
    lead.channel_post("standup", "no mention: counted too")
    lead.channel_post("standup", "@a one")
    lead.channel_post("standup", "@b two")
    with pytest.raises(RateLimited):
        lead.channel_post("standup", "@a three")


def test_mentions_past_the_depth_limit_start_nothing(buses: dict[str, MessageBus]) -> None:
    """A post answering a mention whose chain reached max_depth is posted, but its
    mentions start no more answers (the seeds' loop guard)."""
    chain = ("lead", "a", "b")
    post = buses["c"].channels.post("standup", "@a over to you", chain=chain)
    assert post.metadata["mentions"] == "a"
    assert buses["a"].poll() == []


def test_mention_parsing_and_the_pause_between_answers() -> None:
    """Mentions are found in order, once each, not inside words or addresses; the pause
    is 1 to N seconds, the same for the same post and agent."""
    from ralph_mail.talk.channels import Channel

    channel = Channel("x", ("lead", "a.b", "c"))
    assert mentions("@a.b, @c and @c again; x@c @lead.", channel, "lead") == ["a.b", "c"]
    assert mentions("@all", channel, "c") == ["lead", "a.b"]
    pauses = [delay_of(f"{n:012x}", "a", 5) for n in range(50)]
    assert all(1.0 <= p <= 5.0 for p in pauses) and len(set(pauses)) > 40
    assert delay_of("0" * 12, "a", 5) == delay_of("0" * 12, "a", 5)
    assert delay_of("0" * 12, "a", 0) == 0.0


def test_mentions_match_names_regardless_of_case() -> None:
    """@Writer mentions writer; @ALL everyone; where two members differ only in case the
    exact name wins and a spelling that matches neither exactly is refused."""
    from ralph_mail.talk.channels import Channel

    channel = Channel("x", ("lead", "writer", "Bob", "bob"))
    assert mentions("@Writer, then @WRITER.", channel, "lead") == ["writer"]
    assert mentions("@ALL", channel, "writer") == ["lead", "Bob", "bob"]
    assert mentions("@Bob and @bob", channel, "lead") == ["Bob", "bob"]
    with pytest.raises(InvalidMessage, match="@BOB is not a member"):
        mentions("@BOB", channel, "lead")


def test_channel_commands(team: object, home: Path) -> None:
    """The CLI: create, list, post (prints the id), read (exit 0 and no output when nothing is new),
    history --json, pass, join/leave; bad input is one line and exit 2."""

    def cli(*args: str, agent: str = "lead") -> subprocess.CompletedProcess[bytes]:
        return ralph(home, "channel", *args, "--team", "demo", "--agent", agent)

    assert cli("create", "ops", "--member", "worker-1").stdout == b"#ops: lead, worker-1\n"
    post_id = cli("post", "ops", "@worker-1 deploy?").stdout.strip().decode()
    assert len(post_id) == 12
    read = cli("read", "ops", "--json", agent="worker-1")
    assert read.returncode == 0 and orjson.loads(read.stdout)["id"] == post_id
    nothing_new = cli("read", "ops", agent="worker-1")  # nothing new: no output, exit 0
    assert (nothing_new.returncode, nothing_new.stdout) == (0, b"")
    listed = ralph(home, "channel", "list", "--json", "--team", "demo")
    assert orjson.loads(listed.stdout)["members"] == ["lead", "worker-1"]
    history = ralph(home, "channel", "history", "ops", "--json", "--team", "demo")
    assert [orjson.loads(x)["id"] for x in history.stdout.splitlines()] == [post_id]
    assert cli("pass", "ops", post_id, agent="worker-1").returncode == 0
    unknown = cli("post", "ops", "@worker-2 hi")
    assert unknown.returncode == 2 and unknown.stderr.count(b"\n") == 1
    assert b"@worker-2 is not a member of #ops (members: lead, worker-1)" in unknown.stderr
    assert cli("join", "ops", agent="worker-2").stdout == b"#ops: lead, worker-1, worker-2\n"
    assert cli("post", "ops", "@worker-2 hi").returncode == 0
    outsider = cli("leave", "ops", agent="worker-1")
    assert outsider.returncode == 0
    refused = cli("post", "ops", "hi", agent="worker-1")
    assert refused.returncode == 4 and b"not a member of #ops" in refused.stderr
    missing = cli("post", "nope", "hi")
    assert missing.returncode == 2 and b"no channel #nope (channels: #ops)" in missing.stderr
    assert ralph(home, "channel", "create", "ops", "--team", "demo", "--all").returncode == 2


def test_read_to_a_full_disk_consumes_nothing(team: object, home: Path) -> None:
    """``channel read > /dev/full``: one error line, exit 2, every post still unread."""
    ralph(home, "channel", "create", "x", "--all", "--team", "demo", "--agent", "lead")
    for n in range(3):
        ralph(home, "channel", "post", "x", f"post {n}", "--team", "demo", "--agent", "lead")
    env = cli_env(home, RALPH_TEAM="demo", RALPH_AGENT="worker-1")
    shell = f"{sys.executable} -m ralph_mail channel read x > /dev/full"
    full = subprocess.run(["sh", "-c", shell], env=env, capture_output=True, timeout=BOUND_S)
    assert full.returncode == 2 and full.stderr.count(b"\n") == 1, full.stderr
    rest = ralph(home, "channel", "read", "x", "--team", "demo", "--agent", "worker-1")
    assert [line.split()[-2] for line in rest.stdout.splitlines()] == [b"0", b"1", b"2"] or (
        rest.stdout.count(b"post ") == 3
    )


def read_lines(proc: subprocess.Popen[bytes], count: int) -> list[bytes]:
    """``count`` lines of ``proc``'s stdout, waiting at most BOUND_S in all."""
    assert proc.stdout is not None
    fd, data = proc.stdout.fileno(), b""
    deadline = time.monotonic() + BOUND_S
    while data.count(b"\n") < count:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], f"got {data!r:.200}"
        chunk = os.read(fd, 1 << 16)
        assert chunk, "the process ended"
        data += chunk
    return data.splitlines()


def test_sixteen_posters_and_viewers_following(team: object, home: Path, procs: Processes) -> None:
    """16 processes post 50 each into one channel while two viewers follow it with
    ``channel tail -f``: each viewer sees every post once, each poster's in its order."""
    ralph(home, "channel", "create", "busy", "--all", "--team", "demo", "--agent", "lead")
    ralph(home, "channel", "post", "busy", "start", "--team", "demo", "--agent", "lead")
    env = cli_env(home, RALPH_TEAM="demo")
    viewers = []
    for _ in range(2):
        viewer = subprocess.Popen(
            [sys.executable, "-m", "ralph_mail", "channel", "tail", "busy", "-n", "1", "-f",
             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )  # fmt: skip
        procs.started.append(viewer)
        assert b'"start"' in read_lines(viewer, 1)[0]  # following from here on
        viewers.append(viewer)
    code = (
        "import sys\nfrom ralph_mail import MessageBus\n"
        "bus = MessageBus('demo', 'lead')\n"
        "for n in range(50): bus.channel_post('busy', f'{sys.argv[1]} {n}')\n"
    )
    posters = [procs.python(code, str(p), env=env) for p in range(16)]
    for poster in posters:
        assert poster.wait(timeout=BOUND_S) == 0, poster.stderr.read()  # type: ignore[union-attr]
    for viewer in viewers:
        seen: dict[str, list[int]] = {}
        for line in read_lines(viewer, 16 * 50):
            who, n = orjson.loads(line)["content"].split()
            seen.setdefault(who, []).append(int(n))
        viewer.kill()
        assert seen == {str(p): list(range(50)) for p in range(16)}


def test_three_runners_answer_a_standup_in_mention_order(
    team: object, home: Path, procs: Processes
) -> None:
    """Each mentioned runner answers after the one mentioned before it, seeing its
    answer; empty output passes the turn; a failing command passes it too."""
    from tests.helpers.processes import runner, wait_until

    create_team("crew", ["lead", "w", "x", "y", "z"], home=home)
    env = cli_env(home, RALPH_TEAM="crew")
    subprocess.run([sys.executable, "-m", "ralph_mail", "channel", "create", "standup", "--all",
                    "--agent", "lead"], env=env, check=True, timeout=BOUND_S)  # fmt: skip
    said = 'echo "$RALPH_AGENT ($RALPH_PATTERN in #$RALPH_CHANNEL) saw $(grep -c "^\\[" )"'
    runner(procs, home, "w", said, team="crew")
    runner(procs, home, "x", "cat > /dev/null", team="crew")  # says nothing: passes
    runner(procs, home, "y", "exit 3", team="crew")  # fails: passes
    runner(procs, home, "z", said, team="crew")
    lead = MessageBus("crew", "lead", home)
    post = lead.channel_post("standup", "@z @x @y @w what are you on?")
    view = MessageBus("crew", "lead", home)
    deadline_posts: list[str] = []

    def answered() -> bool:
        deadline_posts[:] = [p.content for p in view.channel_history("standup") if p.reply_to]
        return len(deadline_posts) == 2

    wait_until(answered, "two answers")
    # z is first: it sees the history header and the request header; w sees z's answer too
    assert deadline_posts[0].startswith("z (mention in #standup) saw")
    assert deadline_posts[1].startswith("w (mention in #standup) saw")
    assert int(deadline_posts[1].split()[-1]) > int(deadline_posts[0].split()[-1])
    passes = lead.store.log_read("channel.standup").splitlines()
    assert sorted(orjson.loads(x)["agent"] for x in passes) == ["x", "y"]
    assert all(orjson.loads(x)["post"] == post.id for x in passes)
    lead.close()
    view.close()


def test_gc_compacts_a_channel_to_its_least_advanced_member(team: object, home: Path) -> None:
    """gc cuts a channel's log where every member has read (archiving what it drops, so
    search still finds it); a member's unread posts stay."""
    lead, one = MessageBus("demo", "lead", home), MessageBus("demo", "worker-1", home)
    lead.channels.create("ops", ["worker-1"])
    for n in range(5):
        lead.channel_post("ops", f"deploy step{n}")
    assert len(one.channel_read("ops")) == 5
    assert ralph(home, "gc", "--team", "demo").returncode == 0
    assert lead.store.inbox_state("#ops").base == 0  # type: ignore[attr-defined]
    assert lead.channel_read("ops") == []  # the lead's own posts: read past, not shown
    done = ralph(home, "gc", "--team", "demo")
    assert done.returncode == 0, done.stderr
    assert one.channel_read("ops") == [] and len(lead.channel_history("ops")) == 5
    assert lead.store.inbox_state("#ops").base > 0  # type: ignore[attr-defined]
    assert [m.content for m in lead.search("step3")] == ["deploy step3"]
    lead.channel_post("ops", "deploy step5")
    assert [p.content for p in one.channel_read("ops")] == ["deploy step5"]
    lead.close()
    one.close()


def test_a_runner_killed_mid_mention_answers_once_when_started_again(
    team: object, home: Path, procs: Processes, tmp_path: Path
) -> None:
    """kill -9 of the runner while its child answers a mention: a new runner answers it
    once; a mention answered before the kill (not yet consumed) starts no run again."""
    import contextlib
    import signal

    from tests.helpers.processes import runner, wait_until

    lead = MessageBus("demo", "lead", home)
    lead.channels.create("ops", ["worker-1"])
    runs, pid_file = tmp_path / "runs", tmp_path / "child.pid"
    script = (f"echo $$ > {pid_file}; echo run >> {runs}; [ -e {tmp_path}/go ] || sleep 300; "
              "echo on it")  # fmt: skip
    first = runner(procs, home, "worker-1", script)
    post = lead.channel_post("ops", "@worker-1 deploy?")
    wait_until(lambda: runs.exists() and pid_file.exists(), "the child to start")
    orphan = int(pid_file.read_text())
    first.kill()
    first.wait(timeout=BOUND_S)
    try:
        (tmp_path / "go").touch()
        second = runner(procs, home, "worker-1", script)

        def answers() -> list[str]:
            return [p.content for p in lead.channel_history("ops") if p.reply_to == post.id]

        wait_until(lambda: answers() == ["on it"], "the answer")
        second.kill()
        second.wait(timeout=BOUND_S)
        # Answered by hand, mention left unread: what a kill after answering leaves. The
        # runner is gone first, or it could take the mention before the answer is written.
        later = lead.channel_post("ops", "@worker-1 and now?")
        one = MessageBus("demo", "worker-1", home)
        one.channel_post("ops", "done already", reply_to=later.id)
        one.close()
        third = runner(procs, home, "worker-1", script)
        wait_until(lambda: not _unread(home, "worker-1"), "the mention consumed")
        third.terminate()
        assert third.wait(timeout=BOUND_S) == 0
        assert runs.read_text().count("run") == 2  # the killed run, and the one after it
        assert answers() == ["on it"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(orphan), signal.SIGKILL)
        lead.close()


def _unread(home: Path, agent: str) -> list[object]:
    from ralph_mail.talk.history import History

    view = History("demo", [agent], home)
    try:
        return list(view.unread(agent))
    finally:
        view.close()
