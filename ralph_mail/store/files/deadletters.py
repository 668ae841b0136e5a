"""Dead letters: the lines set aside from an inbox, with the reason, in
``deadletters/<agent>.jsonl`` (one JSON record a line)."""

from __future__ import annotations

import os
import time
from typing import Any

from ralph_mail import codec
from ralph_mail.message import format_ts
from ralph_mail.store.files.layout import TeamDirs
from ralph_mail.store.files.posix import open_file, read_file, store_error, write_all


class DeadLetters:
    """The dead letters of one inbox: written by calling it (the inbox log does), read
    with `read`."""

    def __init__(self, dirs: TeamDirs, agent: str) -> None:
        self._dirs = dirs
        self._agent = agent

    def __call__(self, offset: int, line: bytes, reason: str) -> None:
        agent = self._agent
        record = {
            "ts": format_ts(time.time_ns() // 1000),
            "inbox": agent,
            "offset": offset,
            "reason": reason,
            "line": line.decode("utf-8", "backslashreplace"),
        }
        data = codec.dumps_line(record)
        try:
            fd = open_file(
                f"{agent}.jsonl",
                os.O_RDWR | os.O_APPEND | os.O_CREAT,
                self._dirs.get("deadletters"),
            )
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # a record torn by a kill: end it, keep this one whole
                write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            where = self._dirs.path("deadletters", f"{agent}.jsonl")
            raise store_error(exc, f"dead letters {where}", "write") from None

    def read(self) -> list[dict[str, Any]]:
        """Every dead letter recorded for the inbox, oldest first."""
        agent = self._agent
        try:
            data = read_file(f"{agent}.jsonl", self._dirs.get("deadletters"))
        except FileNotFoundError:
            return []
        except OSError as exc:
            where = self._dirs.path("deadletters", f"{agent}.jsonl")
            raise store_error(exc, f"dead letters {where}", "read") from None
        records = []
        for line in data.splitlines():
            try:
                records.append(codec.loads(line))
            except codec.DecodeError:
                if line.strip():  # a record torn by a kill: keep what it says
                    text = line.decode("utf-8", "backslashreplace")
                    records.append({"reason": "damaged dead-letter record", "line": text})
        return records
