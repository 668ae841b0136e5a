"""The Starlette app of `ralph-mail serve`: the page for people at ``/``, its live feed
(``/events``, server-sent events), its acts (``/api/approve``, ``/api/deny``,
``/api/answer``), and the access token every request must carry.

The token comes as ``?token=`` once (it is then kept in a cookie, as Jupyter does), as
the cookie, or as ``Authorization: Bearer TOKEN``. An act is a POST of JSON, which a
page of another site cannot send here without the browser asking first, and the cookie
is ``SameSite=Strict``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, Final

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ralph_mail.errors import MailError, RefusedByRules
from ralph_mail.serve.team import TeamView

#: The cookie the token is kept in once a request brought it as ``?token=``.
COOKIE: Final = "ralph_mail_token"
#: How often presence is looked at again while nothing happens (it ages without events).
PRESENCE_PERIOD_S: Final = 2.0
#: The largest act a page may post (an answer's text and its envelope).
MAX_ACT_BYTES: Final = 1024 * 1024


class Hub:
    """Wakes the live feeds when the team changed: a thread follows the store's waiter
    and, on the app's loop, replaces `changed` (an event each feed awaits) with a new
    one after setting it. ``closing`` ends every feed (shutdown)."""

    def __init__(self, view: TeamView) -> None:
        self.view = view
        self.changed = asyncio.Event()
        self.closing = asyncio.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.view.keep_humans_present()  # reachable from the first request on
        self._thread = threading.Thread(target=self.view.follow, name="ralph-serve-follow",
                                        args=(self._wake, self._stop, PRESENCE_PERIOD_S),
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _wake(self) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._bump)
            except RuntimeError:  # the loop is closed: the server is gone
                self._stop.set()

    def _bump(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def next_change(self) -> Coroutine[Any, Any, bool]:
        """Wait for the next change of the team: True, or False when the server stops.
        The change waited for is the one after this call, not after the first await."""
        changed = self.changed

        async def wait() -> bool:
            closing = asyncio.ensure_future(self.closing.wait())
            woken = asyncio.ensure_future(changed.wait())
            try:
                await asyncio.wait({closing, woken}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                closing.cancel()
                woken.cancel()
            return not self.closing.is_set()

        return wait()

    def close_soon(self) -> None:
        """End the feeds (from a signal handler or any thread)."""
        self._stop.set()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.closing.set)

    def stop(self) -> None:
        self._stop.set()
        self.closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class TokenGate:
    """ASGI middleware: a request without the token gets 401 and one line saying how."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        given = request.query_params.get("token")
        header = request.headers.get("authorization", "")
        bearer = header[7:] if header.lower().startswith("bearer ") else None
        if not any(self._good(v) for v in (given, bearer, request.cookies.get(COOKIE))):
            refused = PlainTextResponse(
                "missing or wrong access token: open the URL 'ralph-mail serve' printed, "
                "or send 'Authorization: Bearer TOKEN'\n", status_code=401)  # fmt: skip
            await refused(scope, receive, send)
            return
        if given is None or not self._good(given):
            await self.app(scope, receive, send)
            return

        async def with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                cookie = f"{COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict"
                message.setdefault("headers", []).append((b"set-cookie", cookie.encode()))
            await send(message)

        await self.app(scope, receive, with_cookie)

    def _good(self, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(value.encode(), self.token.encode())


def _asset(name: str) -> str:
    return resources.files("ralph_mail.serve").joinpath(name).read_text(encoding="utf-8")


def build(
    view: TeamView,
    token: str,
    caller: str | None = None,
    ready: Callable[[], None] | None = None,
) -> Starlette:
    """The app for ``view``, guarded by ``token``; with ``caller``, each other member is
    an A2A agent too, delegated to from ``caller``; ``ready`` is called once it serves
    (the team followed, the human members present)."""
    hub = Hub(view)
    page, script = _asset("page.html"), _asset("page.js")

    async def index(request: Request) -> Response:
        return Response(page.replace("{{team}}", _html(view.name)), media_type="text/html")

    async def javascript(request: Request) -> Response:
        return Response(script, media_type="text/javascript")

    async def state(request: Request) -> Response:
        try:
            return JSONResponse(await asyncio.to_thread(view.snapshot))
        except MailError as exc:  # a damaged roster, a store that fails: said, not a trace
            return _refused(503, str(exc))

    async def events(request: Request) -> Response:
        return StreamingResponse(_feed(hub), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})  # fmt: skip

    async def approve(request: Request) -> Response:
        return await _act(request, lambda body: view.decide(_text(body, "id"), True).to_dict())

    async def deny(request: Request) -> Response:
        return await _act(
            request,
            lambda body: view.decide(_text(body, "id"), False, _text(body, "reason", "")).to_dict(),
        )

    async def answer(request: Request) -> Response:
        return await _act(
            request, lambda body: view.answer(_text(body, "id"), _text(body, "text")).to_dict()
        )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        hub.start()
        bridges: list[threading.Thread] = []
        stop_bridges = threading.Event()
        try:
            if caller is not None:  # the A2A client is there: remote members answer too
                from ralph_mail.serve import remote

                bridges = await asyncio.to_thread(remote.bridge, view, stop_bridges)
            if ready is not None:
                ready()
            yield
        finally:
            stop_bridges.set()
            hub.stop()
            for thread in bridges:
                await asyncio.to_thread(thread.join)
            await asyncio.to_thread(view.close)

    routes = [
        Route("/", index),
        Route("/page.js", javascript),
        Route("/api/state", state),
        Route("/events", events),
        Route("/api/approve", approve, methods=["POST"]),
        Route("/api/deny", deny, methods=["POST"]),
        Route("/api/answer", answer, methods=["POST"]),
    ]
    if caller is not None:
        from ralph_mail.serve import a2a

        view.team().member(caller)  # an unknown caller: refused before serving
        base = lambda request: str(request.base_url).rstrip("/")  # noqa: E731
        routes += a2a.routes(view, caller, base, hub.next_change)
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.hub = hub
    app.state.caller = caller
    app.add_middleware(TokenGate, token=token)
    return app


