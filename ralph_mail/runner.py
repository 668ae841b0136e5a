"""`ralph-mail run`: any command answers as an agent (DESIGN §11).

A `Runner` consumes one agent's inbox and, for each ``request``, ``task_assignment`` and
``mention``, runs the command once: the conversation so far and the request on its
standard input, who asks and why in its environment. Its standard output becomes the
reply (an ask), the task's result (a delegation) or the answer posted in the channel (a
mention, in its turn; empty output passes the turn); a non-zero exit, or a run past the
timeout (its whole process group is killed), sends the error instead (a passed turn for
a mention). Plain notes start nothing: the next run sees them in its history.

A request is consumed only after its answer is sent, and answering is idempotent (a
request gets one reply, a task one result), so a runner killed mid-run and started
again answers each request exactly once. Runs go on in up to ``jobs`` threads, each
with a bus of its own that reads the history and sends the answer the moment the child
ends; the runner's bus, on its own thread, consumes. Between messages it waits on file
events: its inbox, and the channels where a turn it waits for goes on.

Example:
    >>> Runner("demo", "analyst", ["claude", "-p"]).serve()    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import IO, Final

import orjson

from ralph_mail.bus import MessageBus
from ralph_mail.children import kill_group, spawn
from ralph_mail.errors import InvalidMessage, MailError, PermissionDenied
from ralph_mail.message import Message, MessageType
from ralph_mail.store.base import StopEvent, Waiter

#: What starts a run, by message type, and the pattern its child is told.
PATTERNS: Final[dict[str, str]] = {
    "request": "ask", "task_assignment": "delegate", "mention": "mention",
}  # fmt: skip
#: How long a stopping runner lets running jobs finish before it kills them (s).
STOP_GRACE_S: Final = 10.0
#: Room kept for the envelope when a child's output becomes a message (bytes).
_ENVELOPE_ROOM: Final = 4096
#: How long the pipes of a finished (or killed) child are read for at most (s).
_JOIN_S: Final = 5.0
#: The most of a child's standard error kept for the error it reports.
_STDERR_KEPT: Final = 2000


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one run ended: ``output`` (its stdout), or ``error`` (why it failed)."""

    output: str = ""
    error: str = ""


