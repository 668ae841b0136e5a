"""`ralph-mail run`: any command answers as an agent (DESIGN §11).

A `Runner` consumes one agent's inbox and, for each ``request``, ``task_assignment`` and
``mention``, runs the command once: the conversation so far and the request on its
standard input, who asks and why in its environment (the history capped at
`settings.RUN_HISTORY_MAX_BYTES`). What it printed by the time it exited becomes the
reply (an ask), the task's result (a delegation) or the answer posted in the channel (a
mention, in its turn; empty output passes the turn); a non-zero exit, or a run past the
timeout, sends the error instead (a passed turn for a mention). Once it ends, all it
started is killed (`ralph_mail.children`). Plain notes start nothing: the next run sees
them in its history. Each run is logged in one line on stderr.

A delegated task is started (``working``) when its run starts, and its lease renewed
every third of the team's ``task_lease`` while the run goes on: a runner that dies
leaves the task to stall. A ``task_canceled`` for a task a run works on (the task log
backs it: canceled, or moved to another agent) kills the run's whole tree at once, and
the task gets no answer; a task that ended before its run started is not run. A run
still going at the task's deadline is killed and the task fails ("deadline passed").

What a run cost, when the command reports it (Claude Code's ``--output-format json``,
whose ``result`` is then the answer, or a report written to ``$RALPH_USAGE_FILE``; see
`ralph_mail.usage`), goes into the answer's metadata and the team's usage log. An agent
whose jobs spent its budget (``policy budget``) answers each new request with the error
instead of running the command.

A request is consumed only after its answer is sent, and answering is idempotent (a
request gets one reply, a task one result), so a runner killed mid-run and started
again answers each request exactly once. A request it cannot answer (the answer is
refused by the team's rules, or the request is malformed) gets the error instead, or is
set aside; either way it is consumed, so one message cannot stop the runner on every
start. A runner stopped cleanly leaves its agent offline. Runs go on in up to ``jobs`` threads, each
with a bus of its own that reads the history and sends the answer the moment the child
ends; the runner's bus, on its own thread, consumes. Between messages it waits on file
events: its inbox, and the channels where a turn it waits for goes on.

Example:
    >>> Runner("demo", "analyst", ["claude", "-p"]).serve()    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson

from ralph_mail import children, settings, usage
from ralph_mail.bus import MessageBus
from ralph_mail.children import Child, communicate, end, spawn
from ralph_mail.errors import BudgetExceeded, InvalidMessage, MailError, RefusedByRules, TaskEnded
from ralph_mail.govern import presence, tasklog
from ralph_mail.message import Message, MessageType, fit_text, parse_ts
from ralph_mail.settings import WATCH_SAFETY_POLL_MAX_S, safety_poll
from ralph_mail.store.base import StopEvent, Waiter
from ralph_mail.store.flag import Either, Flag
from ralph_mail.store.outage import patient

#: What starts a run, by message type, and the pattern its child is told.
PATTERNS: Final[dict[str, str]] = {
    "request": "ask", "task_assignment": "delegate", "mention": "mention",
}  # fmt: skip
#: How long a stopping runner lets running jobs finish before it kills them (s).
STOP_GRACE_S: Final = 10.0
#: Room kept for the envelope when a child's output becomes a message (bytes).
_ENVELOPE_ROOM: Final = 4096
#: The most of a child's standard error kept for the error it reports.
_STDERR_KEPT: Final = 2000
#: What makes a request one the runner cannot answer (rather than a store failing, which
#: stops the runner so the request is met again): a refused or malformed message.
_CANNOT: Final = (ValueError, LookupError, RefusedByRules)
#: What answering with the error instead means, by message type.
_INSTEAD: Final = {
    "request": "replied with the error", "task_assignment": "failed the task",
    "mention": "passed the turn",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one run ended: ``output`` (its answer), or ``error`` (why it failed);
    ``status`` says how, for the log (``exit 0``, ``killed after 120 s``...); ``spent``:
    what it cost, when it said."""

    output: str = ""
    error: str = ""
    status: str = "exit 0"
    spent: usage.Usage | None = None


