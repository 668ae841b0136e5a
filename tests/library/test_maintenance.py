"""doctor and gc: scenario 11 (doctor) and 12 (retention), library and command line."""

from __future__ import annotations

import fcntl
import itertools
import os
import signal
import stat
from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, Team, create_team
from ralph_mail.errors import LockTimeout
from ralph_mail.maintenance import collect, doctor
from ralph_mail.store.files import FileStore
from ralph_mail.store.files import doctor as maintenance
from ralph_mail.store.files import inbox as store_module
from ralph_mail.store.files.team import LOGS_KEPT
from tests.helpers.faultkit import SCALES, dead_letters, pick, record
from tests.helpers.processes import BOUND_S, Processes, cli_env, ralph


def inbox(team: Team, agent: str = "lead") -> Path:
    return team.store.root / "mailbox" / f"{agent}.jsonl"


def fill(count: int, start: int = 0) -> None:
    bus = MessageBus("demo", "worker-1")
    for seq in range(start, start + count):
        bus.send("lead", "text", f"m{seq}")


# -- 12. gc -----------------------------------------------------------------------------------


def test_gc_drops_what_the_owner_consumed_and_keeps_the_rest(team: Team) -> None:
    """gc cuts at the committed floor: consumed lines go, unread and peeked-uncommitted stay,
    and the owner's next read continues exactly where it was."""
    fill(10)
    lead = MessageBus("demo", "lead")
    assert len(lead.poll()) == 10
    fill(3, 10)
    peeked = lead.peek()
    lead.commit(peeked[0])
    before = inbox(team).stat().st_size
    result = collect("demo")
    assert result.compactions[0].removed > 0 and inbox(team).stat().st_size < before
    fill(2, 13)
    assert [m.content for m in lead.poll()] == ["m11", "m12", "m13", "m14"]
    assert [m.content for m in MessageBus("demo", "lead").poll()] == []
    size = inbox(team).stat().st_size
    assert collect("demo").removed == size  # all consumed now
    assert inbox(team).stat().st_size == 0
    record(messages=15)


