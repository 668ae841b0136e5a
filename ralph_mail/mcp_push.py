"""New mail into the live MCP session: the inbox as a resource a client subscribes to,
and, with ``--push``, each new message as a Claude Code channel event.

The inbox is the resource `INBOX_URI` (its text: the unconsumed messages, as check_inbox
shows them, read without consuming). A client subscribes to it (``resources/subscribe``
in the handshake era, ``subscriptions/listen`` from 2026-07-28) and gets
``notifications/resources/updated`` once new mail is there.

With ``push``, the server also declares Claude Code's channel capability
(``capabilities.experimental["claude/channel"]``) and sends each new message as a
``notifications/claude/channel`` notification, ``{"content": TEXT, "meta": {KEY: VALUE}}``,
whose meta keys (identifiers: letters, digits, underscores) become attributes of the
``<channel source="...">`` tag the model reads. A pushed message is delivered once: it is
consumed after its notification was written to standard output, whole, and check_inbox
does not return it again; one whose notification could not be written stays unread.
Channels are a handshake-era extension (the capability is declared in the initialize
result): a client that opens with the 2026-07-28 envelope gets resource updates only.

Nothing polls. One thread, `InboxWatch`, blocks on the store's waiter for the agent's
inbox (inotify, or a pull the NATS server holds) as the bus's waits do, and hands each
notification to the server's event loop; while nobody subscribes and nothing is pushed,
it leaves the inbox alone. Every notification goes through the one stream
the SDK writes its responses to, one whole JSON-RPC message at a time: it lands between
two messages, never inside a tool call's response.

Example:
    >>> server, box = build("demo", "writer", push=True)    # doctest: +SKIP
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectSendStream
from mcp.server.subscriptions import InMemorySubscriptionBus, ResourceUpdated, ServerEvent
from mcp.shared.message import ServerMessageMetadata, SessionMessage
from mcp.types import (
    EmptyResult,
    JSONRPCNotification,
    SubscribeRequestParams,
    UnsubscribeRequestParams,
)

from ralph_mail.errors import MailError
from ralph_mail.settings import WATCH_SAFETY_POLL_MAX_S, safety_poll
from ralph_mail.store.flag import Either, Flag

if TYPE_CHECKING:
    from mcp.server.context import ServerRequestContext
    from mcp.server.mcpserver import MCPServer
    from mcp.server.session import ServerSession

    from ralph_mail.mcp_server import Mailbox
    from ralph_mail.message import Message

#: The inbox as a resource.
INBOX_URI: Final = "ralph://inbox"
#: Claude Code's channels contract: the capability a server declares, and the method of
#: the notifications it sends.
CHANNEL_CAPABILITY: Final = "claude/channel"
CHANNEL_METHOD: Final = "notifications/claude/channel"
#: What the model is told, with ``--push``, of the events it gets.
PUSH_INSTRUCTIONS: Final = (
    " New messages also come to you on their own, as <channel> events: each once (check_inbox "
    "does not return it again); answer as it says (reply, complete_task, post_to_channel)."
)


@dataclass
class Written(ServerMessageMetadata):
    """What `_write_out` sets once the message it rides with was written whole (``ok``)
    or could not be (the client is gone)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    ok: bool = False


def meta(message: Message) -> dict[str, str]:
    """The channel event's attributes: who sent what, and what to answer it with (keys
    are identifiers, values strings, as the channels contract requires)."""
    found = {"message_id": message.id, "sender": message.from_agent, "type": str(message.type)}
    if message.thread != message.id:
        found["thread"] = message.thread
    if message.priority != "normal":
        found["priority"] = message.priority
    for key, name in (("taskId", "task_id"), ("channel", "channel")):
        if message.metadata.get(key):
            found[name] = message.metadata[key]
    return found