def _communicate(
    child: subprocess.Popen[bytes], stdin: bytes, timeout: float, limit: int
) -> tuple[int | None, bytes, bool, bytes]:
    """Feed ``stdin``, keep at most ``limit`` bytes of stdout (and the end of stderr),
    reading the rest away so the child never blocks; ``(exit code or None when it ran
    past ``timeout`` and its group was killed, stdout, whether it was cut, stderr)``."""
    kept: dict[str, bytes] = {}
    cut = False

    def feed() -> None:
        assert child.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            child.stdin.write(stdin)
        with contextlib.suppress(OSError):
            child.stdin.close()

    def drain(name: str, stream: IO[bytes], most: int, tail: bool) -> None:
        nonlocal cut
        buffer, total, fd = bytearray(), 0, stream.fileno()
        while chunk := os.read(fd, 1 << 16):
            total += len(chunk)
            if tail:
                buffer = (buffer + chunk)[-most:]
            elif len(buffer) < most:
                buffer += chunk[: most - len(buffer)]
        if not tail and total > most:
            cut = True
        kept[name] = bytes(buffer)

    assert child.stdout is not None and child.stderr is not None
    threads = [
        threading.Thread(target=feed, daemon=True),
        threading.Thread(target=drain, args=("out", child.stdout, limit, False), daemon=True),
        threading.Thread(target=drain, args=("err", child.stderr, _STDERR_KEPT, True), daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        code: int | None = child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(child)
        child.wait()
        code = None
    for thread in threads:
        thread.join(timeout=_JOIN_S)  # a grandchild holding the pipes must not hang us
    for stream in (child.stdout, child.stderr):
        with contextlib.suppress(OSError):
            stream.close()
    return code, kept.get("out", b""), cut, kept.get("err", b"")


def prompt(message: Message, history: Sequence[Message], pattern: str) -> str:
    """The text a run reads on stdin: the conversation so far, then the request headed
    as the seeds head it (``[Agent Request from X | Pattern: ask]``)."""
    lines = []
    if history:
        channel = message.metadata.get("channel", "") if pattern == "mention" else ""
        lines.append(f"[Channel #{channel} history]" if channel
                     else f"[Conversation history with {message.from_agent}]")  # fmt: skip
        lines += [f"{m.ts[:16].replace('T', ' ')} [{m.from_agent}] {m.content}" for m in history]
        lines.append("")
    head = f"[Agent Request from {message.from_agent} | Pattern: {pattern}"
    if pattern == "mention":
        head += f" | Channel: #{message.metadata.get('channel', '')}"
    if pattern == "delegate":
        head += f" | Priority: {message.priority} | Task: {message.metadata.get('taskId', '')}"
    lines += [head + "]", ""]
    if message.metadata.get("context"):
        lines += [f"Context: {message.metadata['context']}", ""]
    lines.append(message.content)
    return "\n".join(lines) + "\n"


def _note(text: str) -> None:
    import sys

    sys.stderr.write(f"ralph-mail: note: {text}\n")


class _Either:
    """Set when either event is (``stop`` may be None): a wait ends on either."""

    def __init__(self, stop: StopEvent | None, other: threading.Event) -> None:
        self._stop, self._other = stop, other

    def is_set(self) -> bool:
        return self._other.is_set() or (self._stop is not None and self._stop.is_set())


class Runner:
    """One agent answered by a command (see the module docstring).

    Args:
        team, agent, home: whom it answers for.
        command: the program and its arguments.
        jobs: runs at once (default 4).
        timeout: seconds a run may take before its process group is killed (120).
        history: messages of the conversation given before the request (20).
        format: ``text`` (headed, as the seeds show it) or ``json`` (one object).
    """

    def __init__(
        self,
        team: str,
        agent: str,
        command: Sequence[str],
        home: str | os.PathLike[str] | None = None,
        *,
        jobs: int = 4,
        timeout: float = 120.0,
        history: int = 20,
        format: str = "text",
    ) -> None:
        if not command:
            raise InvalidMessage("no command to run: put it after '--', e.g. -- claude -p")
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise InvalidMessage(f"invalid jobs {jobs!r}: give a count >= 1")
        if not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise InvalidMessage(f"invalid timeout {timeout!r}: give a number of seconds > 0")
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise InvalidMessage(f"invalid history {history!r}: give a count >= 0")
        if format not in ("text", "json"):
            raise InvalidMessage(f"invalid format {format!r}: text or json")
        self.command = list(command)
        self.jobs, self.timeout, self.history, self.format = jobs, timeout, history, format
        self.bus = MessageBus(team, agent, home, default_rate=10)
        self.home = str(self.bus.team.home)
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._local = threading.local()  # each pool thread's own bus
        self._buses: list[MessageBus] = []
        self._buses_lock = threading.Lock()

    def serve(
        self, stop: StopEvent | None = None, ready: Callable[[], object] | None = None
    ) -> None:
        """Answer what comes until ``stop`` is set; then let running jobs finish (killing
        them after `STOP_GRACE_S`). `InboxBusy` when another process consumes the inbox.
        ``ready`` is called once the agent is online."""
        self.bus.peek()  # claims the inbox (a second runner is refused here): online now
        self.bus.set_presence("idle")
        if ready is not None:
            ready()
        said = "idle"
        running: dict[Future[None], Message] = {}
        watching: tuple[tuple[str, ...], Waiter | None] = ((), None)
        finished = threading.Event()  # a job ended: wakes the wait below
        woken = _Either(stop, finished)
        with ThreadPoolExecutor(self.jobs, thread_name_prefix="ralph-run") as pool:
            try:
                while stop is None or not stop.is_set():
                    finished.clear()
                    self._collect(running, wait_s=0.0)
                    taken = {message.id for message in running.values()}
                    keys = {self.bus.agent}  # my inbox, and channels where a turn goes on
                    wake = time.time() + 1.0
                    for message in self.bus.peek():
                        if message.id in taken:
                            continue
                        pattern = PATTERNS.get(str(message.type))
                        if pattern == "mention":
                            turn = self.bus.channels.turn(message)
                            if turn.standing == "done":  # answered before a restart
                                self.bus.consume(message)
                                continue
                            if turn.standing == "wait":
                                keys.update(self.bus.channels.watch_keys(message))
                                wake = min(wake, turn.until)
                                continue
                        if pattern is None:  # a note: the next run sees it in history
                            self.bus.consume(message)
                        elif len(running) < self.jobs:
                            job = pool.submit(self._job, message, pattern)
                            job.add_done_callback(lambda _: finished.set())
                            running[job] = message
                            taken.add(message.id)
                    if said != ("working" if running else "idle"):
                        said = "working" if running else "idle"
                        self.bus.set_presence(said)
                    watched = tuple(sorted(keys))
                    waiter = watching[1]
                    if waiter is None or watched != watching[0]:  # new: look again first
                        if waiter is not None:
                            waiter.close()
                        watching = (watched, self.bus.store.waiter(list(watched)))
                        continue
                    waiter.wait(max(0.0, wake - time.time()), woken)
            finally:
                if watching[1] is not None:
                    watching[1].close()
                self._collect(running, wait_s=STOP_GRACE_S)
                for child in list(self._children.values()):
                    kill_group(child)
                self._collect(running, wait_s=self.timeout)
                with contextlib.suppress(MailError):
                    self.bus.set_presence("idle")

    def _collect(self, running: dict[Future[None], Message], wait_s: float) -> None:
        """Consume the requests whose runs ended and were answered (waiting up to
        ``wait_s`` for one); a job that failed to answer raises here."""
        if not running:
            return
        done, _ = wait(running, timeout=wait_s, return_when=FIRST_COMPLETED)
        for future in done:
            message = running.pop(future)
            future.result()
            self.bus.consume(message)

    def _job(self, message: Message, pattern: str) -> None:
        """One request, on a pool thread with a bus of its own (the runner's bus, which
        consumes, stays on its thread): read the history, run, send the answer."""
        bus = self._thread_bus()
        outcome = self._run(message, pattern, self._history(bus, message))
        self._answer(bus, message, outcome)

    def _thread_bus(self) -> MessageBus:
        bus: MessageBus | None = getattr(self._local, "bus", None)
        if bus is None:
            bus = self._local.bus = MessageBus(self.bus.team.name, self.bus.agent, self.home,
                                               default_rate=10)  # fmt: skip
            with self._buses_lock:
                self._buses.append(bus)
        return bus

    def _answer(self, bus: MessageBus, message: Message, outcome: Outcome) -> None:
        """Send the run's answer (the request is consumed after, never before)."""
        if message.type == MessageType.MENTION:
            name, post = message.metadata.get("channel", ""), message.reply_to or ""
            try:
                if outcome.output and not outcome.error:
                    bus.channels.post(name, outcome.output, post, chain=tuple(message.chain))
                else:  # nothing to say, or it failed: the next member goes on
                    bus.channels.pass_turn(name, post)
            except (InvalidMessage, PermissionDenied) as exc:  # left the channel, or it went
                _note(f"{bus.agent} cannot answer in #{name}: {exc}")
        elif message.type == MessageType.REQUEST:
            if outcome.error:
                bus.reply(message, outcome.error, {"error": outcome.error})
            else:
                bus.reply(message, outcome.output)
        else:
            task_id = message.metadata.get("taskId", "")
            try:
                if outcome.error:
                    bus.fail(task_id, outcome.error)
                else:
                    bus.complete(task_id, outcome.output)
            except MailError:  # not in the team's task tree: report to whoever gave it
                bus.send(message.from_agent, MessageType.STATUS_UPDATE,
                         outcome.error or outcome.output,
                         {"state": "failed" if outcome.error else "done",
                          "task": task_id})  # fmt: skip

    def _run(self, message: Message, pattern: str, past: list[Message]) -> Outcome:
        """One run of the command for ``message`` (on a pool thread: no mailbox use)."""
        history = [m for m in past if m.id not in (message.id, message.reply_to)]
        if self.format == "json":
            document = {"pattern": pattern, "message": message.to_dict(),
                        "history": [m.to_dict() for m in history]}  # fmt: skip
            stdin = orjson.dumps(document) + b"\n"
        else:
            stdin = prompt(message, history, pattern).encode()
        env = dict(os.environ)
        env.update(
            RALPH_HOME=self.home, RALPH_TEAM=self.bus.team.name, RALPH_AGENT=self.bus.agent,
            RALPH_MESSAGE_ID=message.id, RALPH_FROM=message.from_agent,
            RALPH_THREAD=message.thread, RALPH_CHAIN=",".join(message.chain),
            RALPH_PATTERN=pattern,
        )  # fmt: skip
        if pattern == "delegate":
            env["RALPH_TASK"] = message.metadata.get("taskId", "")
        if pattern == "mention":
            env["RALPH_CHANNEL"] = message.metadata.get("channel", "")
        try:
            child = spawn(self.command, env)
        except OSError as exc:
            return Outcome(error=f"cannot run {self.command[0]!r}: {exc.strerror or exc}")
        self._children[message.id] = child
        limit = max(1024, self.bus.max_message_bytes - _ENVELOPE_ROOM)
        try:
            code, out, cut, err = _communicate(child, stdin, self.timeout, limit)
        finally:
            kill_group(child)  # what it left running in its group (a daemon) goes too
            self._children.pop(message.id, None)
        if code is None:
            return Outcome(error=f"{self.command[0]} ran past {self.timeout:g} s: killed")
        if code != 0:
            said = err.decode("utf-8", "replace").strip()[-_STDERR_KEPT:]
            return Outcome(error=f"{self.command[0]} exited {code}"
                           + (f": {said}" if said else ""))  # fmt: skip
        text = out.decode("utf-8", "replace")
        text = text[:-1] if text.endswith("\n") and not cut else text
        if cut:
            text += f"\n[output cut at {limit:,} bytes: the message limit]"
        return Outcome(output=text)

    def _history(self, bus: MessageBus, message: Message) -> list[Message]:
        if not self.history:
            return []
        if message.type == MessageType.MENTION:
            return bus.channel_history(message.metadata.get("channel", ""), self.history)
        return bus.history(message.from_agent, self.history)

    def close(self) -> None:
        with self._buses_lock:
            for bus in self._buses:
                bus.close()
            self._buses.clear()
        self.bus.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
