"""Shared plumbing for the measurements: sizes, statistics, result rows, a scratch area.

Every measurement module returns a :class:`Section` of :class:`Row` objects. A row
keeps its raw per-repetition values, so the report can show median and min-max and
the JSON keeps everything needed to check a figure later.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final, Literal

import orjson

REPO_ROOT: Final = Path(__file__).resolve().parent.parent

#: The body of every benchmark message: about the size of a real status update, so a
#: whole line is ~330 bytes, the size MEASUREMENTS.md used for its figures.
CONTENT: Final = (
    "parsed 1,204 log files in /var/log/app; 3 warnings (deprecated config keys), "
    "no errors. Next: index the parsed records and upload the summary to the lead."
)
METADATA: Final = {"state": "working", "task": "T-17", "progress": "0.42"}

Better = Literal["higher", "lower"]


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much work each measurement does in one mode.

    Fields: ``name`` of the mode; ``reps`` repetitions of every throughput case;
    ``send_n`` sends per repetition; ``durable_n`` fsync'd sends per repetition;
    ``peer_n`` puts per repetition for the peer queues; ``array_sends`` sends per
    repetition into the JSON-array inbox, keyed by its starting size;
    ``writer_counts`` the process counts; ``writer_n`` sends per writer process;
    ``writer_reps`` repetitions of each count; ``read_sizes`` the batch sizes polled;
    ``backlogs`` the inbox sizes behind a small poll; ``backlog_polls`` small polls
    per backlog; ``wake_n`` messages per wake-up repetition; ``wake_reps``
    repetitions; ``idle_s`` seconds over which idle CPU is measured; ``cli_runs``
    runs per command; ``fanout_sizes`` broadcast team sizes; ``fanout_n``
    broadcasts per repetition; ``tail_backlog`` messages in the inbox ``tail`` reads;
    ``tail_runs`` runs of ``tail``; ``peer_asks`` round trips of MCP Agent Mail;
    ``history_small`` and ``history_big`` the other messages a conversation is buried
    under; ``history_runs`` calls of ``history`` timed; ``tree_tasks`` and
    ``tree_events`` the size of the task log ``tasks`` folds; ``search_n`` the messages
    searched; ``run_samples`` asks answered by ``ralph-mail run``; ``turn_agents``
    runners mentioned in one post, ``turn_posts`` times; ``growth_small`` and
    ``growth_big`` the messages of a team's history, ``growth_threads`` its threads, for
    the cost of send and ask as history grows; ``rss_asks`` asks through a long-lived pair.
    """

    name: str
    reps: int
    send_n: int
    durable_n: int
    peer_n: int
    array_sends: dict[int, int]
    writer_counts: tuple[int, ...]
    writer_n: int
    writer_reps: int
    read_sizes: tuple[int, ...]
    backlogs: tuple[int, ...]
    backlog_polls: int
    wake_n: int
    wake_reps: int
    idle_s: float
    cli_runs: int
    fanout_sizes: tuple[int, ...]
    fanout_n: int
    tail_backlog: int
    tail_runs: int
    peer_asks: int
    history_small: int
    history_big: int
    history_runs: int
    tree_tasks: int
    tree_events: int
    search_n: int
    run_samples: int
    turn_agents: int
    turn_posts: int
    growth_small: int
    growth_big: int
    growth_threads: int
    rss_asks: int


