"""Each member of the team as an A2A agent (protocol 1.0, the ``a2a-sdk`` package): its
card at ``/a2a/AGENT/.well-known/agent-card.json``, JSON-RPC at ``/a2a/AGENT/``.

SendMessage is a delegation to the member (`MessageBus.delegate`) from the caller: the
roster member that stands for outside agents (``--caller``, the lead by default), so
the team's policy and the Gate judge it as any delegation of that member's. It answers
at once with the task (``returnImmediately``) or once the task ended. GetTask,
ListTasks and SubscribeToTask read the team's task log: the log is the store, so a task
outlives a restart of the server. CancelTask cancels it as the caller
(`MessageBus.cancel`). A task is never consumed here: its result stays in the caller's
inbox as well.

`a2a_state` is the one place where the task log's states become A2A's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.server.request_handlers.response_helpers import agent_card_to_dict
from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    InvalidParamsError,
    InvalidRequestError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ralph_mail.errors import MailError, RefusedByRules
from ralph_mail.message import parse_ts

if TYPE_CHECKING:
    from ralph_mail.serve.team import TeamView
    from ralph_mail.talk.tasks import Task

#: The task log's states (today's and the A2A-named ones) as A2A task states.
_STATES: Final = {
    "pending": pb.TASK_STATE_SUBMITTED, "submitted": pb.TASK_STATE_SUBMITTED,
    "active": pb.TASK_STATE_WORKING, "working": pb.TASK_STATE_WORKING,
    "input_required": pb.TASK_STATE_INPUT_REQUIRED, "completed": pb.TASK_STATE_COMPLETED,
    "failed": pb.TASK_STATE_FAILED, "canceled": pb.TASK_STATE_CANCELED,
    "rejected": pb.TASK_STATE_REJECTED,
}  # fmt: skip
#: The states after which a task changes no more, and those a blocking send stops at.
_FINAL: Final = frozenset({pb.TASK_STATE_COMPLETED, pb.TASK_STATE_FAILED,
                           pb.TASK_STATE_CANCELED, pb.TASK_STATE_REJECTED})  # fmt: skip
_INTERRUPTED: Final = _FINAL | {pb.TASK_STATE_INPUT_REQUIRED, pb.TASK_STATE_AUTH_REQUIRED}
#: ListTasks pages: the default size and the largest.
PAGE: Final = 50
MAX_PAGE: Final = 100

Changes = Callable[[], Coroutine[Any, Any, bool]]


def a2a_state(status: str) -> pb.TaskState:
    """The A2A `TaskState` of a task log status (unknown: unspecified)."""
    return _STATES.get(status, pb.TASK_STATE_UNSPECIFIED)


def _text_message(task: Task, text: str, role: pb.Role, message_id: str) -> pb.Message:
    return pb.Message(message_id=message_id, context_id=task.id, task_id=task.id, role=role,
                      parts=[pb.Part(text=text)])  # fmt: skip


def a2a_task(task: Task, history_length: int | None = None) -> pb.Task:
    """The A2A view of a task of the log: its state, the request and, once it ended, the
    answer (the status message, and the result as an artifact when it completed)."""
    state = a2a_state(task.status)
    history = [_text_message(task, task.description, pb.ROLE_USER, task.assignment or task.id)]
    status = pb.TaskStatus(state=state)
    if task.updated:
        status.timestamp.FromJsonString(task.updated)
    artifacts = []
    if state in _FINAL and task.result:
        answer = _text_message(task, task.result, pb.ROLE_AGENT, f"{task.id}-result")
        status.message.CopyFrom(answer)
        history.append(answer)
        if state == pb.TASK_STATE_COMPLETED:
            artifacts.append(pb.Artifact(artifact_id=f"{task.id}-result", name="result",
                                         parts=[pb.Part(text=task.result)]))  # fmt: skip
    if history_length is not None:
        history = history[len(history) - history_length :] if history_length else []
    metadata: dict[str, Any] = {"delegated_by": task.delegated_by, "assignee": task.assignee,
                                "status": task.status, "created": task.created}  # fmt: skip
    found = pb.Task(id=task.id, context_id=task.id, status=status, artifacts=artifacts,
                    history=history)  # fmt: skip
    found.metadata.update(metadata)
    return found


def card(view: TeamView, agent: str, base: str) -> pb.AgentCard:
    """Member ``agent``'s card: its name and description, and its skill from the roster."""
    team = view.team()
    member = team.member(agent)
    about = member.description or f"{agent}, a member of team {team.name}"
    skill = pb.AgentSkill(id=agent, name=agent, description=about, tags=[team.name],
                          input_modes=["text/plain"], output_modes=["text/plain"])  # fmt: skip
    bearer = pb.SecurityScheme(http_auth_security_scheme=pb.HTTPAuthSecurityScheme(
        scheme="Bearer", description="the token 'ralph-mail serve' printed"))  # fmt: skip
    found = pb.AgentCard(
        name=agent, description=about, version="1.0",
        supported_interfaces=[pb.AgentInterface(url=f"{base}/a2a/{agent}/",
                                                protocol_binding="JSONRPC",
                                                protocol_version="1.0")],
        capabilities=pb.AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"], default_output_modes=["text/plain"],
        skills=[skill],
    )  # fmt: skip
    found.security_schemes["bearer"].CopyFrom(bearer)
    found.security_requirements.add().schemes["bearer"].SetInParent()
    return found