def prompt(message: Message, history: Sequence[Message], pattern: str, left_out: int = 0) -> str:
    """The text a run reads on stdin: the conversation so far, then the request headed
    as the seeds head it (``[Agent Request from X | Pattern: ask]``). ``left_out``: how
    many older messages the history's size cap dropped (said on the first line)."""
    lines = []
    if left_out:
        cap = settings.RUN_HISTORY_MAX_BYTES
        lines.append(f"[{left_out} earlier message{'s' if left_out > 1 else ''} left out: "
                     f"the history is capped at {cap:,} bytes]")  # fmt: skip
    if history:
        channel = message.metadata.get("channel", "") if pattern == "mention" else ""
        lines.append(f"[Channel #{channel} history]" if channel
                     else f"[Conversation history with {message.from_agent}]")  # fmt: skip
        lines += [_history_line(m) for m in history]
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


def _history_line(message: Message) -> str:
    return f"{message.ts[:16].replace('T', ' ')} [{message.from_agent}] {message.content}"


def capped(history: list[Message], size: Callable[[Message], int]) -> tuple[list[Message], int]:
    """The newest messages of ``history`` whose ``size`` adds up to at most
    `settings.RUN_HISTORY_MAX_BYTES`, and how many older ones were left out."""
    room, kept = settings.RUN_HISTORY_MAX_BYTES, len(history)
    while kept and room - size(history[kept - 1]) >= 0:
        room -= size(history[kept - 1])
        kept -= 1
    return history[kept:], kept


