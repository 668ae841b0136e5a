"""What each agent may do on the NATS server: the ``authorization`` block of a
nats-server configuration for one team, and the agents' credentials.

One user per agent (``AGENT@TEAM``), with a password of its own, kept in a 0600 file
outside the team's data (``$RALPH_HOME/nats/creds/<team>/<agent>.creds``, JSON
``{"user": ..., "password": ...}``); the store logs in with it when ``RALPH_NATS_CREDS``
names it (`login`). The lead's user may do everything (create and remove teams, purge,
set the policy); every other agent's may publish only to:

* the inboxes it may reach (``ralph.<team>.in.<agent>``, its own among them: the caller
  says which, from the policy) and their ``born`` marks in the bucket;
* the team's channels, team logs (the task log, approvals, dead letters) and indexes
  (``ch.>``, ``tl.>``, ``ix.>``), and its own commit times (``ct.<agent>``);
* its own presence, claim and cursor keys (and its cursors of the channels the caller
  names), and the shared keys: state (but the policy), rates, logs (not the roster,
  which holds the public keys that signatures are checked against: the lead's);
* the JetStream API calls the store makes: reads (``DIRECT.GET``, ``STREAM.MSG.GET`` of
  the bucket, ``STREAM.INFO``, ``STREAM.NAMES``, ``INFO``), ephemeral consumers (made,
  pulled, deleted), never a stream's creation, purge, deletion or a message's removal;

and subscribe only to ``_INBOX.>`` (the answers to its requests) and its own inbox.
docs/backends.md maps every subject the store uses; docs/governance.md says what this
leaves open (reading: every member may read the whole stream and bucket).
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ralph_mail.errors import MailError, StoreError
from ralph_mail.store.nats.names import kv_key, prefix_of, stream_of, token


def user_of(team: str, agent: str) -> str:
    """The server's user name of ``agent`` of ``team`` (no name holds ``@``)."""
    return f"{agent}@{team}"


def creds_path(home: Path, team: str, agent: str) -> Path:
    """Where ``agent``'s credentials are written: outside the team's data."""
    return home / "nats" / "creds" / team / f"{agent}.creds"


def read_creds(path: str | os.PathLike[str]) -> tuple[str, str]:
    """The user and password a credentials file holds; `MailError` in one line naming
    the file and the fix otherwise."""
    fix = "write it with 'ralph-mail nats config', or unset RALPH_NATS_CREDS"
    try:
        with open(path, "rb") as file:
            raw = file.read(1 << 16)
    except OSError as exc:
        raise MailError(f"RALPH_NATS_CREDS={path}: {exc.strerror or exc}: {fix}") from None
    try:
        found = json.loads(raw)
        user, password = found["user"], found["password"]
    except (ValueError, TypeError, KeyError):
        found = user = password = None
    if not isinstance(user, str) or not isinstance(password, str) or not user:
        raise MailError(f"RALPH_NATS_CREDS={path} holds no credentials (a JSON object of "
                        f"user and password): {fix}")  # fmt: skip
    return user, password


def login(user: str | None, password: str | None) -> tuple[str | None, str | None]:
    """The login to send: the URL's own (``user``, ``password``), else the file
    ``RALPH_NATS_CREDS`` names, else none."""
    if user is not None:
        return user, password
    path = os.environ.get("RALPH_NATS_CREDS", "").strip()
    return read_creds(path) if path else (None, None)


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as a 0600 file, atomically (a reader sees the old file
    or the new one), its folder 0700."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # (0600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _password(path: Path, user: str) -> str:
    """The password ``user`` has in its credentials file (kept: the agents go on
    logging in after the block is written again), or a new one."""
    try:
        found_user, password = read_creds(path)
    except MailError:
        return secrets.token_urlsafe(24)
    return password if found_user == user else secrets.token_urlsafe(24)