class MemberHandler(RequestHandler):
    """The A2A requests to one member, answered from the team's task log."""

    def __init__(self, view: TeamView, agent: str, caller: str, changes: Changes) -> None:
        self.view, self.agent, self.caller, self.changes = view, agent, caller, changes

    def _tasks(self) -> dict[str, Task]:
        return {k: t for k, t in self.view.task_log().items() if t.assignee == self.agent}

    async def _task(self, task_id: str) -> Task:
        found = (await asyncio.to_thread(self._tasks)).get(task_id)
        if found is None:
            raise TaskNotFoundError(message=f"no task {task_id!r} of {self.agent}")
        return found

    async def on_get_task(self, params: pb.GetTaskRequest, context: ServerCallContext) -> pb.Task:
        task = await self._task(params.id)
        length = params.history_length if params.HasField("history_length") else None
        return a2a_task(task, length)

    async def on_list_tasks(
        self, params: pb.ListTasksRequest, context: ServerCallContext
    ) -> pb.ListTasksResponse:
        found = sorted((await asyncio.to_thread(self._tasks)).values(),
                       key=lambda t: t.updated, reverse=True)  # fmt: skip
        if params.context_id:
            found = [t for t in found if t.id == params.context_id]
        if params.status:
            found = [t for t in found if a2a_state(t.status) == params.status]
        if params.HasField("status_timestamp_after"):
            after = params.status_timestamp_after.ToMicroseconds() / 1e6
            found = [t for t in found if parse_ts(t.updated) > after]
        size = params.page_size if params.HasField("page_size") else PAGE
        if not 1 <= size <= MAX_PAGE:
            raise InvalidParamsError(message=f"page size {size}: give 1 to {MAX_PAGE}")
        start = int(params.page_token) if params.page_token.isdigit() else 0
        if params.page_token and not params.page_token.isdigit():
            raise InvalidParamsError(message=f"invalid page token {params.page_token!r}")
        page = found[start : start + size]
        length = params.history_length if params.HasField("history_length") else None
        following = str(start + size) if start + size < len(found) else ""
        return pb.ListTasksResponse(tasks=[a2a_task(t, length) for t in page],
                                    next_page_token=following, page_size=size,
                                    total_size=len(found))  # fmt: skip

    async def on_cancel_task(
        self, params: pb.CancelTaskRequest, context: ServerCallContext
    ) -> pb.Task:
        task = await self._task(params.id)
        try:
            await asyncio.to_thread(self.view.cancel, self.caller, task.id,
                                    "canceled by an A2A client")  # fmt: skip
        except MailError as exc:  # it ended first (TaskEnded), or is not the caller's
            raise TaskNotCancelableError(message=str(exc)) from None
        return a2a_task(await self._task(task.id))

    async def _delegate(self, params: pb.SendMessageRequest) -> Task:
        message = params.message
        if message.task_id:
            raise UnsupportedOperationError(
                message=f"task {message.task_id} cannot be continued: send a new message"
            )
        text = "\n".join(part.text for part in message.parts if part.text)
        if not text:
            raise InvalidParamsError(message="the message has no text part: send text")
        try:
            return await asyncio.to_thread(self.view.delegate, self.caller, self.agent, text)
        except RefusedByRules as exc:
            raise InvalidRequestError(message=str(exc)) from None
        except MailError as exc:
            raise InvalidParamsError(message=str(exc)) from None

    async def _until(self, task_id: str, states: frozenset[int]) -> AsyncGenerator[Task]:
        """The task each time it changed, until its state is one of ``states`` (or the
        server stops)."""
        last = None
        while True:
            waiting = self.changes()  # taken before the look: a change meanwhile wakes it
            try:
                task = await self._task(task_id)
                if task != last:
                    last = task
                    yield task
                if a2a_state(task.status) in states or not await waiting:
                    return
            finally:
                waiting.close()  # not awaited when it returned first

    async def on_message_send(
        self, params: pb.SendMessageRequest, context: ServerCallContext
    ) -> pb.Task:
        task = await self._delegate(params)
        if not params.configuration.return_immediately:
            async for now in self._until(task.id, _INTERRUPTED):
                task = now
        return a2a_task(task)

    async def on_message_send_stream(
        self, params: pb.SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        task = await self._delegate(params)
        async for event in self._events(task.id):
            yield event

    async def on_subscribe_to_task(
        self, params: pb.SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        task = await self._task(params.id)
        if a2a_state(task.status) in _FINAL:
            raise UnsupportedOperationError(message=f"task {task.id} has ended ({task.status})")
        async for event in self._events(task.id):
            yield event

    async def _events(self, task_id: str) -> AsyncGenerator[Any]:
        """The task first, then a status update each time it changed, the last final."""
        first = True
        async for task in self._until(task_id, _INTERRUPTED):
            if first:
                first = False
                yield a2a_task(task)
                continue
            now = a2a_task(task)
            yield pb.TaskStatusUpdateEvent(task_id=task.id, context_id=task.id,
                                           status=now.status)  # fmt: skip

    async def on_create_task_push_notification_config(self, params: Any, context: Any) -> Any:
        raise PushNotificationNotSupportedError

    async def on_get_task_push_notification_config(self, params: Any, context: Any) -> Any:
        raise PushNotificationNotSupportedError

    async def on_list_task_push_notification_configs(self, params: Any, context: Any) -> Any:
        raise PushNotificationNotSupportedError

    async def on_delete_task_push_notification_config(self, params: Any, context: Any) -> None:
        raise PushNotificationNotSupportedError

    async def on_get_extended_agent_card(self, params: Any, context: Any) -> Any:
        raise UnsupportedOperationError(message="no extended card: the public one is all")


def routes(view: TeamView, caller: str, base: Callable[[Request], str],
           changes: Changes) -> list[Route]:  # fmt: skip
    """The A2A routes of every member (a member added while serving is served too)."""
    dispatchers: dict[str, JsonRpcDispatcher] = {}

    def member(request: Request) -> str | None:
        agent = str(request.path_params["agent"])
        return agent if agent in view.team().names and agent != caller else None

    async def agent_card(request: Request) -> Response:
        agent = member(request)
        if agent is None:
            return JSONResponse({"error": f"no agent {request.path_params['agent']!r} here"},
                                status_code=404)  # fmt: skip
        return JSONResponse(agent_card_to_dict(card(view, agent, base(request))))

    async def rpc(request: Request) -> Response:
        agent = member(request)
        if agent is None:
            return JSONResponse({"error": f"no agent {request.path_params['agent']!r} here"},
                                status_code=404)  # fmt: skip
        if agent not in dispatchers:  # one a member: bounded by the roster
            dispatchers[agent] = JsonRpcDispatcher(MemberHandler(view, agent, caller, changes))
        return await dispatchers[agent].handle_requests(request)

    return [
        Route("/a2a/{agent}/.well-known/agent-card.json", agent_card),
        Route("/a2a/{agent}/", rpc, methods=["POST"]),
    ]