def test_a_sender_new_to_an_inbox_gc_emptied_stamps_no_earlier_and_counts_from_its_base(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender that opens an inbox gc emptied reads the base record after it wrote (it
    rang the waiters first): its ts is not below the last one the inbox had, whatever
    its clock says, and the offset it returns counts from the new base."""
    fill(3)
    lead = MessageBus("demo", "lead")
    last = lead.poll()[-1]
    assert collect("demo").compactions[0].removed > 0 and inbox(team).stat().st_size == 0
    real = store_module.time.time_ns
    monkeypatch.setattr(store_module.time, "time_ns", lambda: real() - 3_600_000_000_000)
    order: list[str] = []
    record = store_module.InboxLog._writer_record

    def reading(log: store_module.InboxLog, inode: int) -> tuple[int, str]:
        order.append("record")
        return record(log, inode)

    monkeypatch.setattr(store_module, "ring", lambda dirs, key: order.append("ring"))
    monkeypatch.setattr(store_module.InboxLog, "_writer_record", reading)
    fresh = MessageBus("demo", "worker-1")
    first = fresh.send("lead", "text", "after gc")  # empty: the record gives the last ts
    second = fresh.send("lead", "text", "again")
    assert first.ts >= last.ts and second.ts >= first.ts
    assert order == ["record", "ring", "ring"]  # once per inode, and before only when empty
    order.clear()
    MessageBus("demo", "worker-2").send("lead", "text", "third")  # not empty: after the ring
    assert order == ["ring", "record"]
    assert [m.content for m in lead.poll()] == ["after gc", "again", "third"]
    size = inbox(team).stat().st_size
    history = [m.content for m in MessageBus("demo", "lead").history("worker-1")]
    assert history[-2:] == ["after gc", "again"] and size > 0


def test_a_lead_of_more_agents_than_it_keeps_open_reads_each_tail_and_base_once(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lead sending to more agents than it keeps inboxes open (`LOGS_KEPT`) reads an
    inbox's tail and base record once: back at an inbox nobody wrote to since, it appends
    from what it knew (`Left`). Where another sender wrote meanwhile, it reads the tail
    again; where gc made a new inode, the record too: ts stay ordered, and the offsets
    it notes count from the new base."""
    names = [f"w{n}" for n in range(LOGS_KEPT + 4)]
    create_team("many", ["lead", *names], home=home)
    lead = MessageBus("many", "lead")
    for name in names:
        lead.send(name, "text", "first")
    reads: list[tuple[str, str]] = []
    probe, record = store_module.InboxLog._probe_tail, store_module.InboxLog._writer_record

    def probing(log: store_module.InboxLog, *args: object) -> int:
        reads.append(("tail", log.agent))
        return probe(log, *args)  # type: ignore[arg-type]

    def recording(log: store_module.InboxLog, inode: int) -> tuple[int, str]:
        reads.append(("record", log.agent))
        return record(log, inode)

    monkeypatch.setattr(store_module.InboxLog, "_probe_tail", probing)
    monkeypatch.setattr(store_module.InboxLog, "_writer_record", recording)
    for name in names:
        lead.send(name, "text", "second")
    assert reads == []
    MessageBus("many", "w1").send("w0", "text", "from w1")  # w0's inbox grew meanwhile
    assert [m.content for m in MessageBus("many", "w2").poll()] == ["first", "second"]
    assert collect("many").compactions  # w2's inbox: a new inode, a new base
    reads.clear()
    for name in names:
        lead.send(name, "text", "third")
    assert ("tail", "w0") in reads and ("record", "w2") in reads
    assert {agent for _, agent in reads} <= {"w0", "w2"}
    got = MessageBus("many", "w0").poll()
    assert [m.content for m in got] == ["first", "second", "from w1", "third"]
    assert all(a.ts <= b.ts for a, b in itertools.pairwise(got))
    assert [m.content for m in lead.history("w2")] == ["first", "second", "third"]
    assert [m.content for m in MessageBus("many", "w2").poll()] == ["third"]


def test_gc_keeps_out_of_order_acks_and_never_redelivers_them(team: Team) -> None:
    """Messages taken by type above the floor stay consumed after a compaction."""
    bus = MessageBus("demo", "worker-1")
    bus.send("lead", "text", "old")
    lead = MessageBus("demo", "lead")
    lead.poll()
    bus.send("lead", "text", "keep")
    bus.send("lead", "plan_submission", "plan")
    assert lead.wait_for_message("plan_submission", timeout=0) is not None
    collect("demo")
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["keep"]


def test_gc_sets_a_torn_tail_aside(team: Team) -> None:
    """A torn tail left by a killed sender is moved to the dead letters by gc, not copied."""
    fill(2)
    MessageBus("demo", "lead").poll()
    with open(inbox(team), "ab") as f:
        f.write(b'{"id":"0123')
    collect("demo")
    assert inbox(team).read_bytes() == b""
    assert "torn" in str(dead_letters(team.store.root, "lead")[0]["reason"])


def test_a_viewer_behind_gc_still_shows_every_message(team: Team) -> None:
    """tail -f (History) behind a compaction reads the replaced inbox to its end first."""
    from ralph_mail.talk.history import History

    view = History("demo", ["lead"])
    view.last(0)
    fill(3)
    MessageBus("demo", "lead").poll()
    collect("demo")
    fill(1, 3)
    assert [m.content for m in view.new()] == ["m0", "m1", "m2", "m3"]
    assert view.skipped["lead"] == 0


def test_a_viewer_whose_position_was_collected_continues_from_the_new_start(
    team: Team,
) -> None:
    """Lines collected from an inbox the viewer never had open are skipped, without error."""
    from ralph_mail.talk.history import History

    view = History("demo", ["lead"])
    view.last(0)
    lead = MessageBus("demo", "lead")
    fill(2)
    lead.poll()
    collect("demo")  # the viewer still has this first inbox open
    fill(2, 2)
    lead.poll()
    collect("demo")  # m2 and m3 were only ever in the second one
    fill(1, 4)
    assert [m.content for m in view.new()] == ["m0", "m1", "m4"]
    assert view.skipped["lead"] > 0  # and it says so (tail -f prints a note)


def test_a_deleted_cursor_rereads_from_what_gc_kept(team: Team) -> None:
    """After gc, deleting the cursor re-reads the inbox from its new start, no error."""
    fill(3)
    lead = MessageBus("demo", "lead")
    lead.poll()
    fill(1, 3)
    collect("demo")
    (team.store.root / "cursors" / "lead.cursor").unlink()
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["m3"]


@pytest.mark.parametrize("step", ["copy", "fsync", "base", "rename", "dirsync"])
def test_gc_killed_at_each_step_loses_and_shifts_nothing(
    team: Team, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """gc stopped at each step (copy, fsync, base write, rename, directory sync): the owner
    reads exactly its unread mail, senders carry on, and the next gc finishes the job."""
    fill(5)
    lead = MessageBus("demo", "lead")
    assert len(lead.poll()) == 5
    fill(2, 5)

    class Crash(BaseException):
        pass

    real_fsync = os.fsync

    def crash(*args: object, **kwargs: object) -> None:
        if step == "dirsync" and not stat.S_ISDIR(os.fstat(args[0]).st_mode):  # type: ignore[arg-type]
            return real_fsync(args[0])  # type: ignore[arg-type]
        raise Crash

    from ralph_mail.store.files.slots import SlotFile

    targets = {
        "copy": (store_module, "copy_range"),
        "fsync": (store_module.os, "fsync"),
        "base": (SlotFile, "save"),
        "rename": (store_module.os, "rename"),
        "dirsync": (store_module.os, "fsync"),
    }
    with monkeypatch.context() as patch:
        patch.setattr(*targets[step], crash)
        with pytest.raises(Crash):
            FileStore(team.home, team.name).compact("lead")
    fill(1, 7)
    assert [m.content for m in lead.poll()] == ["m5", "m6", "m7"]
    assert [m.content for m in MessageBus("demo", "lead").poll()] == []
    fill(1, 8)
    collect("demo")
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["m8"]
    assert list((team.store.root / "tmp").iterdir()) == []
    record(messages=9, faults=1)


def test_a_gc_temp_file_left_by_a_dead_process_is_reported_and_removed(team: Team) -> None:
    """doctor warns about a dead gc's copy; the next gc deletes it."""
    dead = team.store.root / "tmp" / ".lead.jsonl.999999999.gc"
    dead.write_bytes(b"x")
    assert any(f.check == "temp" for f in doctor(team.home).problems)
    assert collect("demo").removed_temp == (dead,)
    assert not dead.exists()


def test_two_gc_runs_take_turns(team: Team, procs: Processes) -> None:
    """While one gc holds gc.lock another waits, then gives up with LockTimeout."""
    holder = procs.python(
        "import sys\nfrom ralph_mail.store.files import FileStore\n"
        f"s = FileStore(__import__('pathlib').Path({str(team.home)!r}), 'demo')\n"
        "with s.maintenance_lock(5):\n    print('held', flush=True); sys.stdin.readline()",
        env=cli_env(team.home),
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    with pytest.raises(LockTimeout, match="another gc"):
        collect("demo", timeout=0.2)
    holder.kill()
    holder.wait(timeout=BOUND_S)
    assert collect("demo", timeout=BOUND_S).team == "demo"
    assert (team.store.root / "gc.lock").exists()  # never unlinked


GC_LOOP = """
import sys
from ralph_mail.maintenance import collect
runs = removed = 0
print("ready", flush=True)
while not sys.stdin.readline().startswith("stop"):
    removed += collect("gc", timeout=60).removed
    runs += 1
    print("ran", flush=True)
print(runs, removed, flush=True)
"""

GC_WRITER = """
import sys
from ralph_mail import MessageBus
name, count = sys.argv[1], int(sys.argv[2])
bus = MessageBus("gc", name)
print("ready", flush=True)
sys.stdin.readline()
for seq in range(count):
    bus.send("lead", "text", f"{name}:{seq}:" + "z" * (seq % 500))
print("done", flush=True)
"""

GC_OWNER = """
import sys
from ralph_mail import MessageBus
total = int(sys.argv[1])
bus = MessageBus("gc", "lead")
nxt, got = {}, 0
print("ready", flush=True)
while got < total:
    for m in bus.wait_for_messages(timeout=5):
        name, seq, _ = m.content.split(":", 2)
        assert int(seq) == nxt.get(name, 0), (name, seq, nxt.get(name))
        nxt[name] = int(seq) + 1
        got += 1
print("got", got, flush=True)
"""


@pytest.mark.parametrize("scale", SCALES)
def test_gc_in_a_loop_beside_senders_and_the_owner_loses_nothing(
    home: Path, procs: Processes, scale: str
) -> None:
    """Two gc processes compacting again and again while 4 writers send and the owner reads:
    every message arrives once, in each writer's order, and the inbox stays small."""
    count = pick(scale, 1500, 25_000)
    writers = ["a", "b", "c", "d"]
    team = create_team("gc", ["lead", *writers], home=home)
    env = cli_env(home)
    owner = procs.python(GC_OWNER, str(4 * count), env=env)
    gcs = [procs.python(GC_LOOP, env=env) for _ in range(2)]
    started = [procs.python(GC_WRITER, w, str(count), env=env) for w in writers]
    for proc in [owner, *gcs, *started]:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    for proc in started:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
    runs_seen = 0
    while any(proc.poll() is None for proc in started) or runs_seen < 4:
        for gc_proc in gcs:  # one more run each, in lockstep with the writers' progress
            assert gc_proc.stdin is not None and gc_proc.stdout is not None
            gc_proc.stdin.write(b"run\n")
            gc_proc.stdin.flush()
            assert gc_proc.stdout.readline() == b"ran\n"
        runs_seen += 1
    for proc in started:
        assert proc.wait(timeout=BOUND_S) == 0
    out, err = owner.communicate(timeout=BOUND_S * 2)
    assert out.split()[-2:] == [b"got", str(4 * count).encode()], err
    totals = []
    for gc_proc in gcs:
        rest, _ = gc_proc.communicate(b"stop\n", timeout=BOUND_S)
        totals.append([int(x) for x in rest.split()[-2:]])
    assert sum(removed for _, removed in totals) > 0
    collect("gc")
    assert (
        os.path.getsize(team.store.root / "mailbox" / "lead.jsonl") == 0
    )  # all consumed, all gone
    record(messages=4 * count)


def test_an_owner_compacts_its_own_inbox_so_it_stays_bounded(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With RALPH_GC_AUTO_BYTES the owner compacts as it consumes: a long run stays small."""
    monkeypatch.setenv("RALPH_GC_AUTO_BYTES", "20000")
    lead = MessageBus("demo", "lead")
    sender = MessageBus("demo", "worker-1")
    largest = 0
    for batch in range(100):
        for seq in range(50):
            sender.send("lead", "text", f"{batch}:{seq}:" + "q" * 100)
        assert len(lead.poll()) == 50
        largest = max(largest, inbox(team).stat().st_size)
    assert largest < 20000 + 50 * 300  # the threshold plus one batch, not 5,000 messages
    record(messages=5000)


# -- 11. doctor -------------------------------------------------------------------------------


def test_doctor_passes_a_healthy_home(team: Team) -> None:
    """A fresh team: file system, inotify, permissions and inboxes all ok; exit 0."""
    report = doctor(team.home)
    assert report.healthy(strict=True), report.problems
    checks = {f.check for f in report.findings}
    assert {"filesystem", "inotify", "permissions", "inbox"} <= checks
    done = ralph(team.home, "doctor", "--home", str(team.home))
    assert done.returncode == 0 and b"healthy" in done.stdout


def test_doctor_refuses_a_network_file_system(
    team: Team, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home on NFS (or CIFS, FUSE, 9p) is a failure that says why."""
    for fstype in ("nfs4", "cifs", "fuse.sshfs", "9p"):
        fake = tmp_path / f"mountinfo-{fstype}"
        fake.write_text(
            f"1 0 0:1 / / rw - ext4 /dev/root rw\n2 1 0:2 / {team.home} rw - {fstype} srv:/x rw\n"
        )
        monkeypatch.setattr(maintenance, "MOUNTINFO", fake)
        (finding,) = [f for f in doctor(team.home).findings if f.check == "filesystem"]
        assert (
            finding.level == "fail"
            and fstype in finding.message
            and "local disk" in finding.message
        )


def test_doctor_warns_about_low_inotify_limits(
    team: Team, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """inotify limits below what waits on inotify need are a warning naming the sysctl
    to raise."""
    monkeypatch.setenv("RALPH_WAIT", "inotify")
    (tmp_path / "max_user_watches").write_text("100\n")
    (tmp_path / "max_user_instances").write_text("8\n")
    monkeypatch.setattr(maintenance, "INOTIFY_SYSCTL", tmp_path)
    (finding,) = [f for f in doctor(team.home).problems if f.check == "inotify"]
    assert finding.level == "warn" and "sysctl" in finding.message


def test_doctor_fails_on_open_permissions_and_symlinks(team: Team, tmp_path: Path) -> None:
    """A world-readable inbox and a planted symlink are failures; the CLI exits 3."""
    os.chmod(inbox(team), 0o644)
    (team.store.root / "cursors" / "worker-2.cursor").symlink_to(tmp_path)
    problems = doctor(team.home).problems
    assert any("chmod 600" in f.message for f in problems)
    assert any("symlink" in f.message for f in problems)
    done = ralph(team.home, "doctor", "--team", "demo")
    assert done.returncode == 3 and b"NOT healthy" in done.stdout


def test_doctor_reports_torn_tails_dead_letters_and_damage(team: Team) -> None:
    """Torn tail and dead letters warn (exit 0, 3 with --strict); a damaged cursor fails."""
    fill(1)
    with open(inbox(team), "ab") as f:
        f.write(b'garbage\n{"id"')
    MessageBus("demo", "lead").poll()
    checks = {(f.check, f.level) for f in doctor(team.home).problems}
    assert {("inbox", "warn"), ("deadletters", "warn")} <= checks
    assert ralph(team.home, "doctor", "--team", "demo").returncode == 0
    strict = ralph(team.home, "doctor", "--team", "demo", "--strict", "--json")
    assert strict.returncode == 3
    assert {orjson.loads(line)["level"] for line in strict.stdout.splitlines()} >= {"ok", "warn"}
    (team.store.root / "cursors" / "lead.cursor").write_bytes(b"\xff" * 8192)
    assert ("cursor", "fail") in {(f.check, f.level) for f in doctor(team.home).problems}
    inbox(team, "worker-2").unlink()
    assert any("missing" in f.message for f in doctor(team.home).problems)


def test_doctor_names_the_holder_of_a_stuck_lock(team: Team, procs: Processes) -> None:
    """An inbox lock held past the wait (a stopped sender) is reported with the holder's pid."""
    holder = procs.python(
        "import fcntl, os, sys\n"
        f"fd = os.open({str(inbox(team))!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.readline()",
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    (finding,) = [f for f in doctor(team.home, lock_wait=0.1).problems if f.check == "lock"]
    assert str(holder.pid) in finding.message
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=BOUND_S)
    fd = os.open(inbox(team), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kill freed it
    os.close(fd)
    assert not [f for f in doctor(team.home).problems if f.check == "lock"]


# -- the commands as the README shows them ----------------------------------------------------


def test_readme_maintenance_commands_run(home: Path) -> None:
    """The doctor and gc commands of the README section run and do what it says."""
    assert (
        ralph(home, "team", "create", "demo", "--member", "lead", "--member", "worker-1").returncode
        == 0
    )
    assert (
        ralph(home, "send", "lead", "hello", "--team", "demo", "--agent", "worker-1").returncode
        == 0
    )
    assert ralph(home, "read", "--team", "demo", "--agent", "lead").returncode == 0
    done = ralph(home, "doctor", "--home", str(home))
    assert done.returncode == 0, done.stdout
    done = ralph(home, "gc", "--team", "demo")
    assert done.returncode == 0 and b"demo/lead: removed" in done.stdout
    done = ralph(home, "gc", "--all", "--home", str(home), "--json")
    assert done.returncode == 0
    assert [orjson.loads(line)["agent"] for line in done.stdout.splitlines()] == [
        "lead",
        "worker-1",
    ]
    done = ralph(home, "doctor", "--team", "demo", "--strict", "--json")
    assert done.returncode == 0 and all(
        orjson.loads(x)["level"] == "ok" for x in done.stdout.splitlines()
    )
    done = ralph(home, "gc")
    assert done.returncode == 2 and b"pass --team" in done.stderr