SIZES: Final[dict[str, Sizes]] = {
    "full": Sizes(
        name="full",
        reps=7,
        send_n=20_000,
        durable_n=2_000,
        peer_n=5_000,
        array_sends={100: 50, 1_000: 20, 10_000: 5},
        writer_counts=(1, 4, 16),
        writer_n=5_000,
        writer_reps=5,
        read_sizes=(1_000, 100_000),
        backlogs=(1_000, 100_000, 1_000_000),
        backlog_polls=300,
        wake_n=500,
        wake_reps=3,
        idle_s=5.0,
        cli_runs=40,
        fanout_sizes=(10, 100),
        fanout_n=100,
        tail_backlog=1_000_000,
        tail_runs=7,
        peer_asks=30,
        history_small=2_000,
        history_big=200_000,
        history_runs=200,
        tree_tasks=10_000,
        tree_events=100_000,
        search_n=1_000_000,
        run_samples=200,
        turn_agents=10,
        turn_posts=10,
        growth_small=1_000,
        growth_big=1_000_000,
        growth_threads=10_000,
        rss_asks=100_000,
    ),
    "quick": Sizes(
        name="quick",
        reps=3,
        send_n=5_000,
        durable_n=500,
        peer_n=1_000,
        array_sends={100: 20, 1_000: 10, 10_000: 3},
        writer_counts=(1, 4, 16),
        writer_n=2_000,
        writer_reps=3,
        read_sizes=(1_000, 100_000),
        backlogs=(1_000, 100_000, 1_000_000),
        backlog_polls=100,
        wake_n=200,
        wake_reps=2,
        idle_s=2.0,
        cli_runs=12,
        fanout_sizes=(10, 100),
        fanout_n=20,
        tail_backlog=1_000_000,
        tail_runs=3,
        peer_asks=10,
        history_small=2_000,
        history_big=200_000,
        history_runs=50,
        tree_tasks=10_000,
        tree_events=100_000,
        search_n=200_000,
        run_samples=50,
        turn_agents=10,
        turn_posts=3,
        growth_small=1_000,
        growth_big=100_000,
        growth_threads=2_000,
        rss_asks=10_000,
    ),
    "smoke": Sizes(
        name="smoke",
        reps=1,
        send_n=50,
        durable_n=5,
        peer_n=20,
        array_sends={100: 2, 1_000: 1},
        writer_counts=(1, 2),
        writer_n=20,
        writer_reps=1,
        read_sizes=(100,),
        backlogs=(100, 1_000),
        backlog_polls=3,
        wake_n=3,
        wake_reps=1,
        idle_s=0.2,
        cli_runs=1,
        fanout_sizes=(3,),
        fanout_n=2,
        tail_backlog=1_000,
        tail_runs=1,
        peer_asks=2,
        history_small=20,
        history_big=200,
        history_runs=2,
        tree_tasks=20,
        tree_events=200,
        search_n=2_000,
        run_samples=3,
        turn_agents=3,
        turn_posts=1,
        growth_small=100,
        growth_big=300,
        growth_threads=20,
        rss_asks=100,
    ),
}


@dataclass(frozen=True, slots=True)
class Stat:
    """Median, minimum and maximum of ``n`` values, the summary every row reports."""

    median: float
    min: float
    max: float
    n: int


def summarize(values: Sequence[float]) -> Stat:
    """Summarise repetitions; NaN when there were none, so a failed case still prints."""
    if not values:
        return Stat(math.nan, math.nan, math.nan, 0)
    return Stat(statistics.median(values), min(values), max(values), len(values))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: a value that was actually observed, never interpolated."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(slots=True)
class Row:
    """One measured case.

    Fields: ``key`` a stable identifier (the JSON and the targets refer to it);
    ``label`` what a person reads; ``unit`` of ``values``; ``better`` whether higher
    or lower is better; ``values`` one figure per repetition; ``anchor`` the key of
    the row in the same section it is compared with; ``status`` "ok", or why there
    is no figure ("not installed: …", "unavailable: …", "failed: …"); ``extra``
    further figures (percentiles, memory) as name → (median, min, max); ``note``.
    """

    key: str
    label: str
    unit: str
    better: Better
    values: list[float] = field(default_factory=list)
    anchor: str | None = None
    status: str = "ok"
    extra: dict[str, list[float]] = field(default_factory=dict)
    note: str = ""

    @property
    def stat(self) -> Stat:
        """Summary of the per-repetition values."""
        return summarize(self.values)

    @property
    def ok(self) -> bool:
        """True when the row has a figure to compare."""
        return self.status == "ok" and bool(self.values)

    def to_json(self) -> dict[str, Any]:
        """The row as plain data, with its summary next to the raw values."""
        data = asdict(self)
        st = self.stat
        data.update(median=st.median, min=st.min, max=st.max, n=st.n)
        data["extra"] = {k: _summary_dict(v) for k, v in self.extra.items()}
        return data


