"""A synchronous NATS request/reply connection for the NATS store's round trips.

nats-py is asyncio only: a synchronous caller reaches it through a thread hop (its
loop's thread), and that hop costs more than the round trip itself on a small machine
(measured: a publish with its ack ~190 us in the loop, ~300 us through the hop). The
store's requests (publishes with their acks, direct gets, the API, a waiter's pulls)
go over this plain blocking socket instead, one per thread, in the NATS client
protocol's few words (CONNECT, SUB, PUB/HPUB, MSG/HMSG, PING/PONG); nats-py keeps the
bucket's watch and the rarer JetStream administration.

A publish whose answer its caller can read later (a cursor's write) is sent alone
(`Wire.send`): its answer is kept when it comes while the thread awaits others.

A request that cannot be sent (no server yet, a reconnect) is tried again until its
deadline, or for as long as the process is patient (`ralph_mail.store.outage`); one that
was sent and met a broken connection is not (it may have been stored): it raises, as a
timeout would. A login the server refuses is said at once, and never tried again.

A URL may name a cluster's servers, comma separated (`servers`): a connection goes to
the first that answers, and a new one, after one broke, to the next first. A request
that may be sent twice (a read; a publish, which carries a ``Nats-Msg-Id`` the stream
deduplicates) is sent again over it; one that may not is not.
"""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Final, TypeVar

from ralph_mail.errors import MailError
from ralph_mail.store.nats import auth
from ralph_mail.store.nats.urls import Address, addresses, redacted
from ralph_mail.store.outage import Tries, answered

_T = TypeVar("_T")


def _seconds(name: str, default: float) -> float:
    try:
        return max(0.5, float(os.environ.get(name, default)))
    except ValueError:
        return default


#: How long a request may take by default, its tries included (s): a one-off command
#: meeting a server that is away gives up after it. ``RALPH_NATS_TIMEOUT_S`` sets it
#: (read once, when the store is first imported).
REQUEST_S: Final = _seconds("RALPH_NATS_TIMEOUT_S", 10.0)
#: How long one try of a request that may be sent again waits for its answer (s).
TRY_S: Final = 1.0
#: How many answers to publishes made with `Wire.send` a connection keeps unasked for.
LATER_KEPT: Final = 64
#: How long the greeting of a server just reached may take (s).
_HANDSHAKE_S: Final = 2.0
_CRLF: Final = b"\r\n"


@dataclass
class Reply:
    """One message of an answer: its headers (a status, when the server sent one, under
    ``Status``) and its payload."""

    headers: dict[str, str] = field(default_factory=dict)
    data: bytes = b""
    subject: str = ""  # its own subject: a stored message's, for one pulled from a stream
    reply: str = ""  # a stored message's ``$JS.ACK...``: its stream sequence, and more

    @property
    def status(self) -> str | None:
        return self.headers.get("Status")

    def pulled(self) -> tuple[str, int, int] | None:
        """For a line a consumer brought: that consumer, the line's stream sequence and
        how many lines follow it in the consumer's subjects (its ack subject,
        ``$JS.ACK.[domain.account.]stream.consumer.delivered.sseq.cseq.ts.pending``
        [``.token``]); None for any other message."""
        if not self.reply.startswith("$JS.ACK."):
            return None
        tokens = self.reply.split(".")
        at = 2 if len(tokens) == 9 else 4  # (a v2 subject: domain and account first)
        return tokens[at + 1], int(tokens[at + 3]), int(tokens[at + 6])


@dataclass
class _Pull:
    """A consumer's standing pull (see `Wire.pulled`): up to ``left`` more lines, until
    ``due`` (monotonic), over connection number ``connection``; what came for it while
    its thread awaited other answers, ``held``, each with the thread's request count
    when it came."""

    reply: bytes
    left: int
    due: float
    connection: int
    held: deque[tuple[Reply, int]] = field(default_factory=deque)
    over: bool = False  # its lines all came, or its end did (a status)


class WireError(ConnectionError):
    """The server could not be reached, or went away under a request."""


class Unreachable(WireError):
    """No server answered at the URL (in time)."""


class NeverReached(Unreachable):
    """No server at the URL, and this process never reached one there: said at once,
    with the fix."""


class Refused(WireError):
    """The server refused the login (no user, a wrong password or token): said at once,
    never tried again."""


class Forbidden(WireError):
    """The server refused a publish: this user's permissions do not allow the subject
    (``ralph-mail nats config``). Said at once, never tried again."""


