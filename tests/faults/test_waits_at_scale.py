"""Many agents waiting on one host, and the ways a wait can learn that mail came.

Hundreds of real waiting processes (forked from one hive, bench/hive.py) must all wake,
hold no inotify instance (a user has 128), and cost nothing while idle: counted as the
times each was woken (/proc's voluntary context switches), not timed. The wait contract
runs on every way of waiting that ``RALPH_WAIT`` can pick.
"""

from __future__ import annotations

import os
import re
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.hive import Hive, counters
from ralph_mail import Message, MessageBus, Team, create_team
from ralph_mail.errors import MailError
from ralph_mail.maintenance import doctor
from ralph_mail.settings import wait_mechanism
from ralph_mail.store.files import FileStore, bells
from ralph_mail.store.files.bells import survey
from tests.helpers.processes import BOUND_S, Processes, cli_env

#: The repository's root, where the child pytest runs.
ROOT = Path(__file__).resolve().parents[2]

#: How many waiting agents the default suite starts (the stress run: a thousand).
AGENTS = 300
#: The idle window whose wake-ups are counted (s).
IDLE_S = 2.0


def _inotify_descriptors(pid: int) -> int:
    count = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") == "anon_inode:inotify":
                count += 1
        except OSError:
            continue
    return count


def _many_agents_wake_and_cost_nothing_idle(home: Path, n: int) -> None:
    names = [f"a{i}" for i in range(n)]
    create_team("hive", ["sender", "other", *names], home=home)
    env = cli_env(home)
    with Hive({"kind": "ralph", "agents": names, "home": str(home), "team": "hive"}, env) as hive:
        pids = list(hive.ready(BOUND_S * 5).values())
        assert sum(_inotify_descriptors(pid) for pid in pids) == 0  # no kernel quota taken
        before = counters(pids)
        sender = MessageBus("hive", "sender", home=home)
        for seq in range(200):  # mail for someone else wakes none of them
            sender.send("other", "text", str(seq))
        time.sleep(IDLE_S)  # the window counted, not a synchronisation
        woke = {pid: c.wakeups - before[pid].wakeups for pid, c in counters(pids).items()}
        # Since `before` only an agent's safety poll (after 1 s, then 6 s) may have
        # woken it: a few times, where a 10 ms poller wakes 200 times.
        assert max(woke.values()) <= 6, sorted(woke.values())[-5:]
        sender.broadcast(str(time.monotonic_ns()))  # everyone at once, stamped
        woken = {hive.latency(BOUND_S)[0] for _ in names}
        assert woken == set(range(n))
        sender.close()


@pytest.mark.xdist_group("heavy")  # hundreds of processes: not beside the bench's smoke run
def test_hundreds_of_waiting_agents_all_wake_and_take_no_inotify_instance(home: Path) -> None:
    """300 waiting processes hold no inotify descriptor, are not woken while nothing
    comes for them, and all wake on one broadcast."""
    _many_agents_wake_and_cost_nothing_idle(home, AGENTS)


@pytest.mark.stress
def test_a_thousand_waiting_agents_all_wake(home: Path) -> None:
    """The issue's figure: a thousand waiting processes on one host, under the default
    limits (run with `pytest -m stress`)."""
    _many_agents_wake_and_cost_nothing_idle(home, 1000)


