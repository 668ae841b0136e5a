"""`ralph-mail mcp`: one agent's mailbox as MCP tools, on stdio (DESIGN §12.1).

An LLM agent (Claude Code, Codex, any MCP client) reaches its team through these tools,
named and shaped as the seeds name them (OpenCompany's ``contact_agent``, Chorus's
``send_to_agent``, ``request_from_agent`` and ``list_agents``), plus the inbox, channels,
history, search and the lead's protocols. The agent is online while the server runs (it
consumes the inbox); the team's policy, approvals, rates (10 a minute when the policy
sets none), depth and presence apply as everywhere, and every refusal comes back as a
tool error whose text is the one-line message.

Blocking calls (an ask, a wait) run on worker threads; a client that cancels a call
stops its wait, and what was sent stays sent. An ask waits 45 s unless told otherwise,
under the 60 s most clients allow a call; an answer that comes later is returned by
check_inbox. Nothing but the protocol goes to stdout.

Every parameter carries a short description in its schema. The parameter names DESIGN
§12.1 pins stay as the seeds spell them (``agentId`` among them); every other one is
snake_case. What the read tools show names each message by its id, which ``reply``
takes; arguments of the wrong type, or missing, are refused in one line naming the
parameter (`MCPServer` turns pydantic's report into it).

It serves on stdio through its own transport (`ralph_mail.mcp_stdio`). The inbox is also
a resource a client can subscribe to, and with ``--push`` new messages come to the client
on their own as channel events (`ralph_mail.mcp_push`).

Example:
    >>> serve("demo", "analyst")    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal, TypeVar

import anyio
from mcp.server.mcpserver import Context
from mcp.server.mcpserver import MCPServer as _SDKServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.types import CallToolResult, InputRequiredResult, TextContent
from pydantic import Field, ValidationError

from ralph_mail import protocols, settings
from ralph_mail.bus import MessageBus
from ralph_mail.errors import InvalidMessage, MailError, NoReply
from ralph_mail.mcp_push import PUSH_INSTRUCTIONS, InboxWatch
from ralph_mail.message import Message, MessageType
from ralph_mail.talk.tasks import canceled_with

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., object])
# The tools' parameters, each with its description (module level: the SDK reads the
# annotations by name). Short: every agent pays for the tool list in its context.
Priority = Annotated[Literal["low", "normal", "high", "urgent"] | None,
                     Field(description="how soon it matters")]  # fmt: skip
Teammate = Annotated[str, Field(description="a teammate's name (list_agents)")]
Text = Annotated[str, Field(description="what to say")]
AskTimeout = Annotated[float, Field(description="seconds to wait for the answer")]
WaitSeconds = Annotated[float, Field(description="seconds to wait; 0: do not wait")]
TaskId = Annotated[str, Field(description="the task's id, from check_inbox")]
Channel = Annotated[str, Field(description="a channel's name, without #")]
Limit = Annotated[int, Field(description="at most this many")]

#: What the server tells the model once, in the initialize result.
INSTRUCTIONS: Final = (
    "You are one agent of a team that talks through a shared mailbox. Use ask for a "
    "quick answer you wait for, delegate for work that takes a while (its result comes "
    "to check_inbox), notify for news that needs no answer. Call check_inbox between "
    "steps: it returns requests to reply to, tasks to complete and results."
)
#: How many messages each memory keeps: the delivered ones (which `reply` and
#: `respond_shutdown` name), and those the read tools showed (which `reply` names).
_REMEMBERED: Final = 1000


class Mailbox:
    """What the tools do, on one agent's bus (thread-safe: one call at a time, but the
    wait of an ask or a check, so a cancelled call never holds the others up)."""

    def __init__(self, team: str, agent: str, home: str | os.PathLike[str] | None = None) -> None:
        self.bus = MessageBus(team, agent, home, default_rate=10)
        self.bus.signer().public()  # the key, read at start by this process, never shown
        self._lock = threading.RLock()
        self._seen: OrderedDict[str, Message] = OrderedDict()  # delivered, by id
        self._shown: OrderedDict[str, Message] = OrderedDict()  # read in a channel or history
        self._asking = threading.local()
        self._pushing: set[str] = set()  # ids being pushed as channel events (mcp_push)
        self._awaited: set[str] = set()  # types a tool waits for: never pushed meanwhile

    def start(self) -> None:
        """Claim the inbox (a second consumer is refused) and say so: online, idle."""
        with self._lock:
            self.bus.peek()
            self.bus.set_presence("idle")

    def close(self) -> None:
        with self._lock:
            self.bus.close()

    def _locked(self, action: Callable[[], _T]) -> _T:
        with self._lock:
            return action()

    # -- contact --------------------------------------------------------------------------

    def contact(self, action: str, to: str, message: str, context: str | None,
                priority: str | None, timeout: float, stop: threading.Event) -> str:  # fmt: skip
        if action == "ask":
            return self.ask(to, message, context, priority, timeout, stop)
        if action == "delegate":
            task = self._locked(lambda: self.bus.delegate(to, message, context=context,
                                                          priority=priority))  # fmt: skip
            held = self.bus.approval_of(task.assignment)
            waits = f", held for approval by {held.approver}" if held is not None else ""
            return (f"Delegated to {to} (subtask {task.id}{waits}). You'll receive the result "
                    f"automatically when {to} finishes.")  # fmt: skip
        if action == "notify":
            sent = self._locked(lambda: self.bus.send(to, MessageType.TEXT, message,
                                                      priority=priority))  # fmt: skip
            return self._held(sent) or f"Notification sent to {to}."
        raise MailError(f"invalid action {action!r}: use ask, delegate or notify")

    def ask(self, to: str, question: str, context: str | None, priority: str | None,
            timeout: float, stop: threading.Event) -> str:  # fmt: skip
        """The answer; or, when none came in time, a result saying so: the answer stays
        unread in the inbox, where check_inbox returns it."""
        try:
            reply = self.bus.ask(to, question, context=context, priority=priority,
                                 timeout=timeout, stop=stop)  # fmt: skip
        except NoReply:
            return f"No answer from {to} within {timeout:g} s; it will come to check_inbox."
        error = reply.metadata.get("error")
        if error:
            raise MailError(f"{to} could not answer: {error}")
        return f"Response from {to}: {reply.content}"

    def send(self, to: str, text: str) -> str:
        sent = self._locked(lambda: self.bus.send(to, MessageType.TEXT, text))
        return self._held(sent) or f"Message sent to {to}."

    def _held(self, message: Message) -> str:
        """What to say of a message the policy held for approval ("" when delivered)."""
        if message.ts:
            return ""
        held = self.bus.approval_of(message.id)
        approver = held.approver if held is not None else "the approver"
        return (f"Held for approval by {approver}: {message.to_agent} gets it once approved "
                "(the decision comes to check_inbox).")  # fmt: skip

    def agents(self) -> str:
        found = self._locked(lambda: self.bus.agents())
        lines = [f"{a.name} ({a.role}, {a.presence})" + (f": {a.description}" if a.description
                 else "") for a in found]  # fmt: skip
        return "\n".join(lines) or "No teammates."

    # -- the inbox ------------------------------------------------------------------------

    def check(self, wait: float, stop: threading.Event) -> str:
        """New messages, consumed once they are in the answer (but those being pushed)."""
        with self._lock:
            found = self._unpushed()
        if not found and wait > 0:
            found = self.bus.wait_for_messages(wait, stop=stop, consume=False)
        with self._lock:
            shown = [m for m in self._unpushed() if any(m.id == f.id for f in found)]
            if not shown:
                return "No new messages."
            text = "\n\n".join(describe(m) for m in shown)
            if self._pushing:  # one being pushed may come first: it is not consumed here
                for message in shown:
                    self.bus.consume(message)
            else:
                self.bus.commit(shown[-1])
            _remember(self._seen, shown)
        return text

    def _unpushed(self) -> list[Message]:
        return [m for m in self.bus.peek() if m.id not in self._pushing]

    # -- the inbox for mcp_push: the resource and the events ------------------------------

    def inbox_text(self) -> str:
        """The unconsumed messages as check_inbox would show them, nothing consumed."""
        with self._lock:
            found = self._unpushed()
        return "\n\n".join(describe(m) for m in found) or "No new messages."

    def look(self, push: bool) -> tuple[set[str], list[tuple[Message, str]]]:
        """The ids of the unconsumed messages, and (with ``push``) those to push now with
        their text, marked as being pushed: check_inbox leaves them alone until `pushed`."""
        with self._lock:
            pending = self.bus.peek()
            taken = [m for m in pending if m.id not in self._pushing
                     and m.type not in self._awaited] if push else []  # fmt: skip
            self._pushing.update(m.id for m in taken)
            _remember(self._seen, taken)  # a reply may come as soon as the event is out
        return {m.id for m in pending}, [(m, describe(m)) for m in taken]

    def pushed(self, message: Message, ok: bool) -> None:
        """``message`` was written to the client (``ok``: consume it, as check_inbox
        would) or could not be (it stays unread)."""
        with self._lock:
            self._pushing.discard(message.id)
            if ok:
                with contextlib.suppress(InvalidMessage):  # a wait of this process took it
                    self.bus.consume(message)

    def _named(self, message_id: str) -> Message:
        """A message a read tool showed, by its id (what ``reply`` answers)."""
        found = self._seen.get(message_id) or self._shown.get(message_id)
        if found is None:
            raise MailError(f"unknown message_id {message_id!r}: answer a message check_inbox "
                            "or a read tool showed")  # fmt: skip
        if found.from_agent == self.bus.agent:
            raise MailError(f"message {message_id} is yours: reply to a teammate's")
        return found

    def reply(self, message_id: str, content: str) -> str:
        with self._lock:
            message = self._named(message_id)
            self.bus.reply(message, content)
        return f"Replied to {message.from_agent}."

    def finish(self, task_id: str, text: str, failed: bool) -> str:
        with self._lock:
            task = self.bus.fail(task_id, text) if failed else self.bus.complete(task_id, text)
        return (f"Task {task.id} {'failed' if failed else 'completed'}; "
                f"{task.delegated_by} gets the result.")  # fmt: skip

    def cancel(self, task_id: str, reason: str | None) -> str:
        with self._lock:
            task = self.bus.cancel(task_id, reason or "")
            below = len(canceled_with(task, self.bus.tasks())) - 1
        more = f" with {below} open subtask{'s' if below != 1 else ''}" if below else ""
        return f"Task {task.id} canceled{more}; {task.assignee} was told to stop."

    # -- channels, history, search --------------------------------------------------------

    def post(self, channel: str, content: str, reply_to: str | None) -> str:
        post = self._locked(lambda: self.bus.channel_post(channel, content, reply_to))
        return f"Posted in {post.to_agent} (id {post.id})."

    def read_channel(self, channel: str, limit: int) -> str:
        with self._lock:
            posts = self.bus.channel_history(channel, limit)
            self.bus.channel_read(channel)
        return self._lines(posts) or "No posts yet."

    def history(self, agent: str, limit: int) -> str:
        found = self._locked(lambda: self.bus.history(agent, limit))
        return self._lines(found) or f"No messages with {agent} yet."

    def search(self, query: str, from_agent: str | None, limit: int) -> str:
        found = self._locked(lambda: self.bus.search(query, from_agent=from_agent, limit=limit))
        return self._lines(found) or "Nothing found."

    def _lines(self, messages: list[Message]) -> str:
        """``messages`` one a line, each remembered so ``reply`` can answer it by id."""
        with self._lock:
            _remember(self._shown, messages)
        return "\n".join(line(m) for m in messages)

    # -- the lead's protocols -------------------------------------------------------------

    def report_status(self, text: str, state: str | None, progress: float | None) -> str:
        metadata = protocols.status_metadata(state or "working", None, progress)
        lead = self.bus.team.lead
        self._locked(lambda: self.bus.send(lead, MessageType.STATUS_UPDATE, text, metadata))
        return f"Status sent to {lead}."

    def submit_plan(self, plan: str, wait: float, stop: threading.Event) -> str:
        lead = self.bus.team.lead
        if wait <= 0:
            self._locked(lambda: self.bus.send(lead, MessageType.PLAN_SUBMISSION, plan))
            return f"Plan sent to {lead}; its answer comes to check_inbox."
        self._awaited.add(MessageType.PLAN_APPROVAL)  # not pushed while it is waited for here
        try:
            sent = self._locked(lambda: self.bus.send(lead, MessageType.PLAN_SUBMISSION, plan))
            answer = self.bus.wait_for_message(MessageType.PLAN_APPROVAL, wait, stop=stop)
        finally:
            self._awaited.discard(MessageType.PLAN_APPROVAL)
        if answer is None:
            return f"Plan sent to {lead}; no answer in {wait:g} s: it comes to check_inbox."
        if answer.reply_to != sent.id:  # an answer to an earlier plan: give it back
            self._seen[answer.id] = answer
        approved, feedback = protocols.parse_plan_approval(answer)
        verdict = "approved" if approved else "rejected"
        return f"Plan {verdict} by {lead}" + (f": {feedback}" if feedback else ".")

    def respond_shutdown(self, accept: bool, reason: str | None) -> str:
        with self._lock:
            requests = [m for m in self._seen.values() if m.type == MessageType.SHUTDOWN_REQUEST]
            requests += [m for m in self._unpushed() if m.type == MessageType.SHUTDOWN_REQUEST]
            if not requests:
                raise MailError(
                    "no shutdown request to answer: check_inbox shows one when it comes"
                )
            request = requests[-1]
            content, metadata = protocols.shutdown_answer(accept, reason=reason or None)
            self.bus.send(request.from_agent, MessageType.SHUTDOWN_RESPONSE, content, metadata,
                          reply_to=request.id)  # fmt: skip
            if request.id not in self._seen:
                self.bus.consume(request)
            self._seen.pop(request.id, None)
        return f"Shutdown {'accepted' if accept else 'declined'}."


def _remember(memory: OrderedDict[str, Message], messages: list[Message]) -> None:
    """Add ``messages`` to ``memory`` by id, newest last, forgetting the oldest past
    `_REMEMBERED`."""
    for message in messages:
        memory[message.id] = message
        memory.move_to_end(message.id)
    while len(memory) > _REMEMBERED:
        memory.popitem(last=False)


def line(message: Message) -> str:
    """One message as a line of history: time, id (for reply), who, what."""
    when = message.ts[:16].replace("T", " ")
    bad = " BAD-SIGNATURE" if message.verified is False else ""
    return f"{when} {message.id} [{message.from_agent}{bad}] {message.content}"


def describe(message: Message) -> str:
    """A delivered message as the model reads it: what it is, from whom, how to answer."""
    meta, kind, who = message.metadata, message.type, message.from_agent
    if kind == MessageType.REQUEST:
        head = f"Request {message.id} from {who} (answer with reply)"
        if meta.get("context"):
            head += f"\nContext: {meta['context']}"
    elif kind == MessageType.TASK_ASSIGNMENT:
        head = (f"Task {meta.get('taskId', '')} from {who} (message {message.id}; finish "
                "with complete_task or fail_task)")  # fmt: skip
    elif kind in (MessageType.TASK_CANCELED, MessageType.TASK_STALLED):
        head = f"{kind} {message.id} about task {meta.get('taskId', '')} from {who}"
    elif kind == MessageType.TASK_RESULT:
        head = (f"Result of {meta.get('taskId', '')} from {who} ({meta.get('status', 'done')}; "
                f"message {message.id})")  # fmt: skip
    elif kind == MessageType.REPLY:
        head = f"Reply {message.id} from {who} to your request {message.reply_to}"
        if meta.get("error"):
            head += f" (could not answer: {meta['error']})"
    elif kind == MessageType.MENTION:
        head = (f"{who} mentioned you in #{meta.get('channel', '')} (message {message.id}; "
                f"answer with post_to_channel, reply_to {message.reply_to})")  # fmt: skip
    else:
        head = f"{kind} {message.id} from {who}"
    if message.verified is False:
        head += f" [BAD SIGNATURE: it may not be from {who}]"
    return f"{head}:\n{message.content}"


class MCPServer(_SDKServer[Any]):
    """The SDK's server, but arguments that do not fit a tool's schema are refused in one
    line naming the parameter and the fix, not pydantic's report of several lines; and
    the inbox's `InboxWatch`, which `serve_stdio` runs beside it."""

    watch: InboxWatch | None = None

    async def call_tool(self, name: str, arguments: dict[str, Any],
                        context: Context[Any, Any] | None = None,
                        ) -> CallToolResult | InputRequiredResult:  # fmt: skip
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(exc, UnexpectedToolError) or not isinstance(cause, ValidationError):
                raise
            tool = next((t for t in await self.list_tools() if t.name == name), None)
            schema = tool.input_schema.get("properties", {}) if tool is not None else {}
            raise ToolError(bad_arguments(cause, schema)) from cause


