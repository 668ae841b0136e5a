"""`ralph-mail top`: a live dashboard of a team (DESIGN §12.2), on Textual (the ``tui``
extra).

Panes: the roster (presence; state, task and progress from the team's task log, or
from the lead's record when it heard later; last seen; unread) with the team's channels
under it; the task tree; a conversation view of the selected agent's inbox, channel or
task thread, in which internal messages fold behind "Internal agent messages (N)" while
user-visible ones stay in view (a hint under it says so; ``i`` unfolds them); and a
status line (team, home, backend, message rate).

Columns are sized for the screen (`layout_for`): at 80 columns every one is whole, with
short words for the long presence states and a 4-cell progress bar; from `WIDE_AT`
columns the names, tasks, bar and descriptions widen and the task tree shows when each
task finished and what its subtree cost (as ``ralph-mail run`` recorded it).

It only looks: it reads tails, presence, cursors and the indexes, never consumes, and
never moves a cursor. It follows file events on a thread of its own (a waiter on every
inbox, channel, the task log and the usage log), so it costs nothing while the team is quiet, and a
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
from typing import TYPE_CHECKING, ClassVar, Final

from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, RichLog, Static

from ralph_mail import settings, usage
from ralph_mail.errors import MailError
from ralph_mail.govern import presence
from ralph_mail.govern.policy import requires_signed
from ralph_mail.message import Message, decode_lines
from ralph_mail.signing import Marks
from ralph_mail.store.base import TeamStore
from ralph_mail.store.search import Query
from ralph_mail.talk import tasks
from ralph_mail.talk.channels import listed
from ralph_mail.team import Roster, Team, load_team

if TYPE_CHECKING:
    from ralph_mail.orchestrator.records import AgentProgress

#: Messages the conversation pane shows at most.
SHOWN: Final = 200
#: Unread bytes read to count an agent's unread messages; past it, the count is "N+".
UNREAD_READ_MAX: Final = 64 * 1024
#: From this screen width on, the wide layout (see `layout_for`).
WIDE_AT: Final = 120
#: Cells kept free at a table's right for its vertical scroll bar.
SCROLLBAR: Final = 2
#: The presence states too long for the column, shortened (README: "The dashboard").
PRESENCE_SHORT: Final = {"awaiting_approval": "approval", "awaiting_delegation": "waiting"}
#: The task states too long for a state column (9 cells), shortened.
STATE_SHORT: Final = {"input_required": "input req"}
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


def money(micro_usd: int) -> str:
    """A cost in at most 6 cells ("" for none).

    >>> [money(n) for n in (0, 4_000, 1_234_567, 56_700_000, 12_345_678_901)]
    ['', '<$0.01', '$1.23', '$57', '$12k']
    """
    dollars = micro_usd / 1e6
    if not micro_usd:
        return ""
    if dollars < 0.01:
        return "<$0.01"
    if dollars < 10:
        return f"${dollars:.2f}"
    return f"${dollars:.0f}" if dollars < 1000 else f"${dollars / 1000:.0f}k"


def clip(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, its end marked "…" when cut."""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


@dataclass(frozen=True, slots=True)
class Layout:
    """The columns of the two tables for one screen width.

    Attributes:
        roster: the roster's columns, ``(header, width)`` each.
        tasks: the task tree's columns, ``(header, width)`` each.
        tasks_pane: the task tree's width in cells (the conversation has the rest).
        bar: the progress bar's width in cells.
    """

    roster: tuple[tuple[str, int], ...]
    tasks: tuple[tuple[str, int], ...]
    tasks_pane: int
    bar: int


def layout_for(width: int) -> Layout:
    """The columns for a screen ``width`` cells wide: fixed widths for the short columns
    (each as wide as its longest word: "completed", "presence"), the rest to the
    description; from `WIDE_AT` on, wider names, tasks and bar, and the finishing time.

    Example:
        >>> [w for _, w in layout_for(80).roster]
        [10, 8, 9, 7, 4, 4, 6, 14]
    """
    wide = width >= WIDE_AT
    bar_cells = 10 if wide else 4
    roster = [("agent", 14 if wide else 10), ("presence", 8), ("state", 9),
              ("task", 12 if wide else 7), ("progress" if wide else "prog", bar_cells),
              ("seen", 4), ("unread", 6)]  # fmt: skip
    roster.append(("does", _rest(width, roster)))
    pane = width // 2 + 8 if wide else width * 3 // 5  # wide: + the cost column (6 + 2)
    tree = [("status", 9), ("assignee", 8)] + ([("done", 5), ("cost", 6)] if wide else [])
    return Layout(tuple(roster), (("task", _rest(pane, tree)), *tree), pane, bar_cells)


