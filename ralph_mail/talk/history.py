"""Reading inboxes without consuming them: the last N messages, and following new ones.

This is what ``ralph-mail tail`` and ``read --peek`` show. It never moves a cursor nor
claims an inbox, so anyone in the team can look at any inbox while its owner consumes it
(the trust boundary is the Unix user, not the agent name).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from ralph_mail.message import BROADCAST_ADDRESS, Message, decode_lines
from ralph_mail.settings import WATCH_SAFETY_POLL_S
from ralph_mail.store.base import StopEvent
from ralph_mail.team import load_team


class History:
    """A read-only view of some inboxes of a team.

    With several inboxes, messages are merged by timestamp and a broadcast (one id in
    every inbox it reached) is shown once.

    Example:
        >>> view = History("demo", ["lead"])         # doctest: +SKIP
        >>> [m.content for m in view.last(5)]         # doctest: +SKIP
    """

    def __init__(
        self,
        team: str,
        agents: Sequence[str],
        home: str | os.PathLike[str] | None = None,
        *,
        backend: str | None = None,
    ) -> None:
        roster = load_team(team, home, backend=backend)
        for agent in agents:
            if not agent.startswith("#"):  # a channel's log: its caller found the channel
                roster.member(agent)
        self.agents = list(agents)
        self._store = roster.store
        self._offsets: dict[str, int] = {}
        #: Bytes of each inbox that gc collected before this view could show them: a view
        #: that falls behind the owner by more than one compaction skips what is gone.
        self.skipped: dict[str, int] = {}
        self._broadcasts_seen: set[str] = set()
        #: The inboxes `last` read back to their start, where the start is past 0: gc
        #: compacted them, and what it dropped is in the team's archive.
        self.archived: list[str] = []

    def last(self, count: int) -> list[Message]:
        """The last ``count`` messages (merged over the inboxes), oldest first.

        Reads back from the end of each inbox, so it costs the same on a huge inbox.
        Afterwards `follow` continues from here.
        """
        merged: list[Message] = []
        self.archived = []
        for agent in self.agents:
            lines, end = self._store.read_tail(agent, count)
            self._offsets[agent] = end
            if len(lines) < count and end - sum(len(line) + 1 for line in lines) > 0:
                self.archived.append(agent)
            merged.extend(self._decode(lines))
        merged.sort(key=lambda message: message.ts)
        return merged[-count:] if count > 0 else []

    def new(self) -> list[Message]:
        """Messages that arrived since the last call (or since `last`), merged."""
        merged: list[Message] = []
        for agent in self.agents:
            if agent not in self._offsets:
                self._offsets[agent] = self._store.size(agent)
                continue
            while True:
                wanted = self._offsets[agent]
                data, offset = self._store.read(agent, wanted, skip_collected=True)
                self.skipped[agent] = self.skipped.get(agent, 0) + offset - wanted
                self._offsets[agent] = offset + len(data)
                if not data:
                    break
                merged.extend(self._decode(data.split(b"\n")[:-1]))
        merged.sort(key=lambda message: message.ts)
        return merged

    def unread(self, agent: str) -> list[Message]:
        """What ``agent`` has not consumed yet, oldest first, without consuming it or
        claiming the inbox (``ralph-mail read --peek``)."""
        cursor = self._store.load_cursor(agent)
        offset, messages = cursor.floor, list[Message]()
        while True:
            data, offset = self._store.read(agent, offset, skip_collected=True)
            if not data:
                return messages
            start = offset
            for line, message in zip(
                data.split(b"\n")[:-1], decode_lines(data.split(b"\n")[:-1])[0], strict=True
            ):
                if isinstance(message, Message) and start not in cursor.acked:
                    messages.append(message)
                start += len(line) + 1
            offset += len(data)

    def follow(self, stop: StopEvent | None = None) -> Iterator[list[Message]]:
        """Yield each batch of new messages as it arrives, until ``stop`` is set."""
        watcher = self._store.waiter(self.agents)
        try:
            while stop is None or not stop.is_set():
                batch = self.new()
                if batch:
                    yield batch
                watcher.wait(WATCH_SAFETY_POLL_S, stop)
        finally:
            watcher.close()

    def _decode(self, lines: list[bytes]) -> list[Message]:
        messages = []
        several = len(self.agents) > 1
        for message in decode_lines(lines)[0]:
            if not isinstance(message, Message):
                continue  # set aside by the owner's reader, with the reason; not shown here
            if several and message.to_agent == BROADCAST_ADDRESS:
                if message.id in self._broadcasts_seen:
                    continue
                self._broadcasts_seen.add(message.id)
            messages.append(message)
        return messages

    def close(self) -> None:
        """Release the descriptors."""
        self._store.close()
