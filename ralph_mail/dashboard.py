"""`ralph-mail top`: a live dashboard of a team (DESIGN §12.2), on Textual (the ``tui``
extra).

Panes: the roster (presence, the lead's view of state, task and progress, last seen,
unread) with the team's channels under it; the task tree; a conversation view of the
selected agent's inbox, channel or task thread, in which internal messages fold behind
"Internal agent messages (N)" while user-visible ones stay in view (``i`` unfolds them);
and a status line (team, home, backend, message rate).

It only looks: it reads tails, presence, cursors and the indexes, never consumes, and
never moves a cursor. It follows file events on a thread of its own (a waiter on every
inbox, channel and the task log), so it costs nothing while the team is quiet, and a
refresh reads only what changed: what a pane shows is bounded, not the team's mail.

Example:
    >>> Dashboard("demo").run()    # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Final

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, RichLog, Static

from ralph_mail import settings
from ralph_mail.errors import MailError
from ralph_mail.govern import presence
from ralph_mail.message import Message, decode_lines
from ralph_mail.store.base import TeamStore
from ralph_mail.store.search import Query
from ralph_mail.talk.channels import listed
from ralph_mail.team import Team, load_team, parse_roster

#: Messages the conversation pane shows at most.
SHOWN: Final = 200
#: Unread bytes read to count an agent's unread messages; past it, the count is "N+".
UNREAD_READ_MAX: Final = 64 * 1024
#: The widest a task's line (tree, id, description) is shown.
TASK_WIDTH: Final = 40
#: The window the status line's message rate is taken over (s).
RATE_WINDOW_S: Final = 10.0

KEYS: Final = """\
q        quit
tab      next pane (shift+tab: previous)
enter    open the selected agent, channel or task in the conversation pane
i        show or fold the internal agent messages
/        search every message of the team (escape: close)
?        this help"""


@dataclass(frozen=True, slots=True)
class Seen:
    """What an agent's roster row was computed from: redone only when it changed."""

    size: int
    floor: int
    unread: str


def unread_of(store: TeamStore, agent: str, cache: dict[str, Seen]) -> str:
    """How many messages ``agent`` has not consumed: counted from its cursor, reading at
    most `UNREAD_READ_MAX` bytes ("N+" past it); from ``cache`` while nothing moved."""
    size = store.size(agent)
    floor = store.load_cursor(agent).floor
    known = cache.get(agent)
    if known is not None and known.size == size and known.floor == floor:
        return known.unread
    count, more = _lines(store, agent, floor, size)
    unread = f"{count}+" if more else (str(count) if count else "")
    cache[agent] = Seen(size, floor, unread)
    return unread


def _lines(store: TeamStore, key: str, offset: int, end: int) -> tuple[int, bool]:
    """Lines between ``offset`` and ``end`` of log ``key``, counted over at most
    `UNREAD_READ_MAX` bytes; and whether there were more."""
    count, start = 0, offset
    while offset < end:
        data, at = store.read(key, offset, skip_collected=True)
        if not data:
            break
        count += data.count(b"\n")
        offset = at + len(data)
        if offset - start >= UNREAD_READ_MAX and offset < end:
            return count, True
    return count, False


def fold(messages: list[Message], internal: bool) -> list[Message | int]:
    """The conversation as shown: every message with ``internal``, else the user-facing
    ones, each run of internal messages between them folded into its count."""
    if internal:
        return list(messages)
    shown: list[Message | int] = []
    for message in messages:
        if message.visibility != "internal":
            shown.append(message)
        elif shown and isinstance(shown[-1], int):
            shown[-1] += 1
        else:
            shown.append(1)
    return shown