def _rest(width: int, columns: list[tuple[str, int]]) -> int:
    """What is left of ``width`` for one more column after ``columns`` (each padded by a
    cell either side) and a scroll bar."""
    used = sum(cells + 2 for _, cells in columns) + 2 + SCROLLBAR
    return max(8, width - used)


def current_tasks(found: dict[str, tasks.Task]) -> dict[str, tasks.Task]:
    """Each assignee's current task in the team's log: the latest unfinished one (one
    worked on before one only submitted), else the latest finished."""
    current: dict[str, tasks.Task] = {}
    for task in found.values():
        known = current.get(task.assignee)
        if known is None or _rank(task) > _rank(known):
            current[task.assignee] = task
    return current


def _rank(task: tasks.Task) -> tuple[bool, bool, str]:
    return task.status not in tasks.FINISHED, task.status != "submitted", task.updated


def shown_state(task: tasks.Task) -> str:
    """``task``'s state as a column shows it: ``stalled`` for a lapsed lease, and
    ``input_required`` shortened to fit."""
    word = tasks.state_of(task)
    return STATE_SHORT.get(word, word)


def subtasks(found: dict[str, tasks.Task]) -> dict[str, list[tasks.Task]]:
    """The tasks of ``found`` by the task they are part of."""
    parts: dict[str, list[tasks.Task]] = {}
    for task in found.values():
        if task.parent is not None:
            parts.setdefault(task.parent, []).append(task)
    return parts


def task_progress(task: tasks.Task, parts: list[tasks.Task]) -> float | None:
    """How far ``task`` is, from the log alone: 1 when completed, 0 while submitted, else
    the share of its subtasks ``parts`` finished (None without any, or when it ended
    otherwise: failed, canceled, rejected)."""
    if task.status == "completed":
        return 1.0
    if parts and task.status not in tasks.FINISHED:
        return sum(t.status in tasks.FINISHED for t in parts) / len(parts)
    return 0.0 if task.status == "submitted" else None