async def _feed(hub: Hub) -> AsyncIterator[str]:
    """The page's live feed: the snapshot now, then each time it changed."""
    last = ""
    while not hub.closing.is_set():
        changed = hub.next_change()  # before the snapshot: a change during it wakes us
        try:
            try:
                now = json.dumps(await asyncio.to_thread(hub.view.snapshot))
            except MailError as exc:
                now = json.dumps({"error": str(exc)})
            if now != last:
                last = now
                yield f"data: {now}\n\n"
            await changed
        finally:
            changed.close()  # not awaited when the feed was closed meanwhile


async def _act(request: Request, act: Callable[[dict[str, Any]], dict[str, Any]]) -> Response:
    """Run an act of the page: its JSON body in, the outcome out; a refusal is a 4xx
    with the one line that says why."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return _refused(415, "post JSON (Content-Type: application/json)")
    raw = await request.body()
    if len(raw) > MAX_ACT_BYTES:
        return _refused(413, f"the act is {len(raw):,} bytes, over {MAX_ACT_BYTES:,}")
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        return _refused(400, f"the body is not a JSON object ({exc})")
    try:
        return JSONResponse(await asyncio.to_thread(act, body))
    except RefusedByRules as exc:
        return _refused(403, str(exc))
    except LookupError as exc:  # no such held message, question or member
        return _refused(404, str(exc))
    except MailError as exc:
        return _refused(400, str(exc))


def _text(body: dict[str, Any], key: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if not isinstance(value, str):
        raise MailError(f'{key!r} must be a string: send {{{key!r}: "..."}}')
    return value


def _refused(status: int, reason: str) -> Response:
    return JSONResponse({"error": reason}, status_code=status)


def _html(text: str) -> str:
    import html

    return html.escape(text)