def since(ts: str, now: float) -> str:
    """How long ago ``ts`` was, shortly ("12s", "5m", "3h", "2d"); "" for never."""
    if not ts:
        return ""
    from ralph_mail.message import parse_ts

    seconds = max(0.0, now - parse_ts(ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def bar(progress: float | None, width: int = 8) -> str:
    """A progress bar of ``width`` cells ("" when unknown)."""
    if progress is None:
        return ""
    done = round(max(0.0, min(1.0, progress)) * width)
    return "█" * done + "░" * (width - done)


class Help(ModalScreen[None]):
    """The keys."""

    BINDINGS: ClassVar = [Binding("escape,q,question_mark", "dismiss", "close")]
    DEFAULT_CSS = "Help { align: center middle; } #keys { width: 60; height: auto; " \
                  "border: round $accent; padding: 1 2; background: $surface; }"  # fmt: skip

    def compose(self) -> ComposeResult:
        yield Static(KEYS, id="keys")


class Dashboard(App[None]):
    """The dashboard of one team (see the module docstring)."""

    TITLE = "ralph-mail top"
    CSS = """
    #roster { height: 2fr; }
    #below { height: 3fr; }
    #tasks { width: 1fr; }
    #right { width: 1fr; }
    #title { height: 1; background: $boost; }
    #conversation { height: 1fr; }
    #search { dock: bottom; display: none; }
    #search.open { display: block; }
    #status { dock: bottom; height: 1; background: $primary-background; }
    """
    BINDINGS: ClassVar = [
        Binding("q", "quit", "quit"),
        Binding("i", "internal", "internal"),
        Binding("slash", "search", "search"),
        Binding("question_mark", "help", "keys"),
        Binding("escape", "close_search", show=False),
    ]

    def __init__(self, team: str, home: str | None = None) -> None:
        super().__init__()
        self.team: Team = load_team(team, home)
        self.store = self.team.store
        self.internal = False
        self.opened = ("agent", self.team.lead)  # what the conversation pane shows
        self._unread: dict[str, Seen] = {}
        self._arrivals: deque[tuple[float, int]] = deque()
        self._stop = threading.Event()
        self._due = threading.Event()  # a refresh is scheduled on the app's loop
        self._follower: threading.Thread | None = None
        self._sizes: dict[str, int] = {}
        self._tables: dict[str, dict[str, tuple[str | Text, ...]]] = {}  # what each shows
        self._roster_raw = self.store.roster()  # the roster as loaded, to see it change

    # -- layout ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield DataTable(id="roster", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="below"):
            yield DataTable(id="tasks", cursor_type="row")
            with Vertical(id="right"):
                yield Static(id="title")
                yield RichLog(id="conversation", wrap=True, markup=False, highlight=False)
        yield Input(placeholder="search every message (words); enter searches", id="search")
        yield Static(id="status")

    def on_mount(self) -> None:
        roster = self.query_one("#roster", DataTable)
        roster.add_columns("agent", "presence", "state", "task", "progress", "seen", "unread",
                           "does")  # fmt: skip
        tasks = self.query_one("#tasks", DataTable)
        tasks.add_columns("task", "status", "assignee", "done")
        for name in self.team.names:
            self._sizes[name] = self.store.size(name)
        self.refresh_all()
        self._follower = threading.Thread(target=self._follow, args=(asyncio.get_running_loop(),),
                                          name="ralph-top", daemon=True)  # fmt: skip
        self._follower.start()
        self.set_interval(1.0, self._tick)

    # -- data -----------------------------------------------------------------------------

    def refresh_all(self) -> None:
        """Redraw every pane from the store (what changed is read again; the rest is
        cached)."""
        self._refresh_conversation()  # first: what was said shows soonest
        self._refresh_roster()
        self._refresh_tasks()
        self._refresh_status()

    def _refresh_roster(self) -> None:
        from ralph_mail.orchestrator import saved_progress

        progress = saved_progress(self.store, self.team.lead)
        now = time.time()
        rows: dict[str, tuple[str | Text, ...]] = {}
        for name in self.team.names:
            state, last_seen, _ = presence.presence_of(self.team, name, now)
            known = progress.get(name)
            rows[f"agent:{name}"] = (
                name, state, known.state if known else "", known.task if known else "",
                bar(known.progress) if known else "", since(last_seen, now),
                unread_of(self.store, name, self._unread),
                Text(self.team.member(name).description),
            )  # fmt: skip
        for channel in listed(self.store):
            rows[f"channel:{channel.name}"] = (f"#{channel.name}", "channel", *[""] * 6)
        self._show(self.query_one("#roster", DataTable), rows)

    def _refresh_tasks(self) -> None:
        from ralph_mail.talk import tasks

        found, _ = tasks.load(self.store)
        rows: dict[str, tuple[str | Text, ...]] = {}
        for prefix, task in tasks.tree_lines(found):
            done = task.updated[11:16] if task.status in tasks.FINISHED else ""
            head = f"{prefix}{task.id} {task.description}"
            head = head if len(head) <= TASK_WIDTH else head[: TASK_WIDTH - 1] + "…"
            rows[f"task:{task.id}"] = (Text(head), task.status, task.assignee, done)
        self._show(self.query_one("#tasks", DataTable), rows)

    def _show(self, table: DataTable[str | Text], rows: dict[str, tuple[str | Text, ...]]) -> None:
        """Show ``rows`` (by key): the cells that changed when the rows are the same ones
        (a redraw of a big table costs the app tens of milliseconds), else all anew."""
        shown: dict[str, tuple[str | Text, ...]] = self._tables.setdefault(table.id or "", {})
        if list(shown) == list(rows):
            columns = list(table.columns)
            for key, row in rows.items():
                for column, old, new in zip(columns, shown[key], row, strict=True):
                    if str(old) != str(new):
                        table.update_cell(key, column, new, update_width=True)
        else:
            keep = table.cursor_row
            table.clear()
            for key, row in rows.items():
                table.add_row(*row, key=key)
            if table.row_count:
                table.move_cursor(row=min(keep, table.row_count - 1))
        self._tables[table.id or ""] = dict(rows)

    def _messages(self) -> tuple[str, list[Message]]:
        kind, name = self.opened
        if kind == "search":
            lines = self.store.search(Query(words=name, limit=SHOWN))
            return f"search: {name}", _decoded(list(reversed(lines)))
        if kind == "task":
            found = []
            for inbox, offset, length in self.store.index_tail(f"thread+{name}", SHOWN):
                line = self.store.read_line(inbox, offset, length)
                if line is not None:
                    found.append(line)
            return f"task thread {name}", _decoded(found)
        key = f"#{name}" if kind == "channel" else name
        lines, _ = self.store.read_tail(key, SHOWN)
        return (f"#{name}" if kind == "channel" else f"inbox of {name}"), _decoded(lines)

    def _refresh_conversation(self) -> None:
        title, messages = self._messages()
        shown = fold(messages, self.internal)
        hidden = sum(item for item in shown if isinstance(item, int))
        toggle = "i: fold" if self.internal else f"i: show {hidden} internal"
        self.query_one("#title", Static).update(Text(f" {title}  ({toggle})", style="bold"))
        log = self.query_one("#conversation", RichLog)
        log.clear()
        for item in shown:
            if isinstance(item, int):
                log.write(Text(f"  ▸ Internal agent messages ({item})", style="dim italic"))
                continue
            head = Text(f"{item.ts[11:19]} ", style="dim")
            head.append(f"{item.from_agent} → {item.to_agent}", style="bold")
            head.append(f" [{item.type}]", style="cyan")
            if item.visibility != "internal":
                head.append(f" {item.visibility}", style="green")
            log.write(head)
            log.write(Text("  " + item.content))
        if not messages:
            log.write(Text("  no messages", style="dim"))

    def _refresh_status(self) -> None:
        now = time.monotonic()
        while self._arrivals and self._arrivals[0][0] < now - RATE_WINDOW_S:
            self._arrivals.popleft()
        rate = sum(count for _, count in self._arrivals) / RATE_WINDOW_S
        backend = settings.backend() or "files"
        self.query_one("#status", Static).update(
            f" {self.team.name} · {self.team.home} · {backend} · {rate:.1f} msg/s · ? keys · q quit"
        )

    # -- following ------------------------------------------------------------------------

    def _follow(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait on file events (every inbox, channel and the task log) and have the app's
        loop refresh at once; events that come meanwhile make one refresh after it."""
        keys = [*self.team.names, "log:tasks"]
        keys += [f"#{channel.name}" for channel in listed(self.store)]
        waiter = self.store.waiter(keys)
        try:
            while not self._stop.is_set():
                if waiter.wait(settings.WATCH_SAFETY_POLL_S, self._stop) and not self._due.is_set():
                    self._due.set()
                    try:
                        loop.call_soon_threadsafe(self._changed_now)
                    except RuntimeError:  # the app's loop is closed: it is gone
                        return
        finally:
            waiter.close()

    def _changed_now(self) -> None:
        self._due.clear()
        if self._stop.is_set() or not self.is_running:
            return  # scheduled while the app was closing: its widgets may be gone
        try:
            self._count_arrivals()
            self.refresh_all()
        except NoMatches:
            return  # the app is closing (its screen went first)
        except MailError as exc:
            self.query_one("#status", Static).update(f" {exc}")

    def _count_arrivals(self) -> None:
        """Note how many messages came since the last look, for the rate."""
        arrived = 0
        for name in self.team.names:
            size = self.store.size(name)
            before = self._sizes.get(name, size)
            if size > before:
                arrived += _lines(self.store, name, before, size)[0]
            self._sizes[name] = size
        if arrived:
            self._arrivals.append((time.monotonic(), arrived))

    def _tick(self) -> None:
        """Once a second: presence and "seen" age without any event, and the roster read
        again when it changed (a description, a manager, a mode)."""
        try:
            raw = self.store.roster()
            if raw != self._roster_raw:
                self._roster_raw = raw
                self.team = parse_roster(raw, self.team.home, self.team.name, self.store)
            self._refresh_roster()
            self._refresh_status()
        except NoMatches:
            return  # the app is closing
        except MailError as exc:
            self.query_one("#status", Static).update(f" {exc}")

    # -- actions --------------------------------------------------------------------------

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        kind, _, name = str(event.row_key.value).partition(":")
        self.opened = (kind, name)
        self._refresh_conversation()

    def action_internal(self) -> None:
        self.internal = not self.internal
        self._refresh_conversation()

    def action_search(self) -> None:
        box = self.query_one("#search", Input)
        box.add_class("open")
        box.focus()

    def action_close_search(self) -> None:
        box = self.query_one("#search", Input)
        box.remove_class("open")
        self.query_one("#roster", DataTable).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.opened = ("search", event.value)
        self.action_close_search()
        self._refresh_conversation()

    def action_help(self) -> None:
        self.push_screen(Help())

    async def action_quit(self) -> None:
        self._stop.set()  # no refresh is started once the app begins to close
        await super().action_quit()

    def on_unmount(self) -> None:
        self._stop.set()


def _decoded(lines: list[bytes]) -> list[Message]:
    return [m for m in decode_lines(lines)[0] if isinstance(m, Message)]
