"""Many writers: K processes send into ONE inbox at once; aggregate rate and lock wait.

The writers are real processes released together by a start gun (bench.procs), so
they contend for the inbox lock for real. Each times every send; with the lock taken
inside the send, that time is the lock wait plus the append, which is what a sender
experiences. The anchor is the same harness around a bare ``fcntl.flock`` + write.
After each run the inbox is checked: exactly K x n (+ warm-up) lines, each valid JSON.
"""

from __future__ import annotations

from array import array
from pathlib import Path

import orjson

from bench.common import Row, Section, Sizes, Workspace, message_dict, percentile, ralph
from bench.procs import Child, StartGun, running

#: Sends each writer makes before the gun, so lazy opens are out of the timing.
WARMUP = 10
#: Bound on one whole run (all writers), generous for 16 processes on 2 cores.
RUN_TIMEOUT_S = 300.0

KINDS = {
    "ralph": "ralph_mail send",
    "flock": "bare fcntl.flock + os.write (anchor)",
}


def one_run(ws: Workspace, kind: str, k: int, n: int) -> tuple[float, list[int], bool]:
    """Run ``k`` writers of ``kind``; return (aggregate msg/s, latencies ns, verified)."""
    home = ws.fresh(f"writers-{kind}-{k}")
    base: dict[str, object] = {"kind": kind, "n": n, "warm": WARMUP}
    if kind == "ralph":
        rm = ralph()
        assert not isinstance(rm, str)
        rm.create_team("w", ["sink"] + [f"w{i}" for i in range(k)], home=home)
        inbox = home / "teams/w/mailbox/sink.jsonl"
        base.update(home=str(home), team="w", to="sink")
    else:
        inbox = home / "sink.jsonl"
        base.update(
            inbox=str(inbox), lock=str(home / "sink.lock"), template=message_dict(0, ws.template())
        )
    gun = StartGun()
    outs = [home / f"lat{i}.bin" for i in range(k)]
    try:
        with running([]) as kids:
            for i in range(k):
                spec = dict(base, agent=f"w{i}", out=str(outs[i]), gun=gun.read_fd)
                kids.append(Child(["writer", orjson.dumps(spec).decode()], [gun.read_fd]))
            for kid in kids:
                kid.expect("ready")
            gun.fire()
            spans = [kid.expect("done", RUN_TIMEOUT_S).split() for kid in kids]
    finally:
        gun.close()
    start = min(int(s[0]) for s in spans)
    end = max(int(s[1]) for s in spans)
    lat = array("q")
    for out in outs:
        lat.frombytes(out.read_bytes())
    return k * n / ((end - start) / 1e9), lat.tolist(), verify(inbox, k * (n + WARMUP))


def verify(inbox: Path, expected: int) -> bool:
    """True when the inbox holds exactly ``expected`` lines and every one parses."""
    lines = inbox.read_bytes().split(b"\n")
    if lines[-1] != b"" or len(lines) - 1 != expected:
        return False
    try:
        for line in lines[:-1]:
            orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return True


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Measure every (kind, K) pair, round-robin over ``sizes.writer_reps``."""
    sec = Section("writers", "Many writers into one inbox (aggregate messages/s)")
    rm = ralph()
    rows: dict[tuple[str, int], Row] = {}
    for kind, label in KINDS.items():
        for k in sizes.writer_counts:
            status = rm if (kind == "ralph" and isinstance(rm, str)) else "ok"
            rows[kind, k] = sec.add(
                Row(
                    f"{kind}_{k}",
                    f"{label}, {k} writer{'s' if k > 1 else ''}",
                    "msg/s",
                    "higher",
                    anchor=None if kind == "flock" else f"flock_{k}",
                    status=status,
                    extra={"p50_us": [], "p99_us": [], "max_us": [], "verified": []},
                )
            )
    for _ in range(sizes.writer_reps):
        for k in sizes.writer_counts:
            for kind in KINDS:
                row = rows[kind, k]
                if row.status != "ok":
                    continue
                try:
                    rate, lat, ok = one_run(ws, kind, k, sizes.writer_n)
                except Exception as exc:
                    row.status = f"failed: {type(exc).__name__}: {exc}"
                    continue
                row.values.append(rate)
                row.extra["p50_us"].append(percentile(lat, 50) / 1e3)
                row.extra["p99_us"].append(percentile(lat, 99) / 1e3)
                row.extra["max_us"].append(max(lat) / 1e3)
                row.extra["verified"].append(1.0 if ok else 0.0)
                if not ok:
                    row.note = "inbox check FAILED: wrong line count or a line that does not parse"
    return sec
