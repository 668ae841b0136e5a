"""JSON in and out, in orjson's exact bytes, without orjson's import on a short run.

orjson is the fastest codec per call, but importing it costs a command line about
15 ms (it loads dataclasses, json, uuid, datetime and platform), more than a one-message
``ralph-mail send`` spends on everything else. So a process starts on the standard
`json` module, which writes the very bytes orjson writes for the values the library
stores (strings, bools, None, 64-bit ints, floats without an exponent, lists and
string-keyed dicts) and reads what orjson reads; anything else (a lone surrogate, a
NaN, a huge number, bytes that are not UTF-8) goes to orjson, so its value or its error
is orjson's own. After `BULK` calls, or as soon as orjson is already imported, `loads`,
`dumps` and `dumps_line` are orjson's functions themselves: a loop pays nothing.

Callers use the module's attributes (``codec.loads(raw)``), not names imported from it,
so they see the switch.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

#: Calls on the standard module before orjson pays for its import.
BULK = 256
#: orjson's decode error subclasses this one, so ``except DecodeError`` catches both.
DecodeError = json.JSONDecodeError

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # orjson's integer range
_DEPTH = 128  # deeper values go to orjson, whose limits then apply
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_INDENTED = json.JSONEncoder(ensure_ascii=False, indent=2)
_calls = 0
_orjson: ModuleType | None = None


class _Defer(Exception):
    """A value the standard module would read differently from orjson."""


def fast() -> ModuleType:
    """orjson, imported now, with `loads`, `dumps` and `dumps_line` switched to it."""
    global _orjson, loads, dumps, dumps_line
    if _orjson is None:
        orjson = _import_orjson()
        _orjson = orjson
        loads = orjson.loads
        dumps = orjson.dumps
        dumps_line = partial(orjson.dumps, option=orjson.OPT_APPEND_NEWLINE)
    return _orjson


def _import_orjson() -> ModuleType:
    """``import orjson`` with Ctrl-C held until it is done, then delivered: a
    KeyboardInterrupt raised inside orjson 3.13's import crashes the interpreter
    (SIGSEGV), and a process may come here at any moment of its run (its `BULK`-th call).
    Held only on the main thread, where Python raises KeyboardInterrupt."""
    import signal

    held: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    except ValueError:  # not the main thread: the interrupt is not raised here
        import orjson

        return orjson
    try:
        import orjson
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        if held:
            signal.raise_signal(signal.SIGINT)  # now, to the handler there was before
    return orjson


def _count() -> ModuleType | None:
    global _calls
    _calls += 1
    return fast() if _calls > BULK else _orjson


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether the standard module writes ``value`` exactly as orjson does."""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return bool(_INT_MIN <= value <= _INT_MAX)
    if kind is float:
        text = repr(value)  # orjson writes 1e-05 as 0.00001, and NaN as null
        return "e" not in text and "n" not in text
    if depth > _DEPTH:
        return False
    if kind is dict:
        return all(type(key) is str and _plain(item, depth + 1) for key, item in value.items())
    if kind is list or kind is tuple:
        return all(_plain(item, depth + 1) for item in value)
    return False


def _write(value: Any, newline: bool, indent: bool) -> bytes:
    module = _count()
    if module is None and _plain(value):
        try:
            text = (_INDENTED if indent else _COMPACT).encode(value)
            return (text + "\n" if newline else text).encode()
        except (UnicodeEncodeError, RecursionError, ValueError):
            pass  # a lone surrogate: orjson refuses it with its own error
    module = fast()
    option = (module.OPT_APPEND_NEWLINE if newline else 0) | (module.OPT_INDENT_2 if indent else 0)
    written: bytes = module.dumps(value, option=option)
    return written


def _dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON (orjson's `dumps`)."""
    return _write(value, False, False)


def _dumps_line(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON and a newline (one JSONL line)."""
    return _write(value, True, False)


def dumps_indented(value: Any, newline: bool = False) -> bytes:
    """``value`` as JSON indented by two spaces (orjson's ``OPT_INDENT_2``)."""
    return _write(value, newline, True)


def _int(text: str) -> int:
    number = int(text)
    if not _INT_MIN <= number <= _INT_MAX:
        raise _Defer  # orjson reads it as a float
    return number


def _float(text: str) -> float:
    number = float(text)
    if number - number != 0.0:
        raise _Defer  # orjson refuses a number that overflows to infinity
    return number


def _refuse(text: str) -> Any:
    raise _Defer  # NaN and Infinity are not JSON: orjson refuses them


#: Made once: `json.loads` with hooks builds a decoder and its scanner at every call.
_DECODER = json.JSONDecoder(parse_int=_int, parse_float=_float, parse_constant=_refuse)


def _loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The value in ``data`` (orjson's `loads`); raises `DecodeError`."""
    module = _count()
    if module is None:
        try:
            # Strict UTF-8 both ways: the standard module would pass surrogates through.
            text = data if isinstance(data, str) else bytes(data).decode()
            if isinstance(data, str):
                data.encode()
            if "\\ud" not in text and "\\uD" not in text:  # escaped surrogates: orjson's
                return _DECODER.decode(text)
        except (ValueError, _Defer, RecursionError):
            pass  # orjson reads it, or says why not
        module = fast()
    return module.loads(data)


loads: Callable[[bytes | bytearray | memoryview | str], Any] = _loads
dumps: Callable[[Any], bytes] = _dumps
dumps_line: Callable[[Any], bytes] = _dumps_line

if "orjson" in sys.modules:  # already paid for: use it from the first call
    fast()