def _summary_dict(values: list[float]) -> dict[str, Any]:
    st = summarize(values)
    return {"median": st.median, "min": st.min, "max": st.max, "values": values}


@dataclass(slots=True)
class Section:
    """The rows of one measurement module plus any raw samples worth plotting.

    Fields: ``name`` (the JSON key); ``title``; ``rows``; ``samples`` raw series by
    row key (wake-up latencies, writer throughput) for plots; ``seconds`` how long
    the section took.
    """

    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    samples: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def row(self, key: str) -> Row | None:
        """The row with this key, if the section has it."""
        return next((r for r in self.rows if r.key == key), None)

    def add(self, row: Row) -> Row:
        """Append and return ``row`` so callers can keep filling it."""
        self.rows.append(row)
        return row

    def to_json(self) -> dict[str, Any]:
        """The section as plain data."""
        return {
            "title": self.title,
            "seconds": self.seconds,
            "rows": [r.to_json() for r in self.rows],
            "samples": self.samples,
        }


def cost_ratio(row: Row, anchor: Row) -> float:
    """How many times the anchor's cost this row costs (>1 means slower than the anchor).

    Rates are inverted so that every ratio in the report reads the same way.
    """
    if not (row.ok and anchor.ok):
        return math.nan
    a, b = row.stat.median, anchor.stat.median
    if row.better == "higher":
        return b / a if a else math.inf
    return a / b if b else math.inf


def optional_module(name: str) -> ModuleType | str:
    """Import an optional package, or return why it is missing ("not installed: …")."""
    if importlib.util.find_spec(name) is None:
        return f"not installed: {name}"
    try:
        return importlib.import_module(name)
    except Exception as exc:  # a broken install must not stop the other rows
        return f"not importable: {name} ({type(exc).__name__}: {exc})"


def ralph() -> ModuleType | str:
    """The ralph_mail package if its public API imports, else why not.

    The bench is written before and alongside the core, so the core's absence is a
    status for every ralph_mail row, not a crash.
    """
    mod = optional_module("ralph_mail")
    if isinstance(mod, str):
        return mod.replace("not installed", "unavailable")
    missing = [n for n in ("MessageBus", "MessageType", "create_team") if not hasattr(mod, n)]
    if missing:
        return f"unavailable: ralph_mail lacks {', '.join(missing)}"
    return mod