WAITER = """
import sys
from ralph_mail import MessageBus
bus = MessageBus("demo", "lead")
bus.wait_for_messages(timeout=0.001)  # its waiter is made here
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_killed_waiter_leaves_nothing_behind_after_the_next_send(
    team: Team, procs: Processes
) -> None:
    """A waiter killed with SIGKILL leaves its doorbell; the next send to it unlinks it,
    so no later send pays for it."""
    waiter = procs.python(WAITER, env=cli_env(team.home))
    assert waiter.stdout is not None and waiter.stdout.readline() == b"ready\n"
    bells = team.store.root / "bells" / "lead"
    (bell,) = os.listdir(bells)
    assert stat.S_ISFIFO(os.lstat(bells / bell).st_mode)
    waiter.send_signal(signal.SIGKILL)
    waiter.wait(timeout=BOUND_S)
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "anyone?")
    assert os.listdir(bells) == []
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["anyone?"]


def _fifos_open() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += stat.S_ISFIFO(os.stat(f"/proc/self/fd/{name}").st_mode)
        except OSError:  # the listing's own descriptor, closed meanwhile
            continue
    return count


def _settle(directory: Path) -> None:
    """Date ``directory`` 10 s back: its listing may be kept (bells._SETTLED_NS)."""
    then = time.time_ns() - 10_000_000_000
    os.utime(directory, ns=(then, then))


def test_a_sender_rings_kept_doorbells_without_listing_and_sees_a_new_waiter(
    team: Team, procs: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender keeps the FIFOs it rang open, and rings them again without listing the
    key's directory; a waiter that registers later changes the directory, and the next
    send lists it again and wakes that waiter too."""
    store = team.store
    assert isinstance(store, FileStore)
    sender = MessageBus("demo", "worker-1")
    first = store.waiter(["lead"])
    second = None
    try:
        _settle(store.root / "bells" / "lead")
        sender.send("lead", "text", "one")  # listed, and kept
        assert first.wait(0.0)
        listings: list[object] = []
        real_listdir = bells.os.listdir
        monkeypatch.setattr(bells.os, "listdir", lambda p: listings.append(p) or real_listdir(p))
        sender.send("lead", "text", "two")
        assert first.wait(0.0) and listings == []  # rung through the kept FIFO
        second = FileStore(team.home, team.name).waiter(["lead"])  # another process's, as it were
        sender.send("lead", "text", "three")
        assert len(listings) == 1  # the directory changed: listed again
        assert first.wait(0.0) and second.wait(0.0)
    finally:
        first.close()
        if second is not None:
            second.close()
        sender.close()