def agent_permissions(
    team: str, agent: str, reach: Iterable[str], cursors: Iterable[str] = ()
) -> dict[str, Any]:
    """The permissions of a member that is not the lead (see the module docstring):
    ``reach``, the agents whose inboxes it may publish to; ``cursors``, the names of
    other cursors of its own (a channel's: ``#channel@agent``)."""
    prefix, stream = prefix_of(team), stream_of(team)
    kv, api = f"$KV.{stream}", "$JS.API"
    inboxes = sorted({*reach, agent})
    publish = [f"{prefix}.in.{token(name)}" for name in inboxes]
    publish += [f"{prefix}.ch.>", f"{prefix}.tl.>", f"{prefix}.ix.>", f"{prefix}.ct.{token(agent)}"]
    publish += [f"{kv}.born.in.{token(name)}" for name in inboxes]
    publish += [f"{kv}.born.ch.>", f"{kv}.born.tl.>"]
    own = [agent, *sorted(set(cursors))]
    publish += [f"{kv}.{kind}.{kv_key(agent)}" for kind in ("presence", "claim")]
    publish += [f"{kv}.cursor.{kv_key(name)}" for name in own]
    # Not the roster: it holds the members' public keys, which a member able to write
    # it could swap to sign as another (a member's first key is published before the
    # block is written, or by the lead).
    publish += [f"{kv}.state.>", f"{kv}.rate.>", f"{kv}.log.>"]
    publish += [f"{api}.INFO", f"{api}.STREAM.NAMES", f"{api}.STREAM.INFO.{stream}",
                f"{api}.STREAM.INFO.KV_{stream}", f"{api}.STREAM.MSG.GET.KV_{stream}",
                f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>"]  # fmt: skip
    # Ephemeral consumers only (the subject without a name refuses a durable one): a
    # waiter's of the stream, pulled; the bucket's watch, pushed to an inbox.
    publish += [f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.MSG.NEXT.{stream}.*",
                f"{api}.CONSUMER.DELETE.{stream}.*", f"{api}.CONSUMER.CREATE.KV_{stream}",
                f"{api}.CONSUMER.DELETE.KV_{stream}.*"]  # fmt: skip
    return {
        "publish": {"allow": publish, "deny": [f"{kv}.state.{kv_key('policy')}"]},
        "subscribe": {"allow": ["_INBOX.>", f"{prefix}.in.{token(agent)}"]},
    }


#: The lead's permissions: everything (it creates and removes teams, purges, governs).
LEAD_PERMISSIONS: dict[str, Any] = {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}


def write_authorization(
    home: Path,
    team: str,
    lead: str,
    reach: dict[str, set[str]],
    cursors: dict[str, list[str]],
    out: Path | None = None,
) -> tuple[Path, dict[str, Path]]:
    """Write the ``authorization`` block of ``team`` (to ``out``, else
    ``$RALPH_HOME/nats/<team>.auth.conf``) and each agent's credentials; return where.
    ``reach``: for each agent, the agents whose inboxes it may publish to. A password
    already in an agent's credentials file is kept."""
    users, written = [], {}
    for agent in sorted(reach):
        path, user = creds_path(home, team, agent), user_of(team, agent)
        password = _password(path, user)
        if agent == lead:
            permissions = LEAD_PERMISSIONS
        else:
            permissions = agent_permissions(team, agent, reach[agent], cursors.get(agent, ()))
        users.append({"user": user, "password": password, "permissions": permissions})
        written[agent] = path
    where = out if out is not None else home / "nats" / f"{team}.auth.conf"
    block = (f"# ralph-mail nats config --team {team}: one user per agent; written again "
             "after every policy or membership change, then the server reloaded\n"
             f"authorization {{\n  users = {json.dumps(users, indent=2)}\n}}\n")  # fmt: skip
    try:
        for entry in users:
            record = {"user": entry["user"], "password": entry["password"]}
            _write(written[str(entry["user"]).rpartition("@")[0]], json.dumps(record).encode())
        _write(where, block.encode())
    except OSError as exc:
        raise StoreError(f"cannot write {exc.filename or where}: {exc.strerror or exc}",
                         exc.filename or where) from None  # fmt: skip
    return where, written