def doing(
    task: tasks.Task | None, known: AgentProgress | None, parts: dict[str, list[tasks.Task]]
) -> tuple[str, str, float | None]:
    """An agent's ``(state, task, progress)`` for the roster: from the lead's record when
    it heard from the agent after the task last changed, else from the task log (the
    task's status), so the roster needs no lead running."""
    if known is not None and known.last_seen and (task is None or known.last_seen > task.updated):
        return known.state, known.task, known.progress
    if task is None:
        return "", "", None
    return shown_state(task), task.id, task_progress(task, parts.get(task.id, []))


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
    #hint { height: auto; color: $text-muted; display: none; }
    #hint.folded { display: block; }
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
        self._roster_now = Roster(self.team)  # the roster read again, to see it change
        self._found: dict[str, tasks.Task] = {}  # the team's tasks, as last read
        self._costs: dict[str, int] = {}  # what each task's subtree cost (micro-USD)
        self._marks = Marks()  # each shown message's signature, checked once
        self._width = 0  # the screen width the columns were made for
        self._layout = layout_for(80)

    # -- layout ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield DataTable(id="roster", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="below"):
            yield DataTable(id="tasks", cursor_type="row")
            with Vertical(id="right"):
                yield Static(id="title")
                # min_width: RichLog's default (78) would wrap past a narrower pane
                yield RichLog(id="conversation", wrap=True, markup=False, highlight=False,
                              min_width=20)  # fmt: skip
                yield Static(id="hint")
        yield Input(placeholder="search every message (words); enter searches", id="search")
        yield Static(id="status")

    def on_mount(self) -> None:
        for name in self.team.names:
            self._sizes[name] = self.store.size(name)
        self._columns(self.size.width)
        self.refresh_all()
        self._follower = threading.Thread(target=self._follow, args=(asyncio.get_running_loop(),),
                                          name="ralph-top", daemon=True)  # fmt: skip
        self._follower.start()
        self.set_interval(1.0, self._tick)

    def on_resize(self, event: events.Resize) -> None:
        if self._width and event.size.width != self._width:  # (0: not mounted yet)
            self._columns(event.size.width)
            self._refresh_roster()
            self._refresh_tasks()

    def _columns(self, width: int) -> None:
        """Make both tables' columns for a screen ``width`` wide (their rows anew)."""
        self._width, self._layout = width, layout_for(width)
        self.query_one("#tasks").styles.width = self._layout.tasks_pane
        for name, columns in (("roster", self._layout.roster), ("tasks", self._layout.tasks)):
            table = self.query_one(f"#{name}", DataTable)
            table.clear(columns=True)
            for header, cells in columns:
                table.add_column(header, width=cells, key=header)
            self._tables.pop(name, None)
        # the log wraps what it is given at its width then: write it again at the new one
        self.call_after_refresh(self._refresh_conversation)

    # -- data -----------------------------------------------------------------------------

    def refresh_all(self) -> None:
        """Redraw every pane from the store (what changed is read again; the rest is
        cached)."""
        self._refresh_conversation()  # first: what was said shows soonest
        self._found, _ = tasks.load(self.store)
        own = usage.task_costs(usage.load(self.store))
        self._costs = usage.subtree_costs(own, {t.id: t.parent for t in self._found.values()})
        self._refresh_roster()
        self._refresh_tasks()
        self._refresh_status()

    def _refresh_roster(self) -> None:
        from ralph_mail.orchestrator import saved_progress

        progress = saved_progress(self.store, self.team.lead)
        current, parts = current_tasks(self._found), subtasks(self._found)
        widths = dict(self._layout.roster)
        now = time.time()
        rows: dict[str, tuple[str | Text, ...]] = {}
        for name in self.team.names:
            here, last_seen, _ = presence.presence_of(self.team, name, now)
            state, task, done = doing(current.get(name), progress.get(name), parts)
            rows[f"agent:{name}"] = (
                clip(name, widths["agent"]), PRESENCE_SHORT.get(here, here), state,
                clip(task, widths["task"]), bar(done, self._layout.bar), since(last_seen, now),
                unread_of(self.store, name, self._unread),
                Text(clip(self.team.member(name).description, widths["does"])),
            )  # fmt: skip
        for channel in listed(self.store):
            label = clip(f"#{channel.name}", widths["agent"])
            rows[f"channel:{channel.name}"] = (label, "channel", *[""] * 6)
        self._show(self.query_one("#roster", DataTable), rows)

    def _refresh_tasks(self) -> None:
        widths = dict(self._layout.tasks)
        rows: dict[str, tuple[str | Text, ...]] = {}
        for prefix, task in tasks.tree_lines(self._found):
            head = clip(f"{prefix}{task.id} {task.description}", widths["task"])
            row: tuple[str | Text, ...] = (Text(head), shown_state(task),
                                           clip(task.assignee, widths["assignee"]))  # fmt: skip
            if "done" in widths:
                row += (task.updated[11:16] if task.status in tasks.FINISHED else "",)
            if "cost" in widths:
                row += (money(self._costs.get(task.id, 0)),)
            rows[f"task:{task.id}"] = row
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
        folds = self.internal and any(m.visibility == "internal" for m in messages)
        toggle = "  (i: fold)" if folds else ""
        self.query_one("#title", Static).update(Text(f" {title}{toggle}", style="bold"))
        hint = self.query_one("#hint", Static)
        hint.set_class(hidden > 0, "folded")
        plural = "" if hidden == 1 else "s"
        hint.update(f" {hidden} internal message{plural} folded: press i to show")
        log = self.query_one("#conversation", RichLog)
        log.clear()
        listed = [item for item in shown if not isinstance(item, int)]
        marks = dict(zip(map(id, listed), self._marks.of(listed, self._roster,
                                                           requires_signed(self.store)),
                         strict=True))  # fmt: skip
        for item in shown:
            if isinstance(item, int):
                log.write(Text(f"  ▸ Internal agent messages ({item})", style="dim italic"))
                continue
            head = Text(f"{item.ts[11:19]} ", style="dim")
            head.append(f"{item.from_agent} → {item.to_agent}", style="bold")
            head.append(f" [{item.type}]", style="cyan")
            if marks[id(item)]:  # a bad signature, or none where one is due
                head.append(f" {marks[id(item)]}", style="bold red")
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
        keys = [*self.team.names, "log:tasks", f"log:{usage.LOG}"]
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
            self._roster()
            self._refresh_roster()
            self._refresh_status()
        except NoMatches:
            return  # the app is closing
        except MailError as exc:
            self.query_one("#status", Static).update(f" {exc}")

    def _roster(self) -> Team:
        """The roster, read again (and parsed when it changed)."""
        self.team = self._roster_now.now()
        return self.team

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