def _what(message: Message) -> str:
    """A request as the log names it: ``ask from lead (0123456789ab)``."""
    pattern = PATTERNS.get(str(message.type), str(message.type))
    where = f" in #{message.metadata.get('channel', '')}" if pattern == "mention" else ""
    return f"{pattern} from {message.from_agent}{where} ({message.id})"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _note(text: str) -> None:
    """One line on stderr (what it quotes cannot break it: control characters escaped)."""
    import sys

    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    sys.stderr.write(f"ralph-mail: note: {line}\n")


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
        if shutil.which(command[0]) is None:
            raise InvalidMessage(
                f"cannot run {command[0]!r}: no such command on PATH, nor an executable file "
                "of that name: install it, or give its path after '--'"
            )
        self.command = list(command)
        self.jobs, self.timeout, self.history, self.format = jobs, timeout, history, format
        self.bus = MessageBus(team, agent, home, default_rate=10)
        self.bus.signer().public()  # the key, read here by this process: never by a child
        self.home = str(self.bus.team.home)
        self._children: dict[str, Child] = {}
        # The runs on tasks of the team's log: message id -> (task id, when its lease is
        # next renewed, monotonic); and the runs killed because their task was canceled.
        self._leases: dict[str, tuple[str, float]] = {}
        # Wakes the loop's wait: a job ended, or a lease it must renew was taken.
        self._kick = Flag()
        self._leases_lock = threading.Lock()
        self._canceled: set[str] = set()
        self._local = threading.local()  # each pool thread's own bus
        self._buses: list[MessageBus] = []
        self._buses_lock = threading.Lock()

    def serve(
        self, stop: StopEvent | None = None, ready: Callable[[], object] | None = None
    ) -> None:
        """Answer what comes until ``stop`` is set; then let running jobs finish (killing
        them after `STOP_GRACE_S`). `InboxBusy` when another process consumes the inbox.
        ``ready`` is called once the agent is online. Once stopped it is offline (until
        anything of the agent is active again). A store whose server goes away (NATS) is
        waited for, saying so once, until it is back or ``stop`` is set."""
        with patient(stop=stop, say=_note):  # a server that goes away is waited for
            self._serve(stop, ready)

    def _serve(self, stop: StopEvent | None, ready: Callable[[], object] | None) -> None:
        self.bus.peek()  # claims the inbox (a second runner is refused here): online now
        self.bus.set_presence("idle")
        children.prepare()  # the first job's keeper starts now, not when the job comes
        if ready is not None:
            ready()
        said = "idle"
        running: dict[Future[None], Message] = {}
        watching: tuple[tuple[str, ...], Waiter | None] = ((), None)
        finished = self._kick  # a job ended or took a lease: wakes the wait below
        woken = Either(stop, finished)
        quiet = time.monotonic()  # since when nothing came: the safety poll stretches
        with ThreadPoolExecutor(self.jobs, thread_name_prefix="ralph-run") as pool:
            try:
                while stop is None or not stop.is_set():
                    finished.clear()
                    self._collect(running, wait_s=0.0)
                    taken = {message.id for message in running.values()}
                    keys = {self.bus.agent}  # my inbox, and channels where a turn goes on
                    wake = min(time.time() + safety_poll(time.monotonic() - quiet),
                               self._renew())  # fmt: skip
                    for message in self.bus.peek():
                        quiet = time.monotonic()
                        if message.id in taken:
                            continue
                        if message.type == MessageType.TASK_CANCELED:
                            self._on_canceled(message)
                            self.bus.consume(message)
                            continue
                        pattern = PATTERNS.get(str(message.type))
                        if pattern == "mention":
                            try:
                                turn = self.bus.channels.turn(message)
                                if turn.standing == "wait":
                                    keys.update(self.bus.channels.watch_keys(message))
                            except _CANNOT as exc:  # a channel it cannot take turns in
                                _note(f"could not answer {_what(message)} ({_why(exc)}): "
                                      "set aside")  # fmt: skip
                                self.bus.consume(message)
                                continue
                            if turn.standing == "done":  # answered before a restart
                                self.bus.consume(message)
                                continue
                            if turn.standing == "wait":
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
                self._collect(running, wait_s=STOP_GRACE_S, every=True)
                for child in list(self._children.values()):
                    end(child)  # the job's whole tree; its answer (the error) goes out
                self._collect(running, wait_s=self.timeout, every=True)
                children.close()  # the keeper waiting for a next job there will not be
                with contextlib.suppress(MailError):
                    presence.went_offline(self.bus.store, self.bus.agent)

    def _renew(self) -> float:
        """Renew the leases that are due (a task that ended meanwhile: its run is
        killed); return when (time.time) the next one is due."""
        interval = tasklog.lease_seconds(dict(self.bus.team.config)) / 3
        now = time.monotonic()
        with self._leases_lock:
            due = [(mid, task) for mid, (task, at) in self._leases.items() if at <= now]
            for mid, task in due:
                self._leases[mid] = (task, now + interval)
            soonest = min((at for _, at in self._leases.values()), default=float("inf"))
        for mid, task in due:
            try:
                self.bus.heartbeat(task)
            except TaskEnded as exc:
                self._kill(mid, str(exc))
            except MailError as exc:  # the next renewal tries again
                _note(f"could not renew the lease of task {task}: {exc}")
        return time.time() + max(0.0, min(soonest, now + WATCH_SAFETY_POLL_MAX_S) - now)

    def _on_canceled(self, notice: Message) -> None:
        """Kill the runs on the task a ``task_canceled`` names, once the task log backs
        it (the task ended, or is another agent's now); a notice it does not back is
        only noted."""
        task_id = notice.metadata.get("taskId", "")
        task = tasklog.load(self.bus.store)[0].get(task_id)
        if task is None or (task.open and task.assignee == self.bus.agent):
            _note(f"task_canceled {notice.id} from {notice.from_agent} for task {task_id!r}: "
                  "the task log does not say so; ignored")  # fmt: skip
            return
        with self._leases_lock:
            runs = [mid for mid, (task, _) in self._leases.items() if task == task_id]
        for mid in runs:
            self._kill(mid, notice.content)

    def _kill(self, message_id: str, why: str) -> None:
        """Kill the run of ``message_id`` and its whole tree now; it sends no answer. A
        run that ended meanwhile (its lease gone) is left alone: marking it would keep
        its id in `_canceled` for good."""
        with self._leases_lock:
            if self._leases.pop(message_id, None) is None:
                return
            self._canceled.add(message_id)
        child = self._children.get(message_id)
        if child is not None:
            children.stop(child)
            _note(f"killed the run of {message_id}: {why}")

    def _collect(
        self, running: dict[Future[None], Message], wait_s: float, every: bool = False
    ) -> None:
        """Consume the requests whose runs ended and were answered, waiting up to
        ``wait_s`` for one (``every``: for all); a job that failed to answer raises here."""
        deadline = time.monotonic() + wait_s
        while running:
            left = max(0.0, deadline - time.monotonic())
            done, _ = wait(running, timeout=left, return_when=FIRST_COMPLETED)
            for future in done:
                message = running.pop(future)
                future.result()
                self.bus.consume(message)
            if not every or not done:
                return

    def _job(self, message: Message, pattern: str) -> None:
        """One request, on a pool thread with a bus of its own (the runner's bus, which
        consumes, stays on its thread): read the history, run, send the answer, log one
        line. A request it cannot run, or whose answer is refused, gets the error
        instead (an error reply, a failed task, a passed turn); when that is refused
        too it is set aside. Either way it is consumed after, with one line on stderr."""
        bus = self._thread_bus()
        began = time.monotonic()
        deadline = None
        if pattern == "delegate":
            try:
                deadline = self._start(bus, message)
            except TaskEnded as exc:  # canceled, moved or past its deadline before it ran
                _note(f"{_what(message)}: not run ({exc})")
                return
        try:
            bus.gate.check_budget()
            outcome = self._run(message, pattern, self._history(bus, message), deadline)
        except BudgetExceeded as exc:
            outcome = Outcome(error=str(exc), status="not run (budget exhausted)")
        except _CANNOT as exc:  # its history cannot be read: a channel it cannot be in
            why = f"cannot answer this request: {exc}"
            outcome = Outcome(error=why, status=f"not run ({why})")
        finally:
            with self._leases_lock:
                self._leases.pop(message.id, None)
        if outcome.spent is not None:  # (a canceled run cost what it cost too)
            self._charge(bus, message, pattern, outcome.spent)
        if message.id in self._canceled:
            self._canceled.discard(message.id)
            _note(f"{_what(message)}: killed in {time.monotonic() - began:.2f} s, its task "
                  "canceled: no answer")  # fmt: skip
            return
        spent = f", ${usage.usd(outcome.spent.cost_usd)}" if outcome.spent else ""
        _note(f"{_what(message)}: {outcome.status} in {time.monotonic() - began:.2f} s{spent}")
        try:
            self._answer(bus, message, outcome)
            return
        except _CANNOT as exc:
            refused = exc
        if not outcome.error:
            try:
                self._answer(bus, message, Outcome(error=f"the answer was refused: {refused}"))
            except _CANNOT:
                pass
            else:
                _note(f"could not answer {_what(message)} ({_why(refused)}): "
                      f"{_INSTEAD[str(message.type)]} instead")  # fmt: skip
                return
        _note(f"could not answer {_what(message)} ({_why(refused)}): set aside")

    def _charge(self, bus: MessageBus, message: Message, pattern: str, spent: usage.Usage) -> None:
        """Record what a run cost; a budget it reached is told to the lead now."""
        task = message.metadata.get("taskId") if pattern == "delegate" else None
        usage.record(bus.store, usage.Record(usage.now_ts(), bus.agent, spent, pattern,
                                             message.id, message.from_agent, task))  # fmt: skip
        with contextlib.suppress(BudgetExceeded):
            bus.gate.check_budget()

    def _start(self, bus: MessageBus, message: Message) -> float | None:
        """Start the task of an assignment (working, with a lease the runner's loop
        renews); return its deadline (time.time), or None. `TaskEnded` when the task
        ended; a task the team's log does not have is run all the same."""
        try:
            task = bus.start(message.metadata.get("taskId", ""))
        except TaskEnded:
            raise
        except MailError:  # not in the team's task tree (sent by hand): nothing to renew
            return None
        interval = tasklog.lease_seconds(dict(bus.team.config)) / 3
        with self._leases_lock:
            self._leases[message.id] = (task.id, time.monotonic() + interval)
        self._kick.set()  # the loop's wait may be longer than the first renewal
        return parse_ts(task.deadline) if task.deadline else None

    def _thread_bus(self) -> MessageBus:
        bus: MessageBus | None = getattr(self._local, "bus", None)
        if bus is None:
            bus = self._local.bus = MessageBus(self.bus.team.name, self.bus.agent, self.home,
                                               default_rate=10)  # fmt: skip
            bus.signer(self.bus.signer())
            with self._buses_lock:
                self._buses.append(bus)
        return bus

    def _answer(self, bus: MessageBus, message: Message, outcome: Outcome) -> None:
        """Send the run's answer, with what it cost (the request is consumed after, never
        before)."""
        cost = outcome.spent.metadata() if outcome.spent is not None else {}
        if message.type == MessageType.MENTION:
            name, post = message.metadata.get("channel", ""), message.reply_to or ""
            if outcome.output and not outcome.error:
                bus.channels.post(name, outcome.output, post, chain=tuple(message.chain))
            else:  # nothing to say, or it failed: the next member goes on
                bus.channels.pass_turn(name, post)
        elif message.type == MessageType.REQUEST:
            if outcome.error:
                bus.reply(message, outcome.error, {**cost, "error": outcome.error})
            else:
                bus.reply(message, outcome.output, cost)
        else:
            task_id = message.metadata.get("taskId", "")
            try:
                if outcome.error:
                    bus.fail(task_id, outcome.error, cost)
                else:
                    bus.complete(task_id, outcome.output, cost)
            except TaskEnded as exc:  # canceled or moved meanwhile: its result is late
                _note(f"{_what(message)}: {exc}")
            except MailError:  # not in the team's task tree: report to whoever gave it
                bus.send(message.from_agent, MessageType.STATUS_UPDATE,
                         outcome.error or outcome.output,
                         {**cost, "state": "failed" if outcome.error else "done",
                          "task": task_id})  # fmt: skip

    def _run(
        self, message: Message, pattern: str, past: list[Message], deadline: float | None = None
    ) -> Outcome:
        """One run of the command for ``message`` (on a pool thread: no mailbox use),
        killed after the timeout or at ``deadline`` (time.time), whichever comes first."""
        history = [m for m in past if m.id not in (message.id, message.reply_to)]
        if self.format == "json":
            history, left_out = capped(history, lambda m: len(orjson.dumps(m.to_dict())) + 1)
            document: dict[str, object] = {"pattern": pattern, "message": message.to_dict(),
                                           "history": [m.to_dict() for m in history]}  # fmt: skip
            if left_out:
                document["history_left_out"] = left_out
            stdin = orjson.dumps(document) + b"\n"
        else:
            history, left_out = capped(history, lambda m: len(_history_line(m).encode()) + 1)
            stdin = prompt(message, history, pattern, left_out).encode()
        env = dict(os.environ)
        env.update(
            RALPH_HOME=self.home, RALPH_TEAM=self.bus.team.name, RALPH_AGENT=self.bus.agent,
            RALPH_MESSAGE_ID=message.id, RALPH_FROM=message.from_agent,
            RALPH_THREAD=message.thread, RALPH_CHAIN=",".join(message.chain),
            RALPH_PATTERN=pattern, RALPH_AGENT_FIXED="1",
        )  # fmt: skip
        if pattern == "delegate":
            env["RALPH_TASK"] = message.metadata.get("taskId", "")
        if pattern == "mention":
            env["RALPH_CHANNEL"] = message.metadata.get("channel", "")
        with children.report_file("ralph-usage-") as report:
            env[usage.USAGE_FILE_VAR] = str(report)
            try:
                child = spawn(self.command, env)
            except (OSError, ValueError) as exc:  # ValueError: a NUL in its environment
                why = f"cannot run {self.command[0]!r}: {getattr(exc, 'strerror', None) or exc}"
                return Outcome(error=why, status=f"not run ({why})")
            self._children[message.id] = child
            if message.id in self._canceled:  # canceled while it started
                children.stop(child)
            limit = max(1024, self.bus.max_message_bytes - _ENVELOPE_ROOM)
            timeout = self.timeout
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - time.time()))
            try:
                code, out, cut, err = communicate(child, stdin, timeout, limit, _STDERR_KEPT)
            finally:
                end(child)  # what it left running (a daemon, even out of its session) goes too
                self._children.pop(message.id, None)
            return self._ended(code, out, cut, err, limit, report, timeout < self.timeout)

    def _ended(self, code: int | None, out: bytes, cut: bool, err: bytes, limit: int,
               report: Path, by_deadline: bool) -> Outcome:  # fmt: skip
        """How a run that ended went: its answer (Claude Code's JSON gives its ``result``)
        or its error, and what it said it cost (in its usage file, else that JSON)."""
        text = out.decode("utf-8", "replace")
        claude = usage.from_claude(text) if not cut else None
        try:
            spent = usage.read_report(report)
        except ValueError as exc:
            _note(f"{self.command[0]} wrote ${usage.USAGE_FILE_VAR} but not a usage report "
                  f"({exc}): its cost is not recorded")  # fmt: skip
            spent = None
        if spent is None and claude is not None:
            spent = claude.usage
        if code is None and by_deadline:
            return Outcome(error=tasklog.DEADLINE_PASSED, status="killed at its deadline",
                           spent=spent)  # fmt: skip
        if code is None:
            return Outcome(error=f"{self.command[0]} ran past {self.timeout:g} s: killed",
                           status=f"killed after {self.timeout:g} s", spent=spent)  # fmt: skip
        if code != 0:
            said = err.decode("utf-8", "replace").strip()[-_STDERR_KEPT:]
            return Outcome(error=f"{self.command[0]} exited {code}"
                           + (f": {said}" if said else ""), status=f"exit {code}",
                           spent=spent)  # fmt: skip
        if claude is not None:
            if claude.error:
                return Outcome(error=claude.error, status="exit 0, is_error", spent=spent)
            text = claude.answer
        text = text[:-1] if text.endswith("\n") and not cut else text
        kept = fit_text(text, limit)  # by its size on the wire, where quotes count twice
        if cut or len(kept) < len(text):
            text = f"{kept}\n[output cut at {len(kept.encode()):,} bytes: the message limit]"
        return Outcome(output=text, spent=spent)

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
        self._kick.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