def test_a_kept_doorbell_is_rung_before_its_directory_is_looked_at(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ringing again through a kept FIFO writes its byte first, so the waiter wakes at
    once, and only then looks at the key's directory (still after the append): the
    stat is not on the way to the wake-up."""
    store = team.store
    assert isinstance(store, FileStore)
    sender = MessageBus("demo", "worker-1")
    waiter = store.waiter(["lead"])
    try:
        _settle(store.root / "bells" / "lead")
        sender.send("lead", "text", "one")  # listed, and kept
        assert waiter.wait(0.0)
        calls: list[str] = []
        real_write, real_stat = bells.os.write, bells.os.stat

        def write(fd: int, data: bytes) -> int:
            if data == b"\0":
                calls.append("ring")
            return real_write(fd, data)

        def look(path: str, **kwargs: object) -> os.stat_result:
            if str(path).startswith("bells/"):
                calls.append("stat")
            return real_stat(path, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(bells.os, "write", write)
        monkeypatch.setattr(bells.os, "stat", look)
        sender.send("lead", "text", "two")
        monkeypatch.setattr(bells.os, "write", real_write)
        monkeypatch.setattr(bells.os, "stat", real_stat)
        assert calls == ["ring", "stat"] and waiter.wait(0.0)
    finally:
        waiter.close()
        sender.close()


class _Recorder:
    """A poll object that notes the timeout (ms) of each of its polls, in order."""

    def __init__(self, real: select.poll) -> None:
        self.real = real
        self.calls: list[int] = []

    def register(self, fd: int, events: int) -> None:
        self.real.register(fd, events)

    def unregister(self, fd: int) -> None:
        self.real.unregister(fd)

    def poll(self, ms: int) -> list[tuple[int, int]]:
        self.calls.append(ms)
        return self.real.poll(ms)


def _polls(waiter: object) -> list[int]:
    """Record the timeout (ms) of each poll(2) of ``waiter``'s doorbell, in order."""
    bell = waiter._source  # type: ignore[attr-defined]
    assert isinstance(bell, bells.Bell)
    recorder = bell._poller = _Recorder(bell._poller)
    return recorder.calls


def test_a_doorbell_rung_quickly_spins_before_it_blocks_and_an_idle_one_never(
    team: Team,
) -> None:
    """A wait after one that was rung within a millisecond (a quick conversation going
    on) looks without sleeping for a while before it blocks, so what comes then wakes
    no sleeper; a wait after one that timed out, or was rung later, blocks at once: an
    idle waiter never spins."""
    store = team.store
    assert isinstance(store, FileStore)
    sender = MessageBus("demo", "worker-1")
    waiter = store.waiter(["lead"])
    try:
        assert waiter.mechanism == "bell"
        calls = _polls(waiter)
        assert not waiter.wait(0.05) and calls == [50]  # idle: one poll that blocks
        calls.clear()
        sender.send("lead", "text", "one")
        assert waiter.wait(1.0) and calls == [1000]  # the wait before timed out: no spin
        calls.clear()
        sender.send("lead", "text", "two")
        assert waiter.wait(1.0) and calls == [0]  # the one before rung at once: spin
        calls.clear()
        assert not waiter.wait(0.05)  # nothing comes: it spins, then blocks the rest
        assert calls[0] == 0 and len(calls) >= 2 and 0 <= calls[-1] <= 50
        assert all(ms == 0 for ms in calls[:-1])
        calls.clear()
        assert not waiter.wait(0.05) and calls == [50]  # the wait before timed out
        calls.clear()
        later = threading.Timer(0.005, sender.send, ("lead", "text", "three"))
        later.start()
        assert waiter.wait(1.0) and calls == [1000]
        later.join()
        calls.clear()
        assert not waiter.wait(0.05) and calls == [50]  # rung 5 ms on: no spin after it
    finally:
        waiter.close()
        sender.close()


def test_no_spin_with_ralph_spin_us_0_and_a_bad_value_refused(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RALPH_SPIN_US=0: a wait just after a ring blocks at once. A value that is not a
    number of microseconds in range is refused, naming it."""
    store = team.store
    assert isinstance(store, FileStore)
    monkeypatch.setenv("RALPH_SPIN_US", "0")
    sender = MessageBus("demo", "worker-1")
    waiter = store.waiter(["lead"])
    try:
        calls = _polls(waiter)
        sender.send("lead", "text", "one")
        assert waiter.wait(1.0)
        calls.clear()
        assert not waiter.wait(0.05) and calls == [50]
    finally:
        waiter.close()
        sender.close()
    for bad in ("fast", "-1", "100001", "2.5"):
        monkeypatch.setenv("RALPH_SPIN_US", bad)
        with pytest.raises(MailError, match=rf"RALPH_SPIN_US='{re.escape(bad)}'.*0 \(never"):
            store.waiter(["lead"])


def test_a_directory_stamped_in_whole_seconds_is_listed_until_it_settled(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key's directory whose time is a whole second (a file system that counts
    seconds) changed a second ago: a link in the same second would not change it, so
    the sender lists it at each ring; dated 10 s back, it keeps the listing."""
    store = team.store
    assert isinstance(store, FileStore)
    sender = MessageBus("demo", "worker-1")
    waiter = store.waiter(["lead"])
    directory = store.root / "bells" / "lead"
    try:
        second = (time.time_ns() // 1_000_000_000 - 1) * 1_000_000_000
        os.utime(directory, ns=(second, second))
        listings: list[object] = []
        real_listdir = bells.os.listdir
        monkeypatch.setattr(bells.os, "listdir", lambda p: listings.append(p) or real_listdir(p))
        sender.send("lead", "text", "one")
        sender.send("lead", "text", "two")
        assert len(listings) == 2 and waiter.wait(0.0)
        _settle(directory)
        for text in ("three", "four"):
            sender.send("lead", "text", text)
        assert len(listings) == 3 and waiter.wait(0.0)
    finally:
        waiter.close()
        sender.close()


def test_a_kept_doorbell_whose_waiter_died_is_unlinked_at_the_next_send(
    team: Team, procs: Processes
) -> None:
    """A waiter killed after a sender kept its FIFO open: the sender's next ring finds
    it without a reader, lists the key again and unlinks it, and the message lands."""
    waiter = procs.python(WAITER, env=cli_env(team.home))
    assert waiter.stdout is not None and waiter.stdout.readline() == b"ready\n"
    directory = team.store.root / "bells" / "lead"
    _settle(directory)
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "rung and kept")
    waiter.send_signal(signal.SIGKILL)
    waiter.wait(timeout=BOUND_S)
    sender.send("lead", "text", "anyone?")
    assert os.listdir(directory) == []
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["rung and kept", "anyone?"]
    sender.close()


def test_kept_doorbells_are_bounded(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ringing 40 waited-on inboxes leaves at most RINGS_KEPT FIFOs open in the sender,
    the least recently rung closed first. (The sender's rings start empty: the process's
    own may hold FIFOs of earlier tests, which ringing these would close.)"""
    rings = bells._Rings()
    monkeypatch.setattr(bells, "_RINGS", rings)
    names = [f"w{n}" for n in range(40)]
    create_team("many", ["lead", *names], home=home)
    store = FileStore(home, "many")
    waiters = [store.waiter([name]) for name in names]
    try:
        for name in names:
            _settle(store.root / "bells" / name)
        sender = MessageBus("many", "lead", home=home)
        before = _fifos_open()
        for name in names:
            sender.send(name, "text", "hi")
        assert 0 < _fifos_open() - before <= bells.RINGS_KEPT
        assert all(waiter.wait(0.0) for waiter in waiters)
        sender.close()
    finally:
        for waiter in waiters:
            waiter.close()
        for name in list(rings._kept):
            rings._drop(name)


def test_a_doorbell_no_longer_kept_open_is_rung_by_name_without_a_listing(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender that rang more waiters than it keeps open remembers the others' FIFOs
    by name: ringing one again opens it by name, with no listing of its directory (a
    sender waking a thousand agents in turn looks up no directory on the way), and
    keeps it open again; a waiter that registers later is still found."""
    rings = bells._Rings()
    monkeypatch.setattr(bells, "_RINGS", rings)
    names = [f"w{n}" for n in range(bells.RINGS_KEPT + 4)]
    create_team("many", ["lead", *names], home=home)
    store = FileStore(home, "many")
    waiters = [store.waiter([name]) for name in names]
    later = None
    try:
        for name in names:
            _settle(store.root / "bells" / name)
        sender = MessageBus("many", "lead", home=home)
        for name in names:
            sender.send(name, "text", "listed")
        assert all(waiter.wait(0.0) for waiter in waiters)
        before = _fifos_open()
        listings: list[object] = []
        real_listdir = bells.os.listdir

        def listdir(path: int | str) -> list[str]:
            if isinstance(path, int):  # a key's directory (not /proc/self/fd, below)
                listings.append(path)
            return real_listdir(path)

        monkeypatch.setattr(bells.os, "listdir", listdir)
        sender.send("w0", "text", "by name")  # the first rung: closed since
        assert listings == [] and waiters[0].wait(0.0)
        assert _fifos_open() == before  # open again, and the oldest one open closed
        later = FileStore(home, "many").waiter(["w0"])  # another process's, as it were
        sender.send("w0", "text", "listed again")
        assert len(listings) == 1 and waiters[0].wait(0.0) and later.wait(0.0)
        sender.close()
    finally:
        for waiter in [*waiters, *([later] if later else [])]:
            waiter.close()
        for name in list(rings._kept):
            rings._drop(name)


def test_a_closed_waiter_takes_its_doorbell_away(team: Team) -> None:
    """Once the last waiter on an inbox stops, nothing of it is left for a sender to look
    at: a send's whole cost for doorbells is one lookup that finds nothing."""
    store = team.store
    assert isinstance(store, FileStore)
    waiter = store.waiter(["lead", "#general", "log:tasks"])
    assert sorted(os.listdir(store.root / "bells")) == ["#general", "lead", "log:tasks"]
    waiter.close()
    assert os.listdir(store.root / "bells") == []


def test_a_wake_up_reads_the_mail_before_the_once_a_second_chores(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent woken a second or more after it last noted itself active (each of many
    agents woken in turn is) reads its mail first: noting presence and the rooms'
    deferred work (held assignments) are done before a wait blocks, not on the way from
    its wake-up to its mail."""
    lead = MessageBus("demo", "lead")
    assert lead.wait_for_messages(timeout=0.01) == []  # its waiter is made
    store, watcher = lead.store, lead._watcher
    assert watcher is not None
    calls: list[str] = []
    blocked = threading.Event()
    save_presence, read, wait = store.save_presence, store.read, watcher.wait

    def saving(agent: str, record: bytes) -> None:
        calls.append("presence")
        save_presence(agent, record)

    def waiting(timeout: float, stop: object = None) -> bool:
        blocked.set()
        return wait(timeout, stop)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "save_presence", saving)
    monkeypatch.setattr(store, "read", lambda *a, **k: calls.append("read") or read(*a, **k))
    monkeypatch.setattr(watcher, "wait", waiting)
    got: list[Message] = []
    thread = threading.Thread(target=lambda: got.extend(lead.wait_for_messages(BOUND_S)))
    thread.start()
    try:
        assert blocked.wait(BOUND_S)
        lead._touched -= 10.0  # as if it had slept ten seconds: the chores are due again
        calls.clear()
        MessageBus("demo", "worker-1").send("lead", "text", "hello")
    finally:
        thread.join(BOUND_S)
    assert [m.content for m in got] == ["hello"]
    assert calls and calls[0] == "read" and "presence" not in calls
    assert lead.wait_for_messages(timeout=0.01) == []
    assert "presence" in calls  # the next wait noted it, before it blocked
    lead.close()


def test_a_waiter_wakes_on_a_team_log_and_a_channel(team: Team) -> None:
    """A doorbell rings for every log a waiter watches, not only inboxes."""
    store = team.store
    waiter = store.waiter(["log:tasks", "#general"])
    try:
        assert not waiter.wait(0.0)
        store.log_append("tasks", b'{"x":1}\n')
        assert waiter.wait(BOUND_S)
        store.create_log("#general")
        assert waiter.wait(BOUND_S)
    finally:
        waiter.close()


def test_deleting_a_team_wakes_its_waiters(team: Team, procs: Processes) -> None:
    """A wait in progress learns at once that its team was deleted (its doorbell is rung
    before the directory goes), and says so."""
    waiting = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "wait", "--team", "demo", "--agent", "lead",
         "--timeout", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(team.home),
    )  # fmt: skip
    procs.started.append(waiting)
    bells = team.store.root / "bells" / "lead"
    while not (bells.exists() and os.listdir(bells)):
        assert waiting.poll() is None, waiting.communicate()
    from ralph_mail import delete_team

    delete_team("demo", home=team.home)
    _, err = waiting.communicate(timeout=BOUND_S)  # not 600 s: it was rung
    assert waiting.returncode == 2 and b"was deleted" in err, err


def test_doctor_says_how_many_waiters_poll_and_why(team: Team, procs: Processes) -> None:
    """A waiter made to poll is counted by doctor with its reason; doorbells too."""
    polling = procs.python(WAITER, env=cli_env(team.home, RALPH_WAIT="poll"))
    ringing = procs.python(WAITER.replace('"lead"', '"worker-2"'), env=cli_env(team.home))
    for proc in (polling, ringing):
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    store = team.store
    assert isinstance(store, FileStore)
    waiting = survey(store.dirs)
    assert (waiting.bells, waiting.polling) == (1, ("RALPH_WAIT=poll",))
    (finding,) = [f for f in doctor(team.home).findings if f.check == "waits"]
    assert finding.level == "warn"
    assert "1 waiter polls" in finding.message and "RALPH_WAIT=poll" in finding.message


def test_an_unknown_wait_mechanism_is_refused_naming_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RALPH_WAIT=fast: one line naming the variable and the ways there are."""
    monkeypatch.setenv("RALPH_WAIT", "fast")
    with pytest.raises(MailError, match=r"RALPH_WAIT='fast'.*bell, inotify, watchfiles, poll"):
        wait_mechanism()


@pytest.mark.parametrize("variable", ["RALPH_WAIT", "RALPH_SPIN_US"])
def test_a_wait_with_a_bad_wait_setting_exits_2_in_one_line(team: Team, variable: str) -> None:
    """The command line turns a bad RALPH_WAIT or RALPH_SPIN_US into one line, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "ralph_mail", "wait", "--team", "demo", "--agent", "lead",
         "--timeout", "1"],
        capture_output=True, env=cli_env(team.home, **{variable: "fast"}), timeout=BOUND_S,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.decode().count("\n") == 1 and variable.encode() in done.stderr


#: Every test of the suite about waiting (store and bus contracts, CLI waits, faults),
#: on the file store, whatever file it lives in; a test about file events themselves
#: (a bare watcher of a directory) only where there are some.
WAIT_TESTS = "(wait or wake or waiter) and not nats and not memory and not primitives"


@pytest.mark.parametrize("mechanism", ["inotify", "watchfiles", "poll"])
def test_the_wait_contract_holds_on_every_way_of_waiting(mechanism: str) -> None:
    """RALPH_WAIT=MECHANISM: every wait test of the suite passes (run as a child pytest,
    so each way of waiting gets fresh processes)."""
    selected = WAIT_TESTS + ("" if mechanism in ("inotify", "watchfiles") else
                             " and not file_event")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALPH_")}
    env["RALPH_WAIT"] = mechanism
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", "-x", "-p", "no:cacheprovider", "-n", "0",
         "-k", selected, f"--ignore={Path(__file__).resolve()}"],
        cwd=ROOT, env=env, capture_output=True, timeout=900,
    )  # fmt: skip
    tail = done.stdout.decode(errors="replace")[-3000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail


class _Clocks:
    """Fake clocks for a spin (`ralph_mail.store.spin`): the wall advances 20 µs at each look, and
    this thread's CPU time with it (``alone``) or not at all (others have the core)."""

    def __init__(self, alone: bool) -> None:
        self.wall, self.alone = 0.0, alone

    def monotonic(self) -> float:
        self.wall += 20e-6
        return self.wall

    def thread_time(self) -> float:
        return self.wall if self.alone else 0.0


@pytest.mark.parametrize("alone", [True, False])
def test_a_spin_ends_at_once_when_others_want_its_core(
    alone: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spin that has its core to itself looks until its time is up; one that gets
    less than half of its core (others run between its looks) sleeps after 50 µs."""
    from ralph_mail.store.files import posix

    read, write = os.pipe()
    poller = _Recorder(select.poll())
    poller.register(read, select.POLLIN)
    looks = poller.calls
    clocks = _Clocks(alone)
    monkeypatch.setattr(posix.time, "monotonic", clocks.monotonic)
    monkeypatch.setattr(posix.time, "thread_time", clocks.thread_time)
    try:
        assert not posix.ready(poller, read, 0.001, spin=0.0005)  # type: ignore[arg-type]
    finally:
        os.close(read)
        os.close(write)
    spins = looks[:-1]
    assert all(ms == 0 for ms in spins) and looks[-1] >= 0
    assert len(spins) == (25 if alone else 3)  # 500 µs in steps of 20; 3 by 60 µs
