"""The file backend: a team is a folder of JSONL inboxes under a home.

Split by concern: ``layout`` (where a team's files live, teams made and removed),
``inbox`` (the inbox log), ``slots`` (the slot file behind cursors and bases), ``posix``
(opens, writes, errors), ``watch`` (waking on file events), ``archive`` (what gc
collected), ``deadletters`` (lines set aside), ``doctor`` (checks); one team's store in
parts: ``team`` (directories and kept descriptors), ``logs`` (inboxes, channels, team
logs, cursors, search), ``records`` (presence, state, rates, indexes), ``commits`` (when
cursors moved), ``claims`` (the one consumer of an inbox), ``maintenance`` (gc); and
``backend`` (`FileStore`, those parts put together, and `FileBackend`).
"""

from __future__ import annotations

from ralph_mail.store.files.backend import FileBackend, FileStore
from ralph_mail.store.files.inbox import InboxState
from ralph_mail.store.files.layout import teams_dir
from ralph_mail.store.files.posix import pid_alive, pid_stopped

__all__ = ["FileBackend", "FileStore", "InboxState", "pid_alive", "pid_stopped", "teams_dir"]
