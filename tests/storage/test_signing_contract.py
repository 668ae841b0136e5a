"""Signed senders on every backend (files, memory, nats): what an agent with a key sends
verifies against the roster, what does not is found out by the reader, and under
``require_signed`` the writer's Gate refuses and the reader sets aside."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ralph_mail import MessageBus, PermissionDenied, create_team
from ralph_mail.govern import keys
from ralph_mail.message import encode_parts
from ralph_mail.signing import canonical
from tests.helpers.backends import BACKENDS, backend_url


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path, home: Path) -> str:
    """Team 'demo' (lead, w1, w2) in a fresh place of the backend under test, lead and w1
    with keys (w2 without)."""
    where = backend_url(request.param, tmp_path)
    create_team("demo", ["lead", "w1", "w2"], home=home, backend=where)
    for agent in ("lead", "w1"):
        with MessageBus("demo", agent, backend=where) as bus:
            keys.create(bus)
    return where


def bus(url: str, agent: str) -> MessageBus:
    return MessageBus("demo", agent, backend=url)


def raw_append(url: str, envelope: dict[str, object]) -> None:
    """Write ``envelope`` as it is into its recipient's inbox, past any Gate: what a
    writer on another host, or a hand on the stored data, can do."""
    sender = bus(url, "w2")
    head, tail = encode_parts(dict(envelope), 1 << 20)
    sender.store.append(str(envelope["to"]), head, tail)


def test_a_signed_message_verifies_and_an_unsigned_one_is_none(url: str) -> None:
    """lead (a key) and w2 (none) write to w1: lead's message verifies True, w2's is None;
    the signature rides in the envelope (kid and sig), never `verified`."""
    bus(url, "lead").send("w1", "text", "from the lead")
    bus(url, "w2").send("w1", "text", "from w2")
    got = bus(url, "w1").poll()
    assert [(m.content, m.verified) for m in got] == [("from the lead", True), ("from w2", None)]
    wire = got[0].to_dict()
    assert {"kid", "sig"} <= set(wire) and "verified" not in wire
    assert "sig" not in got[1].to_dict()


def test_broadcast_reply_ack_and_task_result_are_signed(url: str) -> None:
    """Every kind of write of an agent with a key carries a good signature: a broadcast's
    copies (one signature, a ts each), a reply, an ack, a task's assignment and result."""
    lead, w1 = bus(url, "lead"), bus(url, "w1")
    assert w1.poll() == []  # (w1 is seen: a task may be delegated to it)
    lead.broadcast("all hands")
    lead.send("w1", "request", "size?", ack=True)
    task = lead.delegate("w1", "parse the logs")
    got = w1.poll()
    assert [m.verified for m in got] == [True, True, True]
    w1.reply(got[1], "42")
    w1.ack(got[1])
    w1.complete(task.id, "parsed")
    from_w1 = lead.poll()
    assert len(from_w1) == 3 and all(m.verified is True for m in from_w1), from_w1
    assert [m.verified for m in bus(url, "w2").poll()] == [True]  # the broadcast's copy


def test_a_tampered_envelope_verifies_false(url: str) -> None:
    """A signed envelope whose body was changed after signing (same sig and kid) reads
    as verified False; so does one signed by a key that is not the sender's."""
    lead = bus(url, "lead")
    sent = lead.send("w2", "text", "pay 10")
    # (New ids: NATS stores a line of an id it has within its duplicate window once.)
    forged = {**sent.to_dict(), "id": "f00000000001", "content": "pay 1000"}
    raw_append(url, forged)
    w1_sig = bus(url, "w1").send("w2", "text", "mine").to_dict()
    stolen = {**w1_sig, "id": "f00000000002", "from": "lead"}  # w1's sig, lead's name
    raw_append(url, stolen)
    got = bus(url, "w2").poll()
    assert [(m.content, m.verified) for m in got] == [
        ("pay 10", True), ("pay 1000", False), ("mine", True), ("mine", False),
    ]  # fmt: skip


def test_the_signature_covers_the_canonical_envelope_without_sig_and_ts(url: str) -> None:
    """What is signed is `canonical`: the stored envelope less sig and ts, keys sorted;
    a copy re-signed by hand with lead's key checks out against the roster."""
    from ralph_mail import signing

    lead = bus(url, "lead")
    wire = lead.send("w1", "text", "héllo", {"b": "2", "a": "1"}).to_dict()
    body = canonical(wire)
    assert b'"ts"' not in body and b'"sig"' not in body
    assert body.index(b'"content"') < body.index(b'"from"') < body.index(b'"kid"')
    assert signing.check(wire, lead.me().key)
    assert signing.check({**wire, "ts": "2000-01-01T00:00:00.000000Z"}, lead.me().key)
    assert not signing.check({**wire, "metadata": {"a": "1"}}, lead.me().key)


def test_require_signed_refuses_the_keyless_writer_and_sets_aside_for_the_reader(
    url: str,
) -> None:
    """Under require_signed, w2 (no key) is refused at its Gate and nothing is written;
    an unsigned or forged envelope written past the Gate is set aside as a dead letter
    by the reader, whose cursor moves past it: the next read has only what came after."""
    lead = bus(url, "lead")
    lead.change_policy(lambda policy: replace(policy, require_signed=True))
    w2 = bus(url, "w2")
    with pytest.raises(PermissionDenied, match="requires signed messages"):
        w2.send("w1", "text", "unsigned")
    raw_append(url, {"id": "0123456789ab", "from": "w2", "to": "w1", "type": "text",
                     "content": "past the gate", "metadata": {}})  # fmt: skip
    bad = lead.send("w2", "text", "x").to_dict()
    raw_append(url, {**bad, "id": "f00000000003", "to": "w1", "content": "forged"})
    lead.send("w1", "text", "signed")
    w1 = bus(url, "w1")
    assert [(m.content, m.verified) for m in w1.poll()] == [("signed", True)]
    reasons = [d["reason"] for d in w1.store.dead_letters("w1")]
    assert len(reasons) == 2 and "no signature" in reasons[0] and "bad signature" in reasons[1]
    w1.close()
    assert bus(url, "w1").poll() == []
    assert len(bus(url, "w1").store.dead_letters("w1")) == 2  # set aside once, not again


def test_a_replayed_envelope_keeps_its_id(url: str) -> None:
    """An old signed envelope written again into the same inbox still verifies (the
    signature says who wrote it, not when nor how often) and carries its first id: NATS
    stores it once within the stream's duplicate window; elsewhere the reader gets the
    same id twice and a receiver that remembers ids handles it once."""
    sent = bus(url, "lead").send("w1", "text", "deploy")
    raw_append(url, sent.to_dict())
    got = bus(url, "w1").poll()
    assert {(m.id, m.verified) for m in got} == {(sent.id, True)}
    assert len(got) == (1 if url.startswith("nats") else 2)
