"""The JSON codec: the standard module's bytes are orjson's, for every valid message
and record, and orjson decides (value or error) whatever the standard module would
read or write differently."""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from ralph_mail import InvalidMessage, Message, MessageType, codec
from ralph_mail.message import decode_lines, encode, encode_parts, from_envelope

#: Characters a message may carry that JSON writers treat specially, or might.
EDGES = (
    [chr(c) for c in range(0x20)]
    + ['"', "\\", "/", "\x7f", "\x80", "\xa0", "\xe9", "\u2028", "\u2029", "\ufeff", "\uffff"]
    + ["\U0001f600", "\U00010000", "\U0010ffff", "日本", "\u0301", "<", ">", "&", "'"]
)


@pytest.fixture
def standard(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The codec as a fresh process has it (the standard module, no orjson yet); the
    list it returns names each time the codec fell back to orjson."""
    fell_back: list[str] = []

    def fast() -> Any:
        fell_back.append("orjson")
        return orjson

    monkeypatch.setattr(codec, "_orjson", None)
    monkeypatch.setattr(codec, "_calls", 0)
    monkeypatch.setattr(codec, "BULK", 1 << 30)
    monkeypatch.setattr(codec, "fast", fast)
    monkeypatch.setattr(codec, "loads", codec._loads)
    monkeypatch.setattr(codec, "dumps", codec._dumps)
    monkeypatch.setattr(codec, "dumps_line", codec._dumps_line)
    return fell_back


def text(rng: random.Random) -> str:
    """A string of up to 40 characters: edge characters, ASCII, and any valid code point."""
    out = []
    for _ in range(rng.randrange(41)):
        pick = rng.random()
        if pick < 0.4:
            out.append(rng.choice(EDGES))
        elif pick < 0.7:
            out.append(chr(rng.randrange(0x20, 0x7F)))
        else:
            point = rng.randrange(0x110000)
            out.append(chr(point if not 0xD800 <= point < 0xE000 else point + 0x800))
    return "".join(out)


def messages(count: int, seed: int = 21) -> Iterator[Message]:
    """``count`` valid messages with random text, metadata and optional keys."""
    rng = random.Random(seed)
    for index in range(count):
        envelope: dict[str, Any] = {
            "id": f"{index:012x}",
            "from": "w1",
            "to": rng.choice(["lead", "*"]),
            "type": rng.choice([*MessageType, "blocker"]),
            "content": text(rng),
            "metadata": {text(rng): text(rng) for _ in range(rng.randrange(4))},
            "ts": "2026-01-01T00:00:00.000000Z",
        }
        if rng.random() < 0.3:
            envelope["thread"] = f"{rng.randrange(1 << 48):012x}"
        if rng.random() < 0.3:
            envelope["priority"] = rng.choice(["low", "high", "urgent"])
        if rng.random() < 0.3:
            envelope["ack"] = True
        if rng.random() < 0.3:
            envelope["visibility"] = rng.choice(["user_visible", "user_redacted"])
        if rng.random() < 0.3:
            envelope["chain"] = ["w1", "w2"][: rng.randrange(1, 3)]
        if rng.random() < 0.5:
            envelope["reply_to"] = f"{rng.randrange(1 << 48):012x}"
        yield from_envelope(envelope)


def test_every_valid_message_encodes_and_decodes_as_orjson_does(standard: list[str]) -> None:
    """Over many generated messages: the wire line is orjson's byte for byte, and the
    line reads back to the same message, without orjson."""
    for message in messages(3000):
        wanted = orjson.dumps(message.to_dict(), option=orjson.OPT_APPEND_NEWLINE)
        assert encode(message) == wanted
        head, tail = encode_parts(message.to_dict(), 1 << 20)
        assert head + message.ts.encode() + tail == wanted
        assert codec.loads(wanted) == orjson.loads(wanted)
        [back], clean = decode_lines([wanted])
        assert clean and isinstance(back, Message) and back.__dict__ == message.__dict__
    assert standard == []


@pytest.mark.parametrize("char", EDGES)
def test_each_edge_character_alone(standard: list[str], char: str) -> None:
    """Controls, DEL, U+2028/2029, quotes, backslashes, non-BMP: as orjson writes them."""
    record = {"content": char * 3, char: [char]}
    assert codec.dumps(record) == orjson.dumps(record)
    assert codec.loads(orjson.dumps(record)) == record
    assert standard == []


@pytest.mark.parametrize("bad", ["\ud800", "a\udfffb", "\udc80"])
def test_a_lone_surrogate_is_refused_with_orjsons_error(standard: list[str], bad: str) -> None:
    """orjson refuses a lone surrogate; the codec hands it the value, so the error is its."""
    with pytest.raises(TypeError) as mine:
        codec.dumps_line({"content": bad})
    with pytest.raises(TypeError) as theirs:
        orjson.dumps({"content": bad})
    assert str(mine.value) == str(theirs.value)
    with pytest.raises(InvalidMessage, match="cannot be encoded"):
        encode(Message("0123456789ab", "w1", "lead", "text", bad))


RECORDS: list[Any] = [
    {"state": "idle", "until": None, "last_seen": 1_767_000_000.123456},
    {"agent": "w1", "offset": 2**63, "n": -(2**63), "big": 2**64 - 1},
    [0.1, 1.5, -0.0, 1e15, 1e-4, 123.0],
    [1e16, 1e-5, 1e300, 5e-324],  # exponent forms differ: orjson writes these
    [math.nan, math.inf, -math.inf],  # orjson writes null
    {"too big": 2**64},  # orjson refuses
    {1: "a non-string key"},  # orjson refuses
    ("a", "tuple"),
    {"members": ["lead", "w1"], "nested": {"deep": [[[]]], "empty": {}}},
]


@pytest.mark.parametrize("record", RECORDS, ids=repr)
def test_records_are_written_as_orjson_writes_them(standard: list[str], record: Any) -> None:
    """Numbers, nesting and indentation match orjson, or orjson writes (or refuses) them."""
    for mine, theirs in (
        (codec.dumps, orjson.dumps),
        (codec.dumps_line, lambda v: orjson.dumps(v, option=orjson.OPT_APPEND_NEWLINE)),
        (codec.dumps_indented, lambda v: orjson.dumps(v, option=orjson.OPT_INDENT_2)),
    ):
        assert outcome(mine, record) == outcome(theirs, record)


LINES = [
    b'{"a":1,"a":2}',
    b'"\\ud800"',
    b'"\\udc00\\ud800"',
    b'"\\ud83d\\ude00"',
    b'"\\uD83D\\uDE00"',
    b"1e400",
    b"[NaN]",
    b"[Infinity, -Infinity]",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"[18446744073709551615, -9223372036854775808, 0.1, 1E2, -0]",
    b"\xef\xbb\xbf{}",
    b'"\xed\xa0\x80"',
    b'"\xff"',
    b'"\x01"',
    b'"\x7f \xe2\x80\xa8"',
    b"[" * 2000 + b"]" * 2000,
    b'{"id":"0123456789ab"',
    b"",
    b" {} \n",
    b'{"a":"b"} x',
    b"nul",
    '"caf\u00e9"',
    '"\ud800"',
]


@pytest.mark.parametrize("line", LINES, ids=repr)
def test_lines_are_read_as_orjson_reads_them(standard: list[str], line: bytes | str) -> None:
    """What orjson refuses is refused with its message; what it reads, the same value."""
    mine, theirs = outcome(codec.loads, line), outcome(orjson.loads, line)
    assert mine == theirs


def test_a_bad_message_line_gets_orjsons_reason(standard: list[str]) -> None:
    """A broken line is set aside with the reason orjson gives."""
    line = b'{"id":"0123456789ab","from":NaN}'
    [reason], clean = decode_lines([line])
    assert not clean and str(reason).startswith("not valid JSON: unexpected character")


def test_many_calls_switch_to_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    """After BULK calls, and for a read of many lines, the functions are orjson's own."""
    monkeypatch.setattr(codec, "_orjson", None)
    monkeypatch.setattr(codec, "_calls", 0)
    monkeypatch.setattr(codec, "BULK", 3)
    monkeypatch.setattr(codec, "loads", codec._loads)
    monkeypatch.setattr(codec, "dumps", codec._dumps)
    monkeypatch.setattr(codec, "dumps_line", codec._dumps_line)
    for _ in range(3):
        codec.dumps_line({"a": "b"})
    assert codec.loads is codec._loads
    assert codec.loads(b"{}") == {}
    assert codec.loads is orjson.loads and codec.dumps is orjson.dumps
    assert codec.dumps_line({"a": "b"}) == b'{"a":"b"}\n'


def outcome(function: Callable[[Any], Any], value: Any) -> tuple[str, Any]:
    """``("ok", result)`` or ``("error", message)`` for ``function(value)``."""
    try:
        return "ok", function(value)
    except (TypeError, ValueError) as exc:
        return "error", str(exc)


def value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON-like value: nested objects and arrays of strings, integers at and
    past orjson's bounds, floats of any bit pattern, booleans and None."""
    pick = rng.random()
    if depth < 4 and pick < 0.25:
        return {text(rng): value(rng, depth + 1) for _ in range(rng.randrange(5))}
    if depth < 4 and pick < 0.4:
        return [value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if pick < 0.6:
        return text(rng)
    if pick < 0.75:
        return rng.choice([0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1,
                           rng.randrange(-(2**70), 2**70)])  # fmt: skip
    if pick < 0.9:
        bits = rng.getrandbits(64)
        return struct.unpack("<d", bits.to_bytes(8, "little"))[0] if pick < 0.8 else bits / 7
    return rng.choice([True, False, None])


def test_random_values_are_written_and_read_as_orjson_does(standard: list[str]) -> None:
    """Over many generated values (NaN, huge integers and non-string keys among them):
    compact, line and indented bytes, or the refusal, are orjson's; what orjson wrote
    reads back as orjson reads it."""
    rng = random.Random(4)
    for _ in range(3000):
        record = value(rng)
        if rng.random() < 0.1:
            record = {1: record}  # a key orjson refuses
        for mine, theirs in (
            (codec.dumps, orjson.dumps),
            (codec.dumps_line, lambda v: orjson.dumps(v, option=orjson.OPT_APPEND_NEWLINE)),
            (codec.dumps_indented, lambda v: orjson.dumps(v, option=orjson.OPT_INDENT_2)),
        ):
            assert outcome(mine, record) == outcome(theirs, record), record
        kind, written = outcome(orjson.dumps, record)
        if kind == "ok":
            assert outcome(codec.loads, written) == outcome(orjson.loads, written)


def test_ctrl_c_during_orjsons_import_waits_for_the_import() -> None:
    """A Ctrl-C that lands while the codec imports orjson is held until the import is
    done, then raised: a KeyboardInterrupt inside orjson 3.13's import crashes Python
    (SIGSEGV), and a process may switch to orjson at any time. Each run is interrupted
    at a random moment around the import; none may crash, and orjson works after."""
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import sys; from ralph_mail import codec; print('ready', flush=True)\n"
        "try:\n    codec.fast()\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', 'orjson' in sys.modules, flush=True)\n"
        "    import orjson; print(orjson.dumps(1).decode(), flush=True)\n"
        "else:\n    sys.stdout.write('done\\n'); sys.stdout.flush()\n"  # (print writes twice)
    )
    rng = random.Random(8)
    seen = []
    for _ in range(24):  # the import takes 5-20 ms: most interrupts land inside it
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)  # fmt: skip
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0, 0.015))  # the moment of the Ctrl-C, not a wait
            child.send_signal(signal.SIGINT)
            out, err = child.communicate(timeout=60)
        finally:
            child.kill()  # our own child, already ended unless a check above failed
            child.wait()
        assert child.returncode in (0, -signal.SIGINT), (child.returncode, err[-500:])
        assert out in (b"", b"done\n", b"interrupted False\n1\n", b"interrupted True\n1\n")
        seen.append(out)
    assert b"interrupted True\n1\n" in seen  # some were held through the import
