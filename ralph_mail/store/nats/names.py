"""How the NATS store names things: a team's stream and subjects, and the bucket's keys.

Names come from teams, agents and channels, and may hold what a subject or a key may
not (``a..b``, ``b.``, anything past ``[-_=.A-Za-z0-9]``): such a name goes in hex,
marked so it never meets a plain one.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_KV_KEY = re.compile(r"[-_=.A-Za-z0-9]+")


def hexed(name: str) -> str:
    """``name``'s UTF-8 in hex: a team's name in its stream and subjects."""
    return name.encode().hex()


def stream_of(team: str) -> str:
    """The stream (and the bucket: the same name) of ``team``."""
    return f"RALPH_{hexed(team)}"


def prefix_of(team: str) -> str:
    """The first tokens of every subject of ``team``'s stream."""
    return f"ralph.{hexed(team)}"


def kv_key(name: str) -> str:
    """A KV key for ``name``: itself when it is a valid key, else ``x`` + its hex."""
    plain = _KV_KEY.fullmatch(name) and not name.startswith("x") and _tokens(name)
    return name if plain else "x" + hexed(name)


def _tokens(name: str) -> bool:
    """Whether ``name`` splits into subject tokens, none empty: a valid name may hold
    ``..`` or end in ``.`` (``a..b``, ``b.``), which no subject or key may."""
    return ".." not in name and not name.endswith(".")


def token(name: str) -> str:
    """``name`` as the end of a subject: itself, or ``=`` + its hex when its tokens are
    not all whole (no name holds ``=``, so the two never meet; see `untoken`)."""
    return name if _tokens(name) else "=" + hexed(name)


def untoken(token: str) -> str:
    """The name that `token` made ``token`` of."""
    return bytes.fromhex(token[1:]).decode() if token.startswith("=") else token


def index_path(home: Path, url: str, stream: str) -> Path:
    """Where the index of ``stream`` (`index`) on the server at ``url`` lives under
    ``home``: a file per server (its URL hashed, a password in it left out) and team."""
    from ralph_mail.store.nats.urls import redacted

    server = hashlib.blake2b(redacted(url).encode(), digest_size=8).hexdigest()
    return home / "nats" / server / f"{stream}.sqlite3"
