"""The message envelope: wire format, names, ids, timestamps, validation."""

from __future__ import annotations

import re

import orjson
import pytest

from ralph_mail import InvalidMessage, InvalidName, Message, MessageType
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
    envelope["priority"] = "high"
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


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"id":"0123456789ab"}', "missing"),
        (b'{"id":"a","from":"b","to":"c","type":"nope","content":"","ts":""}', "nope"),
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
