"""The NATS store's synchronous connection (`ralph_mail.store.nats.wire`), against a
scripted server that speaks just enough of the protocol to break where told."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from ralph_mail.store.nats.urls import redacted, servers
from ralph_mail.store.nats.wire import TooBig, Wire, WireError, _headers


class Scripted:
    """A server on a free loopback port: each connection gets INFO, answers PING, and
    meets a publish with the next action: "answer" (MSG to its reply subject), "drop"
    (closes the connection without answering), "late" (answers with the next one), "lose"
    (never answers) or "slow" (answers, the payload's second half 1.5 s after its first)."""

    def __init__(self, actions: list[str]) -> None:
        self.actions = actions
        self.published: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.actions:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            held: tuple[bytes, bytes] | None = None
            with conn, conn.makefile("rb") as lines:
                conn.sendall(b'INFO {"server_id":"scripted","headers":true,'
                             b'"max_payload":1000}\r\n')  # fmt: skip
                for line in lines:
                    if line.startswith(b"PING"):
                        conn.sendall(b"PONG\r\n")
                    elif line.startswith((b"PUB ", b"HPUB ")):
                        words = line.split()
                        payload = lines.read(int(words[-1]) + 2)[:-2]
                        if words[0] == b"HPUB":  # the headers, then the payload
                            payload = payload[int(words[-2]) :]
                        self.published.append(payload)
                        action = self.actions.pop(0)
                        if action == "drop":
                            break
                        if action == "late":
                            held = (words[2], payload)
                            continue
                        if action == "lose":
                            continue
                        if action == "slow":  # (the server's own pace, not a test's wait)
                            head = b"MSG %s 1 %d\r\n" % (words[2], len(payload))
                            conn.sendall(head + payload[: len(payload) // 2])
                            time.sleep(1.5)
                            with contextlib.suppress(OSError):  # (the client may be gone)
                                conn.sendall(payload[len(payload) // 2 :] + b"\r\n")
                            continue
                        answers = [held] if held else []
                        for reply, data in [*answers, (words[2], payload)]:  # the late one first
                            conn.sendall(b"MSG %s 1 %d\r\n%s\r\n" % (reply, len(data), data))
                        held = None

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def scripted() -> Iterator[type[Scripted]]:
    made: list[Scripted] = []

    def make(actions: list[str]) -> Scripted:
        made.append(server := Scripted(actions))
        return server

    yield make  # type: ignore[misc]
    for server in made:
        server.close()


def test_a_request_gets_its_answer(scripted: type[Scripted]) -> None:
    server = scripted(["answer", "answer"])
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    assert wire.request("x", b"one")[0].data == b"one"
    assert wire.request("x", b"two", {"Ralph-N": "2"})[0].data == b"two"
    wire.close()


def test_a_read_is_asked_again_over_a_new_connection_when_one_breaks(
    scripted: type[Scripted],
) -> None:
    server = scripted(["drop", "answer"])
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    assert wire.request("x", b"read", again=True, timeout=10)[0].data == b"read"
    assert server.published == [b"read", b"read"]
    wire.close()


def test_a_publish_that_met_a_broken_connection_is_not_sent_again(
    scripted: type[Scripted],
) -> None:
    """It may have been stored: the caller hears of it, as of a timeout."""
    server = scripted(["drop", "answer"])
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    with pytest.raises(WireError, match="lost the connection"):
        wire.request("x", b"append", timeout=10)
    assert server.published == [b"append"]
    wire.close()


def test_a_timed_out_request_leaves_the_connection_to_the_next(
    scripted: type[Scripted],
) -> None:
    """Its answer, when it comes late, is not taken for the next request's."""
    server = scripted(["late", "answer"])
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    with pytest.raises(TimeoutError):
        wire.request("x", b"slow", timeout=0.3)
    assert wire.request("x", b"next")[0].data == b"next"
    wire.close()


def test_a_read_whose_answer_does_not_start_within_a_try_is_sent_again(
    scripted: type[Scripted],
) -> None:
    """A request lost on the way (a leader election) is sent again after `TRY_S`; an
    answer that has started is waited for to its end, however slow, and not sent again."""
    server = scripted(["lose", "answer", "slow"])
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    assert wire.request("x", b"lost once", again=True, timeout=10)[0].data == b"lost once"
    assert wire.request("x", b"slowly", again=True, timeout=10)[0].data == b"slowly"
    assert server.published == [b"lost once", b"lost once", b"slowly"]
    wire.close()


def test_an_answer_cut_off_by_the_timeout_leaves_no_half_message_for_the_next(
    scripted: type[Scripted],
) -> None:
    """The rest of a message that came too late is not read as the next answer."""
    server = scripted(["slow", "answer"])
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    with pytest.raises(TimeoutError):
        wire.request("x", b"half of it\r\n-ERR 'then the rest'", timeout=0.5)
    assert wire.request("x", b"next", timeout=10)[0].data == b"next"
    wire.close()


def test_a_publish_sent_without_waiting_has_its_answer_kept_while_others_are_awaited(
    scripted: type[Scripted],
) -> None:
    """`Wire.send` costs no round trip: its answer comes while the thread awaits the next
    request's, and is kept for `Wire.answer`; one asked for before it came is read then."""
    server = scripted(["answer", "answer", "answer"])
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    first = wire.send("x", b"cursor")
    assert wire.request("x", b"reply")[0].data == b"reply"  # (the send's answer came first)
    assert wire._later[first] is not None  # kept, not dropped as a late answer
    assert wire.answer(first).data == b"cursor"
    second = wire.send("x", b"again")
    assert wire.answer(second, 10).data == b"again"  # (read now)
    assert server.published == [b"cursor", b"reply", b"again"] and not wire._later
    wire.close()


def test_a_publish_sent_without_waiting_whose_connection_broke_has_no_answer(
    scripted: type[Scripted],
) -> None:
    """It may have been stored, or not: `answer` says the connection was lost (its caller
    makes the write again, waited for), and nothing of it stays behind."""
    server = scripted(["drop", "lose"])
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    sent = wire.send("x", b"cursor")
    with pytest.raises(WireError, match="lost the connection"):
        wire.answer(sent, 10)
    assert not wire._later
    kept = wire.send("x", b"next")
    wire.close()  # (a connection closed by this side: its answers never come)
    with pytest.raises(WireError, match="lost the connection"):
        wire.answer(kept)


def test_answers_no_one_asks_for_are_bounded(scripted: type[Scripted]) -> None:
    """A thread that sent and went elsewhere leaves at most `LATER_KEPT` answers."""
    from ralph_mail.store.nats.wire import LATER_KEPT

    server = scripted(["answer"] * (LATER_KEPT + 10))
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    sent = [wire.send("x", b"%d" % n) for n in range(LATER_KEPT + 10)]
    assert len(wire._later) == LATER_KEPT
    assert wire.answer(sent[-1], 10).data == b"%d" % (LATER_KEPT + 9)
    with pytest.raises(WireError):
        wire.answer(sent[0])  # (dropped: the oldest)
    wire.close()


def test_a_message_over_the_servers_max_payload_is_refused_unsent(
    scripted: type[Scripted],
) -> None:
    """The server would close the connection on it: it is refused here, and the
    connection serves the next request."""
    server = scripted(["answer"])
    wire = Wire(f"nats://127.0.0.1:{server.port}")
    with pytest.raises(TooBig, match="over the server's max_payload"):
        wire.request("x", b"y" * 990, {"Ralph-N": "1"})
    assert wire.request("x", b"small")[0].data == b"small"
    assert server.published == [b"small"]
    wire.close()


def test_a_read_goes_to_a_clusters_next_server_when_one_breaks(
    scripted: type[Scripted],
) -> None:
    """The first server breaks the connection under a read and is gone after: the read is
    asked again of the second; a publish that then meets a broken connection there is not
    sent again (to either)."""
    first, second = scripted(["drop"]), scripted(["answer", "drop", "answer"])
    wire = Wire(f"nats://127.0.0.1:{first.port},127.0.0.1:{second.port}")
    assert wire.request("x", b"read", again=True, timeout=10)[0].data == b"read"
    assert first.published == [b"read"] and second.published == [b"read"]
    with pytest.raises(WireError, match="lost the connection"):
        wire.request("x", b"append", timeout=10)
    assert first.published == [b"read"] and second.published == [b"read", b"append"]
    wire.close()


def test_a_clusters_servers_are_each_a_url_with_the_first_ones_scheme_and_login() -> None:
    assert servers("nats://a:1") == ["nats://a:1"]
    assert servers("nats://u:p@a:1, b:2,tls://c:3") == [
        "nats://u:p@a:1", "nats://u:p@b:2", "tls://u:p@c:3"]  # fmt: skip
    assert servers("nats://t@a:1,nats://v@b:2") == ["nats://t@a:1", "nats://v@b:2"]
    assert redacted("nats://u:p@a:1,u:q@b:2") == "nats://u:***@a:1,u:***@b:2"
    with pytest.raises(ValueError, match="an empty server"):
        servers("nats://a:1,,b:2")


def test_no_server_of_a_cluster_is_a_wire_error_naming_each() -> None:
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    with pytest.raises(WireError, match="cannot reach") as raised:
        Wire(f"nats://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}").request("x", b"", timeout=0.5)
    assert all(str(port) in str(raised.value) for port in ports)


def test_no_server_is_a_wire_error_within_the_timeout() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free, and nothing listens once closed
    with pytest.raises(WireError, match="cannot reach"):
        Wire(f"nats://127.0.0.1:{port}").request("x", b"", timeout=0.5)


def test_headers_carry_a_status_and_their_values() -> None:
    assert _headers(b"NATS/1.0 404 Message Not Found\r\n\r\n") == {
        "Status": "404", "Description": "Message Not Found"}  # fmt: skip
    assert _headers(b"NATS/1.0\r\nNats-Sequence: 7\r\nRalph-Offset: 120\r\n\r\n") == {
        "Nats-Sequence": "7", "Ralph-Offset": "120"}  # fmt: skip