class InboxWatch:
    """The resource, its subscriptions and the push of one MCP server's inbox (see the
    module docstring). `register` it on the server; `serve` it while the server runs."""

    def __init__(self, box: Mailbox, push: bool) -> None:
        self.box, self.push = box, push
        self._stop = Flag()
        self._kick = Flag()  # look again now (a subscriber, the client ready)
        self.listeners = _Listeners(self._kick)  # 2026-07-28 subscriptions/listen
        self._session: ServerSession | None = None  # a handshake-era subscriber's
        self._ready = False  # the handshake is done: events may be pushed
        self._known: set[str] = set()  # the ids unconsumed at the last look

    def register(self, server: MCPServer[Any]) -> None:
        """Serve `INBOX_URI` and ``resources/subscribe`` on ``server``."""
        box = self.box

        about = "your unconsumed messages (reading does not consume them)"

        @server.resource(INBOX_URI, name="inbox", mime_type="text/plain", description=about)
        async def inbox() -> str:
            return await anyio.to_thread.run_sync(box.inbox_text)

        lowlevel = server._lowlevel_server  # MCPServer serves no resources/subscribe itself

        async def subscribe(ctx: ServerRequestContext[Any], params: SubscribeRequestParams,
                            ) -> EmptyResult:  # fmt: skip
            if params.uri == INBOX_URI:
                self._session = ctx.session
                self._kick.set()
            return EmptyResult()

        async def unsubscribe(ctx: ServerRequestContext[Any], params: UnsubscribeRequestParams,
                              ) -> EmptyResult:  # fmt: skip
            if params.uri == INBOX_URI:
                self._session = None
            return EmptyResult()

        lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, subscribe)
        lowlevel.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams,
                                     unsubscribe)  # fmt: skip

    def ready(self) -> None:
        """The client finished the handshake (``notifications/initialized``): events may
        go to it from now on."""
        self._ready = True
        self._kick.set()

    async def serve(self, out: MemoryObjectSendStream[SessionMessage]) -> None:
        """Watch the inbox until cancelled, sending on ``out`` (the server's write stream).
        The watching thread owns the store's waiter from start to end (a NATS waiter
        pulls over its own thread's connection)."""
        token = anyio.lowlevel.current_token()
        thread = threading.Thread(target=self._watch, args=(token, out), daemon=True,
                                  name="ralph-mcp-push")  # fmt: skip
        async with out:
            thread.start()
            try:
                await anyio.sleep_forever()
            finally:
                self._stop.set()
                self._kick.set()
                with anyio.CancelScope(shield=True):  # the loop stays free for its last call
                    await anyio.to_thread.run_sync(thread.join)
                self._stop.close()
                self._kick.close()

    def _watch(self, token: anyio.lowlevel.EventLoopToken,
               out: MemoryObjectSendStream[SessionMessage]) -> None:  # fmt: skip
        woken = Either(self._stop, self._kick)  # polled beside the doorbell: no slices
        try:
            waiter = self.box.bus.store.waiter([self.box.bus.agent])
        except MailError as exc:
            _say(f"new mail will not be announced: {exc}")
            return
        quiet = time.monotonic()  # since the last news: the safety poll stretches
        try:
            while not self._stop.is_set():
                self._kick.clear()
                if not self._wanted():  # nobody to tell: a subscriber or the stop kicks
                    self._kick.wait(WATCH_SAFETY_POLL_MAX_S)
                    continue
                try:
                    if self._look(token, out):
                        quiet = time.monotonic()
                except MailError as exc:  # the store failing: say so, look again later
                    _say(f"could not look at the inbox: {exc}")
                except (RuntimeError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return  # the event loop or the client is gone
                waiter.wait(safety_poll(time.monotonic() - quiet), woken)
        finally:
            waiter.close()

    def _wanted(self) -> bool:
        """Whether anyone is to be told of new mail: events to push, or a subscriber."""
        return (self.push and self._ready) or self._session is not None or bool(self.listeners.open)

    def _look(self, token: anyio.lowlevel.EventLoopToken,
              out: MemoryObjectSendStream[SessionMessage]) -> bool:  # fmt: skip
        """Announce what is new since the last look; push what is to be pushed. Whether
        there was anything new."""
        pending, taken = self.box.look(self.push and self._ready)
        fresh = bool(pending - self._known)
        self._known = pending
        if fresh:
            session = self._session
            if session is not None:
                anyio.from_thread.run(session.send_resource_updated, INBOX_URI, token=token)
            anyio.from_thread.run(self.listeners.publish, ResourceUpdated(uri=INBOX_URI),
                                  token=token)  # fmt: skip
        for index, (message, text) in enumerate(taken):
            ok = anyio.from_thread.run(_push, out, message, text, token=token)
            self.box.pushed(message, ok)
            if not ok:  # the client is gone: the rest stays unread too
                for left, _ in taken[index + 1 :]:
                    self.box.pushed(left, False)
                break
        return fresh or bool(taken)


async def _push(out: MemoryObjectSendStream[SessionMessage], message: Message, text: str) -> bool:
    """Send ``message`` as a channel event; True once it was written whole."""
    written = Written()
    event = JSONRPCNotification(jsonrpc="2.0", method=CHANNEL_METHOD,
                                params={"content": text, "meta": meta(message)})  # fmt: skip
    try:
        await out.send(SessionMessage(event, metadata=written))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return False
    await written.done.wait()
    return written.ok


class _Listeners(InMemorySubscriptionBus):
    """The SDK's bus of ``subscriptions/listen`` streams, counting them (``open``) and
    waking the watch when one opens."""

    def __init__(self, kick: threading.Event) -> None:
        super().__init__()
        self.open = 0
        self._kick = kick

    def subscribe(self, listener: Callable[[ServerEvent], None]) -> Callable[[], None]:
        unsubscribe = super().subscribe(listener)
        self.open += 1
        self._kick.set()
        done: list[bool] = []

        def stop() -> None:
            if not done:
                done.append(True)
                self.open -= 1
            unsubscribe()

        return stop


def _say(text: str) -> None:
    """One line on stderr (stdout is the protocol's)."""
    try:
        sys.stderr.write(f"ralph-mail: note: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
