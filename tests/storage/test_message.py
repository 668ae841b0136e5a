"""The message envelope: wire format, names, ids, timestamps, validation."""

from __future__ import annotations

import re

import orjson
import pytest

from ralph_mail import InvalidMessage, InvalidName, Message, MessageType, codec
from ralph_mail.message import check_name, decode, decode_lines, encode, format_ts, new_id

WIRE_KEYS = ["id", "from", "to", "type", "content", "metadata", "ts"]


def sample(**changes: object) -> Message:
    fields: dict[str, object] = dict(
        id="0123456789ab",
        from_agent="w1",
        to_agent="lead",
        type=MessageType.TEXT,
        content="hi",
        metadata={},
        ts="2026-01-01T00:00:00.000000Z",
    )
    fields.update(changes)
    return Message(**fields)  # type: ignore[arg-type]


def test_encode_is_one_json_line_with_wire_keys_in_order() -> None:
    """A message encodes to one UTF-8 JSON line with the wire keys in contract order."""
    line = encode(sample())
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert list(orjson.loads(line)) == WIRE_KEYS


def test_reply_to_is_on_the_wire_only_when_set() -> None:
    """reply_to is written after ts when present and omitted when None."""
    assert list(orjson.loads(encode(sample(reply_to="abcdefabcdef")))) == [*WIRE_KEYS, "reply_to"]


def test_decode_round_trips_and_ignores_unknown_keys() -> None:
    """decode(encode(m)) == m, and keys a newer writer added are ignored."""
    message = sample(metadata={"state": "working"}, reply_to="abcdefabcdef")
    assert decode(encode(message)) == message
    envelope = orjson.loads(encode(message))
    envelope["mood"] = "high"
    assert decode(orjson.dumps(envelope)) == message


def test_message_type_is_a_str_enum() -> None:
    """MessageType members compare equal to their wire names."""
    assert decode(encode(sample())).type == "text"
    assert MessageType.STATUS_UPDATE == "status_update"


def test_new_id_is_twelve_lowercase_hex() -> None:
    """Ids are 12 lowercase hex characters and differ."""
    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{12}", i) for i in ids)


def test_timestamp_format_is_utc_microseconds_z() -> None:
    """Timestamps are UTC ISO-8601 with microseconds and a Z."""
    assert format_ts(0) == "1970-01-01T00:00:00.000000Z"
    assert format_ts(1_700_000_000_000_001) == "2023-11-14T22:13:20.000001Z"


_LINE = (
    b'{"id":"0123456789ab","from":"w1","to":"lead","type":"request","content":"hi",'
    b'"metadata":{},"ts":"2026-01-01T00:00:00.000000Z"'
)


@pytest.mark.parametrize(
    "extra",
    [
        b"",
        b',"chain":["a","b"]',
        b',"thread":"0123456789ac","reply_to":"0123456789ac"',
        b',"priority":"high","ack":true,"visibility":"user_visible"',
        b',"from a newer writer":1',
        b',"priority":"nope"',
        b',"chain":"x"',
    ],
)
def test_decode_lines_reads_a_line_once_as_decode_does(
    extra: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A well-formed line with optional keys (a request's chain, a reply's thread) is
    parsed once by a bulk read, into what `decode` makes of it; a bad one gets
    `decode`'s reason."""
    line = _LINE + extra + b"}"
    try:
        wanted: object = decode(line).__dict__
    except InvalidMessage as exc:
        wanted = str(exc)
    parsed = []
    loads = codec.loads
    monkeypatch.setattr(codec, "loads", lambda raw: parsed.append(raw) or loads(raw))
    [got], clean = decode_lines([line])
    assert (got if isinstance(got, str) else got.__dict__) == wanted
    assert clean is not isinstance(wanted, str)
    if clean and b"newer" not in extra:
        assert parsed == [line]


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"id":"0123456789ab"}', "missing"),
        (b'{"id":"a","from":"b","to":"c","type":"No pe","content":"","ts":""}', "No pe"),
        (b'{"id":"a","from":"b","to":"c","type":"text","content":5,"ts":""}', "wrong JSON type"),
        (
            b'{"id":"a","from":"b","to":"c","type":"text","content":"","ts":"","metadata":{"k":1}}',
            "metadata",
        ),
    ],
)
def test_decode_refuses_invalid_lines_with_a_reason(line: bytes, reason: str) -> None:
    """A line that is not a valid message is refused, saying why."""
    with pytest.raises(InvalidMessage, match=reason):
        decode(line)
    messages, clean = decode_lines([line])
    assert not clean and reason in str(messages[0])