def process_cpu_us(pid: int) -> float:
    """The user and system CPU time of process ``pid`` so far, in µs (Linux's /proc, in
    clock ticks: a hundredth of a second here, a few thousand asks' worth)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e6 / os.sysconf("SC_CLK_TCK")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for child processes: the repo on the path, and never the real home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALPH_")}
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if "RALPH_HOME" in os.environ:  # the Workspace's private home, never ~/.ralph
        env["RALPH_HOME"] = os.environ["RALPH_HOME"]
    env["RALPH_WARM"] = "0"  # a command runs in its own process (not on a warm server
    if extra:  # the user may run), unless the case says otherwise
        env.update(extra)
    return env


def _ts(i: int) -> bytes:
    """A wire timestamp i microseconds after 2026-01-01: increasing, as in a real inbox."""
    secs, micros = divmod(i, 1_000_000)
    return b"2026-01-01T%02d:%02d:%02d.%06dZ" % (secs // 3600, secs // 60 % 60, secs % 60, micros)


def message_dict(i: int, template: dict[str, Any] | None = None) -> dict[str, Any]:
    """The i-th synthetic message in the on-disk envelope (DESIGN.md §3).

    With a ``template`` (a line ralph_mail really wrote) every key it has is kept, so
    synthetic inboxes stay byte-compatible with whatever the core writes.
    """
    ts = _ts(i).decode()
    base: dict[str, Any] = (
        dict(template)
        if template
        else {
            "from": "sender",
            "to": "reader",
            "type": "text",
            "content": CONTENT,
            "metadata": METADATA,
        }
    )
    base["id"] = f"{i:012x}"
    base["ts"] = ts
    return base


class Workspace:
    """A scratch directory for one run, and caches of what is costly to build.

    Everything the bench writes lives under one temporary directory that is removed
    at the end; ``RALPH_HOME`` points inside it so nothing can reach ``~/.ralph``.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="ralph-bench-"))
        self._counter = 0
        self._inboxes: dict[int, Path] = {}
        self._template: dict[str, Any] | None = None
        #: The virtual environment MCP Agent Mail is installed in (``--peer-venv``).
        self.peer_venv: Path | None = None
        # A user's RALPH_DURABLE or size limit would silently change what is measured.
        for name in [k for k in os.environ if k.startswith("RALPH_")]:
            del os.environ[name]
        os.environ["RALPH_HOME"] = str(self.root / "default-home")
        # Child processes cache compiled bytecode in the scratch area. A regular install
        # ships .pyc files; without them (PYTHONDONTWRITEBYTECODE, a read-only editable
        # checkout) every command line run would recompile ralph_mail, ~25 ms a start.
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = str(self.root / "pycache")

    def fresh(self, name: str) -> Path:
        """A new, empty, private directory whose name says what it is for."""
        self._counter += 1
        path = self.root / f"{self._counter:04d}-{name}"
        path.mkdir(mode=0o700)
        return path

    def template(self) -> dict[str, Any] | None:
        """A message line exactly as ralph_mail writes it, or None without the core."""
        if self._template is None:
            rm = ralph()
            if isinstance(rm, str):
                return None
            home = self.fresh("template")
            rm.create_team("tpl", ["sender", "reader"], home=home)
            bus = rm.MessageBus("tpl", "sender", home=home)
            try:
                bus.send("reader", rm.MessageType.TEXT, CONTENT, metadata=METADATA)
            finally:
                bus.close()
            line = (home / "teams/tpl/mailbox/reader.jsonl").read_bytes().splitlines()[0]
            self._template = orjson.loads(line)
        return self._template

    def line(self, i: int = 0) -> bytes:
        """One encoded message line, the same size as the ones ralph_mail writes."""
        return orjson.dumps(message_dict(i, self.template())) + b"\n"

    def inbox_file(self, n: int) -> Path:
        """A cached file of ``n`` valid message lines (built once per run, then copied).

        Built from one encoded template with the id and ts spliced in as bytes: five times
        faster than encoding a million dicts, and byte-identical to encoding each one.
        """
        if n not in self._inboxes:
            path = self.root / f"inbox-{n}.jsonl"
            marked = dict(message_dict(0, self.template()), id="@@ID@@", ts="@@TS@@")
            fmt = orjson.dumps(marked).replace(b"%", b"%%")
            fmt = fmt.replace(b"@@ID@@", b"%012x").replace(b"@@TS@@", b"%s") + b"\n"
            first = message_dict(0, self.template())
            assert fmt % (0, first["ts"].encode()) == orjson.dumps(first) + b"\n"
            with path.open("wb") as f:
                for lo in range(0, n, 10_000):
                    f.write(b"".join(fmt % (i, _ts(i)) for i in range(lo, min(n, lo + 10_000))))
            self._inboxes[n] = path
        return self._inboxes[n]

    def place_inbox(self, dest: Path, n: int) -> None:
        """Append ``n`` message lines to the inbox ``dest`` (created private if absent).

        Appending keeps the inode and mode of an inbox the core already opened.
        """
        fd = os.open(dest, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with open(self.inbox_file(n), "rb") as src, open(fd, "ab") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    def cleanup(self) -> None:
        """Remove every file the run wrote."""
        shutil.rmtree(self.root, ignore_errors=True)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes, on the monotonic high-resolution clock."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleave(reps: int, cases: Sequence[Callable[[], None]]) -> None:
    """Run every case once per repetition, round-robin.

    Round-robin instead of case after case: on a shared machine a burst of someone
    else's load then lands on all cases alike, so their ratios stay honest.
    """
    for _ in range(reps):
        for case in cases:
            case()


def log(msg: str) -> None:
    """Progress on stderr, so stdout stays the report."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