class TooBig(WireError):
    """A message over the server's ``max_payload``: refused before it is sent (the
    server would close the connection on it)."""


class Wire:
    """One blocking connection to a NATS server (not thread safe: see `for_thread`)."""

    _local = threading.local()
    _reached: ClassVar[set[tuple[int, str]]] = set()  # (pid, url) it has connected to

    def __init__(self, url: str) -> None:
        self.url = url
        self.shown = redacted(url)  # the URL as messages show it
        self._sock: socket.socket | None = None
        self._buf = b""
        self._asked = 0
        self._at = 0  # which of a cluster's servers (see `servers`) to try first
        self._inbox = f"_INBOX.{os.urandom(8).hex()}"
        self.max_payload = 1 << 20  # what the server says when it is reached
        self.jetstream = True  # whether it says JetStream is on (its INFO's "jetstream")
        self._connections = 0  # how many it made
        self._pulls: dict[str, _Pull] = {}  # consumer name -> its standing pull
        self._pulled_by: dict[bytes, str] = {}  # a standing pull's reply -> its consumer
        self._later: dict[bytes, Reply | None] = {}  # a reply to read later -> its answer

    @classmethod
    def for_thread(cls, url: str) -> Wire:
        """This thread's connection to ``url`` (made on first use)."""
        wires: dict[tuple[int, str], Wire] = cls._local.__dict__.setdefault("wires", {})
        wire = wires.get((os.getpid(), url))
        if wire is None:
            wire = wires[os.getpid(), url] = cls(url)
        return wire

    # -- connecting -------------------------------------------------------------------

    def _connect(self, deadline: float) -> None:
        """Connect, and try again until ``deadline`` when this process reached the
        server before (it is restarting); at once, the first time (nothing there). Of
        a cluster's servers (see `servers`), the first that answers, starting with the
        one after the last that broke."""
        try:
            wheres = addresses(self.url)
        except ValueError as exc:
            raise NeverReached(str(exc)) from None
        tries = Tries(deadline, f"the NATS server at {self.shown}")
        while True:
            why = ""
            for step in range(len(wheres)):
                at = (self._at + step) % len(wheres)
                where = wheres[at]
                left = max(0.1, deadline - time.monotonic())
                if len(wheres) > 1:  # (a server that hangs leaves time for the others)
                    left = min(left, _HANDSHAKE_S)
                try:
                    sock = socket.create_connection((where.host, where.port), left)
                except OSError as exc:
                    why = f"{why}; " * bool(why) + f"{where.host}:{where.port}: {exc}"
                    continue
                self._at = at
                self._open(sock, where, deadline)
                return
            if (os.getpid(), self.url) not in Wire._reached:
                raise NeverReached(
                    f"cannot reach the NATS server at {self.shown} ({why}): start it "
                    "(nats-server -js) or check RALPH_BACKEND"
                ) from None
            if not tries.again(why):
                raise Unreachable(f"cannot reach {self.shown} ({why})") from None

    def _open(self, sock: socket.socket, where: Address, deadline: float) -> None:
        """The greeting over ``sock``, just connected to ``where``."""
        deadline = max(deadline, time.monotonic() + _HANDSHAKE_S)  # (patient: past it)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._buf = sock, b""
        self._connections += 1
        try:
            self._greet(where, deadline)
        except WireError:
            raise
        except OSError as exc:  # closed, reset, TLS refused: as a connection that broke
            self.close()
            raise WireError(f"{where.host}:{where.port} closed the connection ({exc})") from None

    def _greet(self, where: Address, deadline: float) -> None:
        """INFO, CONNECT (and TLS first, when asked), PING: PONG, or why not."""
        assert self._sock is not None
        sock, host, port = self._sock, where.host, where.port
        line = self._line(deadline)
        if not line.startswith(b"INFO "):
            raise WireError(f"{host}:{port} is not a NATS server")
        info = json.loads(line[5:])
        self.max_payload = int(info.get("max_payload", self.max_payload))
        self.jetstream = bool(info.get("jetstream"))
        if where.tls or info.get("tls_required"):
            context = ssl.create_default_context()
            self._sock = context.wrap_socket(sock, server_hostname=host)
        options: dict[str, object] = {"verbose": False, "pedantic": False, "headers": True,
                                      "no_responders": True, "protocol": 1,
                                      "lang": "python-ralph", "version": "1"}  # fmt: skip
        try:
            user, password = auth.login(where.user, where.password)  # (or RALPH_NATS_CREDS's)
        except MailError as exc:
            self.close()
            raise Refused(str(exc)) from None
        if user is not None and password is not None:
            options["user"], options["pass"] = user, password
        elif user is not None:
            options["auth_token"] = user
        self._send(b"CONNECT " + json.dumps(options).encode() + _CRLF
                   + f"SUB {self._inbox}.* 1".encode() + _CRLF + b"PING" + _CRLF)  # fmt: skip
        while True:
            line = self._line(deadline)
            if line == b"PONG":
                Wire._reached.add((os.getpid(), self.url))
                return
            if line.startswith(b"-ERR"):
                self.close()
                why = line[5:].decode(errors="replace").strip(" '")
                if not any(word in why.lower() for word in ("authori", "authenti")):
                    raise WireError(f"{host}:{port} refused the connection: {why}")
                login = "a user and password (nats://USER:PASS@HOST:PORT, or RALPH_NATS_CREDS=" \
                        "FILE) or a token (nats://TOKEN@HOST:PORT)"  # fmt: skip
                raise Refused(f"the NATS server at {self.shown} refused the login ({why}): "
                              f"give {login} that it accepts")  # fmt: skip

    def _alive(self) -> bool:
        """False when the server has closed the connection (a look, no wait)."""
        assert self._sock is not None
        if isinstance(self._sock, ssl.SSLSocket):
            return True  # no peeking through TLS: a dead one fails the request
        try:
            if not select.select([self._sock], [], [], 0)[0]:
                return True  # nothing to read: open
            return self._sock.recv(1, socket.MSG_PEEK) != b""  # something: data, or the end
        except OSError:
            return False

    def close(self) -> None:
        """Close the connection; the next one tries a cluster's next server first. The
        answers still to come on it never will (see `answer`)."""
        self._later.clear()
        if self._sock is not None:
            self._at += 1  # (a server that broke a connection may be gone)
            try:
                self._sock.close()
            finally:
                self._sock = None

    # -- requests ---------------------------------------------------------------------

    def request(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str] | None = None,
        *,
        timeout: float = REQUEST_S,
        batch: bool = False,
        again: bool = False,
    ) -> list[Reply]:
        """Publish ``payload`` to ``subject`` and return its answer: one message, or
        with ``batch`` every message up to the one carrying a status (a batched direct
        get's end). Raises `WireError` when the connection broke after it was sent, and
        `TimeoutError` when no answer came in time. ``again``: a request that may be
        sent twice (a read, a publish the server deduplicates), sent again over a new
        connection, or when no answer came within `TRY_S` (a leader election lost it),
        until ``timeout``, or for as long as the process is patient."""

        def attempt(deadline: float, answer_by: float) -> list[Reply]:
            return self._request(subject, payload, headers, deadline, batch, answer_by)

        return self._tried(attempt, timeout, again)

    def many(
        self, asks: list[tuple[str, bytes]], *, timeout: float = REQUEST_S
    ) -> list[list[Reply]]:
        """Batched reads (see ``batch`` of `request`) at once: all published before any
        answer is read, so that they cost one round trip, not one each; each one's
        answer sorted out by its reply subject. Sent again as `request` sends a read."""
        posts: list[tuple[str, bytes, dict[str, str] | None]]
        posts = [(subject, payload, None) for subject, payload in asks]
        return self._tried(lambda deadline, by: self._many(posts, deadline, by), timeout, True)

    def publish_all(
        self, posts: list[tuple[str, bytes, dict[str, str] | None]], *, timeout: float = REQUEST_S
    ) -> list[Reply]:
        """Publish each ``(subject, payload, headers)`` and return each one's answer (an
        ack), all in one write and one round trip, as `many` does. Sent again whole when
        no answer came: for messages the stream stores once (a ``Nats-Msg-Id`` each)."""
        answers = self._tried(
            lambda deadline, by: self._many(posts, deadline, by, batch=False), timeout, True
        )
        return [found[0] for found in answers]

    def send(self, subject: str, payload: bytes, headers: dict[str, str] | None = None) -> bytes:
        """Publish ``payload`` to ``subject`` and return at once, with the reply subject
        its answer comes to: this thread reads it later (`answer`), or while it awaits
        other answers. A publish made so costs no round trip of its own: its answer
        comes while the thread goes on. Only the last `LATER_KEPT` answers not asked
        for are kept (one whose thread went elsewhere is dropped in the end)."""
        reply = self._reply()
        frame, body = self._frame(subject, reply, payload, headers)
        self._publish(frame, body, time.monotonic() + REQUEST_S)
        if len(self._later) >= LATER_KEPT:
            del self._later[next(iter(self._later))]
        self._later[reply] = None
        return reply

    def answer(self, reply: bytes, timeout: float = REQUEST_S) -> Reply:
        """The answer to a publish `send` made (held, or read now, holding what comes
        meanwhile). `WireError` when the connection it went over broke (it may have
        been stored, or not), `TimeoutError` when none came in time."""
        if reply not in self._later:
            raise WireError(f"lost the connection to {self.shown}")
        deadline = time.monotonic() + timeout
        try:
            while self._later[reply] is None:
                self._hold(*self._message(deadline, deadline))
        except (WireError, TimeoutError):
            raise
        except OSError as exc:
            self.close()
            raise WireError(f"lost the connection to {self.shown} ({exc})") from None
        answer = self._later.pop(reply)
        assert answer is not None
        return answer

    def _tried(self, attempt: Callable[[float, float], _T], timeout: float, again: bool) -> _T:
        """``attempt(deadline, answer_by)`` until it answers: tried again (``again``) as
        `request` says, over a new connection or once no answer came by ``answer_by``."""
        deadline = time.monotonic() + timeout
        tries = Tries(deadline, f"the NATS server at {self.shown}")
        while True:
            answer_by = min(deadline, time.monotonic() + TRY_S) if again else deadline
            try:
                answer = attempt(deadline, answer_by)
                answered(tries.where)
                return answer
            except (Unreachable, Refused, Forbidden):
                raise  # (connecting tried again until the deadline already, or must not)
            except (WireError, TimeoutError) as exc:
                if not again or not tries.again(str(exc) or "no answer"):
                    raise
                deadline = max(deadline, time.monotonic() + TRY_S)  # (patient: past it)

    def _many(
        self,
        asks: list[tuple[str, bytes, dict[str, str] | None]],
        deadline: float,
        answer_by: float,
        batch: bool = True,
    ) -> list[list[Reply]]:
        replies = [self._reply() for _ in asks]
        framed = [
            self._frame(subject, reply, payload, headers)
            for (subject, payload, headers), reply in zip(asks, replies, strict=True)
        ]
        largest = max(body for _, body in framed)
        self._publish(b"".join(frame for frame, _ in framed), largest, deadline)
        found: dict[bytes, list[Reply]] = {reply: [] for reply in replies}
        open_, heard = set(replies), False
        try:
            while open_:
                first = 0.0 if heard else answer_by  # (the first answer by answer_by)
                reply, answer = self._next_of(open_, deadline, head_by=first)
                heard = True
                if not batch:  # (one answer each)
                    found[reply].append(answer)
                    open_.discard(reply)
                    continue
                if answer.status is None:
                    found[reply].append(answer)
                    continue
                if answer.status == "204" or not found[reply]:
                    found[reply].append(answer)
                open_.discard(reply)
        except (TimeoutError, Forbidden):
            raise
        except OSError as exc:
            self.close()
            raise WireError(f"lost the connection to {self.shown} ({exc})") from None
        return [found[reply] for reply in replies]

    @property
    def asked(self) -> int:
        """How many requests this connection has sent (each of a `many` counted)."""
        return self._asked

    def _reply(self) -> bytes:
        self._asked += 1
        return f"{self._inbox}.{self._asked}".encode()

    @staticmethod
    def _frame(
        subject: str, reply: bytes, payload: bytes, headers: dict[str, str] | None
    ) -> tuple[bytes, int]:
        """A PUB (or HPUB, with headers) frame, and the size of its message."""
        if headers:
            block = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
            block += _CRLF
            body = len(block) + len(payload)
            sizes = b"%d %d" % (len(block), body)
            return b"HPUB %s %s %s\r\n%s%s\r\n" % (subject.encode(), reply, sizes, block,
                                                    payload), body  # fmt: skip
        body = len(payload)
        return b"PUB %s %s %d\r\n%s\r\n" % (subject.encode(), reply, body, payload), body

    def _publish(self, frames: bytes, body: int, deadline: float) -> None:
        """Send ``frames`` (connecting first, until ``deadline``), once more over a new
        connection when one that was idle broke; `TooBig` for a message of ``body``
        bytes over the server's ``max_payload``."""
        for attempt in range(2):
            if self._sock is not None and not self._alive():
                self.close()  # the server went away while this was idle
            if self._sock is None:
                self._connect(deadline)
            if body > self.max_payload:
                raise TooBig(
                    f"a message of {body:,} bytes with its headers is over the "
                    f"server's max_payload ({self.max_payload:,} bytes)"
                )
            try:
                assert self._sock is not None
                self._sock.settimeout(max(0.1, deadline - time.monotonic()))  # (a big frame)
                self._send(frames)
                return
            except OSError:
                self.close()  # a connection that broke while idle: once more, anew
                if attempt:
                    raise WireError(f"lost the connection to {self.shown}") from None

    def _request(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str] | None,
        deadline: float,
        batch: bool,
        answer_by: float | None = None,
    ) -> list[Reply]:
        """One try: connect (until ``deadline``), send, and wait for the answer's first
        message until ``answer_by`` (the deadline by default), the rest until
        ``deadline``."""
        reply = self._reply()
        frame, body = self._frame(subject, reply, payload, headers)
        self._publish(frame, body, deadline)
        found: list[Reply] = []
        try:
            while True:
                first = answer_by if answer_by is not None and not found else 0.0
                answer = self._next(reply, deadline, first)  # (the first by answer_by)
                if not batch:
                    return [answer]
                if answer.status is not None:
                    if answer.status == "204" or not found:
                        found.append(answer)
                    return found
                found.append(answer)
        except (TimeoutError, Forbidden):
            raise  # the connection stays: a late answer goes to a reply no one waits on
        except OSError as exc:
            self.close()
            raise WireError(f"lost the connection to {self.shown} ({exc})") from None

    def _next(self, reply: bytes, deadline: float, head_by: float = 0.0) -> Reply:
        """The next message sent to ``reply`` (others, late answers, are dropped; a
        standing pull's are held for it)."""
        return self._next_of({reply}, deadline, head_by)[1]

    def _next_of(
        self, replies: set[bytes], deadline: float, head_by: float = 0.0
    ) -> tuple[bytes, Reply]:
        """The next message sent to one of ``replies``, and to which: its first line by
        ``head_by`` (when given: a try that may be given up sooner), the rest by
        ``deadline``. A standing pull's that come meanwhile are held for it."""
        while True:
            to, answer = self._message(head_by or deadline, deadline)
            if to in replies:
                return to, answer
            self._hold(to, answer)

    def _message(self, head_by: float, deadline: float) -> tuple[bytes, Reply]:
        """The next message that comes, and its subject: its first line by ``head_by``,
        the rest by ``deadline``. A message cut off by the deadline closes the
        connection (the next bytes on it would be read as the middle of that message)."""
        while True:
            line = self._line(head_by)
            if line.startswith((b"MSG ", b"HMSG ")):
                words = line.split()
                total = int(words[-1])
                try:
                    body = self._read(total + 2, deadline)[:total]
                except TimeoutError:
                    self.close()
                    raise
                head = int(words[-2]) if words[0] == b"HMSG" else 0
                sizes = 2 if words[0] == b"HMSG" else 1  # MSG subject sid [reply] sizes
                acked = words[3] if len(words) == 4 + sizes else b""
                return words[1], Reply(_headers(body[:head]) if head else {}, body[head:],
                                       words[1].decode(), acked.decode())  # fmt: skip
            if line == b"PING":
                self._send(b"PONG" + _CRLF)
            elif line.startswith(b"-ERR"):
                why = line[5:].decode(errors="replace").strip(" '")
                if why.startswith("Permissions Violation"):  # (the connection stays open)
                    raise Forbidden(f"the NATS server at {self.shown} refused it: {why}")
                raise WireError(f"{self.shown}: {why}")

    # -- standing pulls ---------------------------------------------------------------

    def pulled(
        self, subject: str, consumer: str, batch: int, expires: float, until: float
    ) -> tuple[Reply, int] | None:
        """The next line ``consumer`` brings (or the status that ended its pull), with
        this thread's request count when it came; None when none came by ``until``.

        A consumer's pull stands: up to ``batch`` lines within ``expires`` seconds, each
        sent as it is stored; one is asked of ``subject`` (its next-messages API) when
        none stands and nothing is held. So a waiter that waits again and again asks
        once every ``batch`` lines, not once a wait; what comes while its thread awaits
        other answers is held for it (``batch`` lines at most). A pull whose connection
        broke ends with a status of its own (409, "Connection Lost"): what was sent to
        it meanwhile is lost, and its consumer must be made again."""
        pull = self._pulls.get(consumer)
        if pull is not None and not (pull.held or pull.over or self.pulling(consumer)):
            pull.over = True  # its connection broke: lines sent to it meanwhile are lost
            return Reply({"Status": "409", "Description": "Connection Lost"}), self._asked
        if pull is None or not (pull.held or self.pulling(consumer)):
            pull = self._pull(subject, consumer, batch, expires)
        try:
            while not pull.held:
                self._hold(*self._message(until, max(until, time.monotonic() + TRY_S)))
        except TimeoutError:
            if self._sock is None:  # (cut off: a connection that broke)
                raise WireError(f"lost the connection to {self.shown}") from None
            return None
        except OSError as exc:
            self.close()
            raise WireError(f"lost the connection to {self.shown} ({exc})") from None
        return pull.held.popleft()

    def pulling(self, consumer: str) -> float | None:
        """When the standing pull of ``consumer`` ends (monotonic), None when it has
        none open over this connection."""
        pull = self._pulls.get(consumer)
        if pull is None or pull.over or self._sock is None:
            return None
        return pull.due if pull.connection == self._connections else None

    def forget(self, consumer: str) -> None:
        """Drop the standing pull of ``consumer`` (deleted, or made again) and what it
        held: what comes for it from now on is dropped."""
        pull = self._pulls.pop(consumer, None)
        if pull is not None:
            self._pulled_by.pop(pull.reply, None)

    def _pull(self, subject: str, consumer: str, batch: int, expires: float) -> _Pull:
        self.forget(consumer)
        reply = self._reply()
        ask = json.dumps({"batch": batch, "expires": int(expires * 1e9)}).encode()
        frame, body = self._frame(subject, reply, ask, None)
        self._publish(frame, body, time.monotonic() + REQUEST_S)
        pull = _Pull(reply, batch, time.monotonic() + expires, self._connections)
        self._pulls[consumer], self._pulled_by[reply] = pull, consumer
        return pull

    def _hold(self, to: bytes, message: Reply) -> None:
        """Keep ``message``, sent to ``to``, for the standing pull it belongs to (a line
        it brought names its consumer in its ack subject; its end comes to its reply);
        drop it when none (a late answer, a pull forgotten). An answer to a publish
        `send` made is kept for `answer`."""
        if to in self._later:
            self._later[to] = message
            return
        brought = message.pulled()
        if brought is not None:
            pull = self._pulls.get(brought[0])
            if pull is not None and not pull.over:
                pull.left -= 1
                pull.over = pull.left <= 0
                pull.held.append((message, self._asked))
            return
        ended = self._pulls.get(self._pulled_by.pop(to, ""))  # (one look: a waiter may
        if ended is not None:  # be closed by another thread meanwhile)
            ended.over = True
            ended.held.append((message, self._asked))

    # -- bytes ------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        assert self._sock is not None
        self._sock.sendall(data)

    def _fill(self, deadline: float) -> None:
        assert self._sock is not None
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer from {self.shown} in time")
        self._sock.settimeout(left)
        try:
            chunk = self._sock.recv(1 << 16)
        except TimeoutError:
            raise TimeoutError(f"no answer from {self.shown} in time") from None
        if not chunk:
            raise ConnectionResetError("the server closed the connection")
        self._buf += chunk

    def _line(self, deadline: float) -> bytes:
        while (end := self._buf.find(_CRLF)) < 0:
            self._fill(deadline)
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        return line

    def _read(self, size: int, deadline: float) -> bytes:
        while len(self._buf) < size:
            self._fill(deadline)
        data, self._buf = self._buf[:size], self._buf[size:]
        return data


def _headers(block: bytes) -> dict[str, str]:
    """``NATS/1.0 [status [description]]`` and ``Name: value`` lines."""
    lines = block.decode("utf-8", "replace").split("\r\n")
    found: dict[str, str] = {}
    status = lines[0][len("NATS/1.0") :].strip()
    if status:
        code, _, description = status.partition(" ")
        found["Status"] = code
        if description:
            found["Description"] = description
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            found[name.strip()] = value.strip()
    return found
