"""The file backend's health checks, for `ralph_mail.maintenance.doctor`.

They look at what the file backend's guarantees rest on (a local file system with working
``flock`` and inotify, private permissions) and at what a fault leaves behind (torn
tails, dead letters, stuck or stopped lock holders, temp files of a killed gc).
"""

from __future__ import annotations

import os
import stat
import time
import warnings
from pathlib import Path
from typing import Final

from ralph_mail import settings
from ralph_mail.errors import MailError
from ralph_mail.store.files.backend import FileStore
from ralph_mail.store.files.layout import teams_dir
from ralph_mail.store.files.posix import pid_alive, pid_stopped
from ralph_mail.store.health import Finding

#: Where the mount table is read (a module attribute so tests can point it elsewhere).
MOUNTINFO = Path("/proc/self/mountinfo")
#: Where flock holders are listed.
PROC_LOCKS = Path("/proc/locks")
#: Where the inotify limits live.
INOTIFY_SYSCTL = Path("/proc/sys/fs/inotify")

#: File systems where flock or inotify do not hold across machines or a user-space layer:
#: a lock may not exclude a writer on another client, and appends made elsewhere raise no
#: event. The mailbox refuses them.
UNSAFE_FILE_SYSTEMS: Final = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "afs", "lustre", "glusterfs", "fuse"}
)
#: Local file systems with per-inode write serialisation and inotify (others get a warning).
LOCAL_FILE_SYSTEMS: Final = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "bcachefs"}
)


def check(root: Path, team: str | None, lock_wait: float) -> list[Finding]:
    """Every check of a home (or of one of its teams): `FileBackend.doctor`."""
    import orjson

    from ralph_mail.store.files.backend import FileBackend

    findings = check_home(root)
    if not root.exists():
        findings.append(Finding("warn", "team", f"{root} does not exist yet: no teams", root))
        return findings
    backend = FileBackend(root)
    try:
        names = [team] if team is not None else backend.team_names()
    except MailError as exc:
        findings.append(Finding("fail", "team", str(exc), root / "teams"))
        return findings
    if not names:
        findings.append(Finding("ok", "team", f"no teams in {root}"))
    for name in names:
        try:
            roster = orjson.loads(backend.read_roster(name))
            members = tuple(str(member["name"]) for member in roster["members"])
        except FileNotFoundError:
            findings.append(Finding("fail", "team", f"no team {name!r} in {root}",
                                    teams_dir(root) / name))  # fmt: skip
            continue
        except (MailError, ValueError, KeyError, TypeError) as exc:
            findings.append(Finding("fail", "team", f"team {name!r}: its roster is unreadable "
                                    f"({exc})", teams_dir(root) / name))  # fmt: skip
            continue
        findings.extend(check_team(backend.team_store(name), members, lock_wait))
    findings.extend(check_leftovers(root))
    return findings


def check_home(root: Path) -> list[Finding]:
    """The checks of a home as a whole: file system, inotify, permissions."""
    findings = [_file_system(root), *_inotify(root)]
    if root.exists():
        findings.extend(_permissions(root))
    return findings


def check_team(store: FileStore, names: tuple[str, ...], lock_wait: float) -> list[Finding]:
    """The checks of one team: its inboxes, cursors, dead letters, locks and leftovers."""
    return _team(store, names, lock_wait)


def check_leftovers(root: Path) -> list[Finding]:
    """Half-made or half-deleted team directories left by killed processes."""
    return _staging(root)


# -- the checks ------------------------------------------------------------------------------