@pytest.mark.parametrize(
    "name",
    [
        "",
        "-x",
        ".x",
        "a/b",
        "../x",
        "a b",
        "x\n",
        "a" * 65,
        "*",
        "x.lock",
        "x.json",
        "x.jsonl",
        "é",
        "a\x00b",
        None,
        5,
    ],
)
def test_bad_names_are_refused(name: object) -> None:
    """Names outside ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ or with a reserved suffix are refused."""
    with pytest.raises(InvalidName):
        check_name(name)


@pytest.mark.parametrize("name", ["a", "worker-1", "A.b_c-9", "x" * 64, "x.lockfile"])
def test_good_names_are_accepted(name: str) -> None:
    """Names matching the rule are accepted as they are."""
    assert check_name(name) == name


WAVE_ONE = (
    b'{"id":"0123456789ab","from":"w1","to":"lead","type":"text","content":"hi",'
    b'"metadata":{},"ts":"2026-01-01T00:00:00.000000Z","reply_to":"abcdefabcdef"}\n'
)


def test_a_first_release_line_re_encodes_byte_for_byte() -> None:
    """A line without the newer keys decodes to their defaults and encodes unchanged."""
    message = decode(WAVE_ONE)
    assert (message.thread, message.priority, message.ack) == ("0123456789ab", "normal", False)
    assert (message.visibility, tuple(message.chain)) == ("internal", ())
    assert encode(message) == WAVE_ONE


def test_the_newer_keys_round_trip_between_metadata_and_ts() -> None:
    """thread, priority, ack, visibility and chain survive a round trip, before ts."""
    envelope = orjson.loads(WAVE_ONE)
    extra = {"thread": "ffffffffffff", "priority": "urgent", "ack": True,
             "visibility": "user_visible", "chain": ["a", "b"]}  # fmt: skip
    line = orjson.dumps({**{k: envelope[k] for k in list(envelope)[:6]}, **extra,
                         "ts": envelope["ts"], "reply_to": envelope["reply_to"]})  # fmt: skip
    message = decode(line)
    assert (message.thread, message.priority, message.ack) == ("ffffffffffff", "urgent", True)
    assert (message.visibility, tuple(message.chain)) == ("user_visible", ("a", "b"))
    assert encode(message) == line + b"\n"


@pytest.mark.parametrize(
    "key, value",
    [("thread", "x"), ("priority", "asap"), ("ack", "yes"), ("visibility", "public"),
     ("chain", "a,b"), ("chain", [1])],
)  # fmt: skip
def test_a_bad_value_for_a_newer_key_is_refused_with_a_reason(key: str, value: object) -> None:
    """A newer key with a value outside its domain makes the line invalid, naming the key."""
    envelope = orjson.loads(WAVE_ONE)
    envelope[key] = value
    with pytest.raises(InvalidMessage, match=key):
        decode(orjson.dumps(envelope))


def test_a_type_beyond_the_enum_is_carried_as_a_string() -> None:
    """Any lowercase type name decodes, as a plain str; a name with other characters does not."""
    envelope = orjson.loads(WAVE_ONE)
    envelope["type"] = "intent_brief"
    message = decode(orjson.dumps(envelope))
    assert message.type == "intent_brief" and type(message.type) is str
    envelope["type"] = "Intent Brief"
    with pytest.raises(InvalidMessage):
        decode(orjson.dumps(envelope))
