"""``python -m bench``: run every measurement once, then report, write JSON and plots.

Examples::

    python -m bench                       # the full run (several minutes)
    python -m bench --quick --json r.json # about a minute
    python -m bench --smoke               # seconds; what the test suite runs
    python -m bench --page docs/performance.md  # also rewrite the page's tables
    python -m bench --only ask --peer-venv /tmp/am --make-peer-venv  # with MCP Agent Mail
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import orjson

from bench import peer_venv, report
from bench.common import REPO_ROOT, SIZES, Section, Sizes, Workspace, log

#: Measurement modules in the order they run; each has ``run(sizes, ws) -> Section``.
SECTIONS = (
    "send", "writers", "read", "wakeup", "ask", "conversation", "receipts", "search",
    "channels", "mcp_server", "dashboard", "nats_backend", "cli", "fanout", "scale", "members",
    "serve", "hotpath",
)  # fmt: skip
DEFAULT_OUT = REPO_ROOT / "bench" / "out"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: mode, outputs, and a section filter for working on one part."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="about a minute, fewer repetitions")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (for tests)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write all results as JSON")
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"directory for plots and report.md (default {DEFAULT_OUT})",
    )
    p.add_argument(
        "--page",
        type=Path,
        metavar="FILE",
        help="also write the report into FILE (docs/performance.md), between its bench: markers",
    )
    p.add_argument("--only", metavar="NAMES", help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument(
        "--peer-venv",
        type=Path,
        metavar="PATH",
        help="a virtual environment with mcp-agent-mail 0.1.0, for the ask section's peer row",
    )
    p.add_argument(
        "--make-peer-venv",
        action="store_true",
        help="create --peer-venv (python -m venv, pip install mcp-agent-mail==0.1.0) if missing",
    )
    return p.parse_args(argv)


def run_sections(names: list[str], sizes: Sizes, ws: Workspace) -> dict[str, Section]:
    """Run each named section; one that crashes becomes an empty section that says so."""
    secs: dict[str, Section] = {}
    for name in names:
        log(f"{name} …")
        mod = importlib.import_module(f"bench.{name}")
        t0 = time.monotonic()
        try:
            sec = mod.run(sizes, ws)
        except Exception as exc:
            sec = Section(name, f"{name}: FAILED ({type(exc).__name__}: {exc})")
        sec.seconds = time.monotonic() - t0
        secs[name] = sec
        log(f"{name} done in {sec.seconds:.1f} s")
    return secs


def main(argv: list[str] | None = None) -> int:
    """Run the bench; exit 0 even when targets are missed (it measures, it does not judge)."""
    args = parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    names = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(","))
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        print(
            f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}",
            file=sys.stderr,
        )
        return 2
    sizes = SIZES[mode]
    if args.page is not None and (problem := report.page_problem(args.page)):
        print(problem, file=sys.stderr)  # before the run, not after minutes of it
        return 2
    if args.make_peer_venv and args.peer_venv is None:
        print("--make-peer-venv needs --peer-venv PATH: where to make it", file=sys.stderr)
        return 2
    if args.make_peer_venv:
        problem = peer_venv.make(args.peer_venv)
        if problem:
            print(problem, file=sys.stderr)
            return 2
    ws = Workspace()
    ws.peer_venv = args.peer_venv
    meta: dict[str, object] = {
        "mode": mode,
        "command": "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": report.machine(),
    }
    t0 = time.monotonic()
    try:
        secs = run_sections(list(names), sizes, ws)
    finally:
        if args.keep:
            log(f"scratch kept in {ws.root}")
        else:
            ws.cleanup()
    meta["seconds"] = time.monotonic() - t0
    meta["loadavg_end"] = os.getloadavg()
    tgts = report.targets(secs)
    report.print_report(secs, tgts)
    args.out.mkdir(parents=True, exist_ok=True)
    plots = "plots skipped (--no-plots)" if args.no_plots else report.plots(secs, args.out)
    meta["plots"] = plots
    markdown = report.markdown(secs, tgts, meta)
    (args.out / "report.md").write_text(markdown, encoding="utf-8")
    if args.page is not None:
        report.write_page(args.page, markdown)
        log(f"tables written into {args.page}")
    doc = report.to_json(secs, tgts, meta)
    if args.json:
        args.json.write_bytes(
            orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
        )
        log(f"JSON written to {args.json}")
    log(f"plots: {plots}; report: {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