def bad_arguments(error: ValidationError, schema: dict[str, Any]) -> str:
    """pydantic's ``error`` about a tool's arguments as one line: each parameter once,
    what it should be (a missing one: what to pass, from its description in ``schema``)."""
    said: dict[str, str] = {}
    for found in error.errors():
        name = str(found["loc"][0]) if found["loc"] else "arguments"
        if name in said:  # a union's other branches: the first says enough
            continue
        if found["type"] == "missing":
            what = schema.get(name, {}).get("description")
            said[name] = f"missing {name}: pass {what}" if what else f"missing {name}"
        else:
            got = repr(found.get("input"))
            got = got if len(got) <= 40 else got[:37] + "..."
            should = found["msg"].removeprefix("Input ")
            said[name] = f"{name} {should} (got {got})"
    return "; ".join(said.values()).replace("\n", " ")


def build(team: str, agent: str, home: str | os.PathLike[str] | None = None, *,
          push: bool = False) -> tuple[MCPServer, Mailbox]:  # fmt: skip
    """The MCP server of ``agent`` and the mailbox behind it (call ``mailbox.start()``
    before serving, ``mailbox.close()`` after); ``push``: new messages go to the client
    as channel events (`ralph_mail.mcp_push`)."""
    box = Mailbox(team, agent, home)
    watch = InboxWatch(box, push)
    server: MCPServer = MCPServer("ralph-mail", subscriptions=watch.listeners,
                                  instructions=INSTRUCTIONS + (PUSH_INSTRUCTIONS if push
                                                               else ""))  # fmt: skip
    server.watch = watch
    watch.register(server)

    def tool(fn: _F) -> _F:
        """Register ``fn`` as a tool, its docstring on one line as its description."""
        return server.tool(description=" ".join((fn.__doc__ or "").split()))(fn)

    async def call(action: Callable[[threading.Event], str]) -> CallToolResult:
        """Run ``action`` on a worker thread; a cancelled call stops its wait. A refusal
        is an error result whose text is the one-line message (the SDK's ToolError would
        put "Error executing tool NAME:" before it)."""
        stop = threading.Event()
        try:
            text = await anyio.to_thread.run_sync(action, stop, abandon_on_cancel=True)
        except MailError as exc:
            return CallToolResult(content=[TextContent(type="text", text=str(exc))], is_error=True)
        finally:
            stop.set()
        return CallToolResult(content=[TextContent(type="text", text=text)])

    @tool
    async def contact_agent(
        action: Annotated[Literal["ask", "delegate", "notify"],
                          Field(description="ask: wait for an answer; delegate: a task; "
                                            "notify: no answer")],
        agentId: Teammate, message: Text,
        context: Annotated[str | None, Field(description="background the teammate needs")] = None,
        priority: Priority = None, timeout: AskTimeout = settings.MCP_ASK_TIMEOUT_S,
    ) -> CallToolResult:  # fmt: skip
        """Reach a teammate. ask: a quick question (a late answer comes to check_inbox).
        delegate: work that takes a while; its result comes to check_inbox. notify: news."""
        return await call(lambda s: box.contact(action, agentId, message, context, priority,
                                                timeout, s))  # fmt: skip

    @tool
    async def send_to_agent(target_agent: Teammate, message: Text) -> CallToolResult:
        """Send a teammate a message that needs no answer."""
        return await call(lambda _: box.send(target_agent, message))

    @tool
    async def request_from_agent(
        target_agent: Teammate,
        task_description: Annotated[str, Field(description="the question or request")],
        timeout: AskTimeout = settings.MCP_ASK_TIMEOUT_S,
    ) -> CallToolResult:  # fmt: skip
        """Ask a teammate and wait for the answer (a later one comes to check_inbox)."""
        return await call(lambda s: box.ask(target_agent, task_description, None, None,
                                            timeout, s))  # fmt: skip

    @tool
    async def list_agents() -> CallToolResult:
        """The teammates: name, role, presence, what they do."""
        return await call(lambda _: box.agents())

    @tool
    async def check_inbox(wait_seconds: WaitSeconds = 0.0) -> CallToolResult:
        """New messages (requests, tasks, results, mentions, notes), each with its id and
        returned once."""
        return await call(lambda s: box.check(wait_seconds, s))

    @tool
    async def reply(
        message_id: Annotated[str, Field(description="its id, as a read tool showed it")],
        content: Text,
    ) -> CallToolResult:  # fmt: skip
        """Answer a message (a request check_inbox returned, most often)."""
        return await call(lambda _: box.reply(message_id, content))

    @tool
    async def complete_task(
        task_id: TaskId, result: Annotated[str, Field(description="what you made or found")]
    ) -> CallToolResult:
        """Finish a delegated task; its delegator gets the result."""
        return await call(lambda _: box.finish(task_id, result, False))

    @tool
    async def fail_task(
        task_id: TaskId, error: Annotated[str, Field(description="why it cannot be done")]
    ) -> CallToolResult:
        """Give up a delegated task, saying why."""
        return await call(lambda _: box.finish(task_id, error, True))

    @tool
    async def cancel_task(
        task_id: Annotated[str, Field(description="a task you delegated, from contact_agent")],
        reason: Annotated[str | None, Field(description="why, for the assignee")] = None,
    ) -> CallToolResult:  # fmt: skip
        """Cancel a task you delegated, and its open subtasks; their assignees stop."""
        return await call(lambda _: box.cancel(task_id, reason))

    @tool
    async def post_to_channel(
        channel: Channel, content: Annotated[str, Field(description="the post; @name or @all "
                                                                    "asks for an answer")],
        reply_to: Annotated[str | None, Field(description="the id of the post you answer")] = None,
    ) -> CallToolResult:  # fmt: skip
        """Post in a channel."""
        return await call(lambda _: box.post(channel, content, reply_to))

    @tool
    async def read_channel(channel: Channel, limit: Limit = 20) -> CallToolResult:
        """The last posts of a channel, oldest first: time, id, [sender], text."""
        return await call(lambda _: box.read_channel(channel, limit))

    @tool
    async def conversation_history(agent: Teammate, limit: Limit = 20) -> CallToolResult:
        """The last messages between you and a teammate, oldest first: time, id, [sender],
        text."""
        return await call(lambda _: box.history(agent, limit))

    @tool
    async def search_messages(
        query: Annotated[str, Field(description="words the message contains")],
        from_agent: Annotated[str | None, Field(description="only this sender's")] = None,
        limit: Limit = 20,
    ) -> CallToolResult:  # fmt: skip
        """Search every message of the team, newest first: time, id, [sender], text."""
        return await call(lambda _: box.search(query, from_agent, limit))

    @tool
    async def report_status(
        text: Annotated[str, Field(description="what you are doing")],
        state: Annotated[str | None, Field(description="idle, working, blocked, done or "
                                                       "failed")] = None,
        progress: Annotated[float | None, Field(description="0 to 1")] = None,
    ) -> CallToolResult:  # fmt: skip
        """Tell the lead how you are doing."""
        return await call(lambda _: box.report_status(text, state, progress))

    @tool
    async def submit_plan(
        plan: Annotated[str, Field(description="the steps you mean to take")],
        wait_seconds: WaitSeconds = 0.0,
    ) -> CallToolResult:  # fmt: skip
        """Send the lead your plan and wait for its approval (or see check_inbox)."""
        return await call(lambda s: box.submit_plan(plan, wait_seconds, s))

    @tool
    async def respond_shutdown(
        accept: Annotated[bool, Field(description="true to stop now")],
        reason: Annotated[str | None, Field(description="why not yet")] = None,
    ) -> CallToolResult:  # fmt: skip
        """Answer the lead's shutdown request: accept to stop, or say why not yet."""
        return await call(lambda _: box.respond_shutdown(accept, reason))

    return server, box


def start(team: str, agent: str, home: str | os.PathLike[str] | None = None, *,
          push: bool = False) -> tuple[MCPServer, Mailbox]:  # fmt: skip
    """`build` and claim the inbox; a `MailError` says why the server cannot start (and
    nothing is left held)."""
    server, box = build(team, agent, home, push=push)
    try:
        box.start()
    except BaseException:
        box.close()
        raise
    return server, box


def run(server: MCPServer, box: Mailbox) -> None:
    """Serve on stdio until the client goes away, then let the inbox go."""
    from ralph_mail.mcp_stdio import serve_stdio

    try:
        anyio.run(serve_stdio, server)
    finally:
        box.close()


def serve(team: str, agent: str, home: str | os.PathLike[str] | None = None, *,
          push: bool = False) -> None:  # fmt: skip
    """Serve ``agent``'s mailbox on stdio until the client goes away."""
    run(*start(team, agent, home, push=push))