def mount_of(path: Path) -> tuple[str, str]:
    """The mount point and file system type that hold ``path`` (it need not exist yet)."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    target = os.path.realpath(probe)
    best = ("/", "unknown")
    for line in MOUNTINFO.read_text().splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        point = fields[4].replace("\\040", " ")
        fstype = fields[fields.index("-") + 1]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fstype)
    return best


def _file_system(root: Path) -> Finding:
    try:
        point, fstype = mount_of(root)
    except OSError as exc:
        return Finding("warn", "filesystem", f"cannot read {MOUNTINFO}: {exc.strerror}")
    family = fstype.split(".", 1)[0]
    where = f"{root} is on {fstype} (mounted at {point})"
    if family in UNSAFE_FILE_SYSTEMS or fstype.startswith("fuse"):
        return Finding(
            "fail",
            "filesystem",
            f"{where}: flock and inotify are unreliable there (a lock may not exclude another "
            "client, remote appends raise no event); put RALPH_HOME on a local disk",
            root,
        )
    if fstype not in LOCAL_FILE_SYSTEMS:
        return Finding(
            "warn",
            "filesystem",
            f"{where}: not a file system the mailbox was tested on (ext4, xfs, btrfs, tmpfs); "
            "prefer a local disk",
            root,
        )
    return Finding("ok", "filesystem", f"{where}: local, with flock and inotify")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _inotify(root: Path) -> list[Finding]:
    try:
        mechanism = settings.wait_mechanism()
    except MailError as exc:
        return [Finding("fail", "inotify", str(exc))]
    # Doorbells (the default) need no inotify instance; inotify and watchfiles one each.
    needed = mechanism in ("inotify", "watchfiles")
    findings = []
    watches = _read_int(INOTIFY_SYSCTL / "max_user_watches")
    instances = _read_int(INOTIFY_SYSCTL / "max_user_instances")
    if watches is None or instances is None:
        text = f"no inotify limits found ({_WAYS[mechanism]})"
        findings.append(
            Finding("warn", "inotify", text) if needed else Finding("ok", "inotify", text)
        )
    else:
        text = f"inotify limits: max_user_watches={watches}, max_user_instances={instances}"
        low = watches < settings.INOTIFY_MIN_WATCHES or instances < settings.INOTIFY_MIN_INSTANCES
        if low and needed:
            findings.append(
                Finding(
                    "warn",
                    "inotify",
                    f"{text}: low for RALPH_WAIT={mechanism} (one instance per waiting "
                    "process); raise them with sysctl fs.inotify.max_user_watches=65536 "
                    "fs.inotify.max_user_instances=512, or unset RALPH_WAIT for doorbells",
                )
            )
        else:
            findings.append(Finding("ok", "inotify", f"{text} ({_WAYS[mechanism]})"))
    if mechanism == "poll":
        why = "RALPH_WAIT=poll" if os.environ.get("RALPH_WAIT") else "WATCHFILES_FORCE_POLLING"
        findings.append(
            Finding(
                "warn",
                "inotify",
                f"waits poll ({why} is set): every {settings.WATCH_POLL_DELAY_MS} ms after "
                f"mail, up to {settings.WATCH_POLL_MAX_MS} ms while idle; unset it for doorbells",
            )
        )
    elif needed and not watcher_works(_existing(root)):
        findings.append(
            Finding(
                "warn",
                "inotify",
                "file events are unavailable here (an inotify limit is reached, or the file "
                f"system has none): waits with RALPH_WAIT={mechanism} poll; raise "
                "fs.inotify.max_user_watches and max_user_instances, or unset RALPH_WAIT",
            )
        )
    return findings


#: What each setting of RALPH_WAIT means for inotify, for doctor's line.
_WAYS: Final = {
    "auto": "waits ring doorbells and need no inotify instance",
    "bell": "waits ring doorbells and need no inotify instance",
    "inotify": "RALPH_WAIT=inotify: one instance per waiting process",
    "watchfiles": "RALPH_WAIT=watchfiles: one instance per waiting process",
    "poll": "RALPH_WAIT=poll: waits poll",
}


def _waits(store: FileStore) -> Finding:
    """How the processes waiting on the team now learn of mail: doorbells, or polling."""
    waiting = store.waiting()
    where = store.root / "bells"
    stale = f"; {waiting.stale} left by dead processes (cleared by the next send)" * bool(
        waiting.stale
    )
    if not waiting.polling:
        return Finding("ok", "waits", f"team {store.team!r}: {waiting.bells} waiting "
                       f"process(es) on doorbells, none polling{stale}", where)  # fmt: skip
    reasons: dict[str, int] = {}
    for reason in waiting.polling:
        reasons[reason] = reasons.get(reason, 0) + 1
    why = "; ".join(f"{count} because {reason}" for reason, count in reasons.items())
    count = len(waiting.polling)
    return Finding(
        "warn",
        "waits",
        f"team {store.team!r}: {count} waiter{' polls' if count == 1 else 's poll'} ({why}), "
        f"{waiting.bells} on doorbells{stale}: a poller wakes up to "
        f"{settings.WATCH_POLL_MAX_MS} ms late",
        where,
    )


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _permissions(root: Path) -> list[Finding]:
    """Every directory 0700 and file 0600, owned by this user, and no symlink, in the home."""
    uid = os.geteuid()
    bad: list[Finding] = []
    stack = [root]
    count = 0
    while stack:
        path = stack.pop()
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue  # removed while we walked (a team deleted, a temp file renamed)
        count += 1
        if stat.S_ISLNK(info.st_mode):
            bad.append(
                Finding(
                    "fail",
                    "permissions",
                    f"{path} is a symlink: the mailbox never follows one; remove it",
                    path,
                )
            )
            continue
        if info.st_uid != uid:
            bad.append(
                Finding(
                    "fail",
                    "permissions",
                    f"{path} belongs to uid {info.st_uid}, not to this user ({uid}): "
                    f"chown it, or run as its owner",
                    path,
                )
            )
        is_dir = stat.S_ISDIR(info.st_mode)
        want = settings.DIR_MODE if is_dir else settings.FILE_MODE
        if info.st_mode & 0o077:
            bad.append(
                Finding(
                    "fail",
                    "permissions",
                    f"{path} is mode {stat.S_IMODE(info.st_mode):04o}: other users can reach "
                    f"the mail; chmod {want:o} {path}",
                    path,
                )
            )
        if is_dir:
            try:
                stack.extend(path / name for name in os.listdir(path))
            except OSError as exc:
                bad.append(Finding("fail", "permissions", f"cannot list {path}: {exc}", path))
    if bad:
        return bad
    return [Finding("ok", "permissions", f"{count} entries under {root}: private (0700/0600)")]


def _team(store: FileStore, names: tuple[str, ...], lock_wait: float) -> list[Finding]:
    findings: list[Finding] = []
    try:
        mailbox = store.root / "mailbox"
        expected = {f"{name}.jsonl" for name in names}
        try:
            present = set(os.listdir(mailbox))
        except OSError as exc:
            return [Finding("fail", "team", f"cannot list {mailbox}: {exc}", mailbox)]
        for extra in sorted(present - expected):
            findings.append(
                Finding(
                    "warn",
                    "team",
                    f"{mailbox / extra} is not the inbox of a member of {store.team!r}: "
                    "mailbox/ holds inboxes alone; move it out",
                    mailbox / extra,
                )
            )
        for agent in names:
            findings.extend(_inbox(store, agent, lock_wait))
        findings.append(_waits(store))
        for path in store.stale_temp_files():
            findings.append(
                Finding(
                    "warn",
                    "temp",
                    f"{path} was left by a killed gc or cursor rewrite: "
                    f"'ralph-mail gc --team {store.team}' removes it",
                    path,
                )
            )
    finally:
        store.close()
    return findings


def _inbox(store: FileStore, agent: str, lock_wait: float) -> list[Finding]:
    where = f"{store.team}/{agent}"
    path = store.inbox_path(agent)
    try:
        state = store.inbox_state(agent)
        deadline = time.monotonic() + lock_wait
        while state.locked and time.monotonic() < deadline:
            time.sleep(0.05)  # a send holds the lock for microseconds; wait out a busy moment
            state = store.inbox_state(agent)
    except FileNotFoundError:
        return [
            Finding(
                "fail",
                "inbox",
                f"inbox {path} of member {where} is missing: sends to it fail; recreate it "
                f"empty (install -m 600 /dev/null {path})",
                path,
            )
        ]
    except (MailError, OSError) as exc:
        return [Finding("fail", "inbox", f"inbox of {where}: {exc}", path)]
    findings = []
    if state.locked:
        pids = lock_holders(path)
        holders = ", ".join(str(pid) for pid in pids) or "unknown"
        stopped = [pid for pid in pids if pid_stopped(pid)]
        if stopped:
            findings.append(
                Finding(
                    "fail",
                    "lock",
                    f"inbox {where} is locked by stopped process {', '.join(map(str, stopped))}: "
                    "every sender to it waits; resume it (kill -CONT PID) or end it",
                    path,
                )
            )
        else:
            findings.append(
                Finding(
                    "warn",
                    "lock",
                    f"inbox {where} has been locked for over {lock_wait:g} s (holder pid "
                    f"{holders}): a hung sender; senders to it wait until it dies or resumes",
                    path,
                )
            )
    if state.torn:
        findings.append(
            Finding(
                "warn",
                "inbox",
                f"inbox {where} ends in a torn line (a sender was killed mid-write); it is "
                "never delivered, and the next send or gc sets it aside as a dead letter",
                path,
            )
        )
    try:
        cursor = store.load_cursor(agent)
    except MailError as exc:
        findings.append(Finding("fail", "cursor", str(exc), store.cursor_path(agent)))
        cursor = None
    end = state.base + state.size
    if cursor is not None and cursor.floor > end:
        findings.append(
            Finding(
                "fail",
                "cursor",
                f"cursor of {where} ({cursor.floor}) is past the end of its inbox ({end}): "
                f"new mail would be skipped; delete {store.cursor_path(agent)} to re-read",
                store.cursor_path(agent),
            )
        )
    elif cursor is not None:
        unread = end - cursor.floor
        consumed = cursor.floor - state.base
        findings.append(
            Finding(
                "ok",
                "inbox",
                f"inbox {where}: {state.size} bytes, {unread} unread, {consumed} consumed "
                "(gc drops the consumed part)",
                path,
            )
        )
    letters = store.dead_letters(agent)
    if letters:
        reasons = sorted({str(letter.get("reason", "?")) for letter in letters})
        findings.append(
            Finding(
                "warn",
                "deadletters",
                f"{len(letters)} dead letter(s) for {where} ({'; '.join(reasons)[:200]}): "
                f"read them in {store.deadletter_path(agent)}, then delete the file",
                store.deadletter_path(agent),
            )
        )
    return findings


_ACTIONS = {"new": "create", "deleted": "delete"}


def _staging(root: Path) -> list[Finding]:
    """Half-made or half-deleted team directories left by killed processes."""
    findings = []
    try:
        entries = os.listdir(teams_dir(root))
    except OSError:
        return []
    for name in sorted(entries):
        parts = name.split(".")
        if not name.startswith(".") or len(parts) < 4 or parts[-1] not in ("new", "deleted"):
            continue
        pid = parts[-3]
        if pid.isdigit() and pid_alive(int(pid)):
            continue
        path = teams_dir(root) / name
        findings.append(
            Finding(
                "warn",
                "temp",
                f"{path} was left by a killed team {_ACTIONS[parts[-1]]}: remove it (rm -r {path})",
                path,
            )
        )
    return findings


def lock_holders(path: Path) -> list[int]:
    """The pids that hold a flock on ``path``, from /proc/locks (empty when unknown)."""
    try:
        info = path.stat()
        table = PROC_LOCKS.read_text()
    except OSError:
        return []
    key = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    pids = []
    for line in table.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
            pids.append(int(fields[4]))
    return sorted(set(pids))


def watcher_works(directory: Path) -> bool:
    """Whether a wait on ``directory`` would wake on file events (not fall back to polling)."""
    from ralph_mail.store.files.watch import Watcher

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watcher = Watcher(directory)
    try:
        return not watcher.polling
    finally:
        watcher.close()
