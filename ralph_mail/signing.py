"""Signed senders: an agent's Ed25519 key, the bytes a signature covers, and checking one.

An agent with a key (``ralph-mail keys create``) signs every envelope it sends: its
`Mailbox` asks its `Signer` once the Gate passed the envelope and its id, thread and
everything else but the ts are final. The envelope then carries ``kid`` (which key) and
``sig`` (the signature), both strings.

The signed bytes, `canonical`: the envelope as a JSON object without ``sig`` and ``ts``
(the ts is the store's, taken under the inbox lock, not the sender's word; one broadcast
has one signature and a ts per inbox), keys sorted at every level, no whitespace, UTF-8
with non-ASCII characters as they are (the codec's compact bytes of the sorted object).
``sig`` is the 64-byte Ed25519 signature of those bytes in standard base64; ``kid`` the
first 16 hex digits of the SHA-256 of the raw 32-byte public key.

A reader checks each message against the public key the roster gives its ``from`` agent
(`verify`): `Message.verified` is True, False (bad signature, unknown or replaced key, a
signature from an agent with no key) or None (unsigned). The private key is read from
its file (`ralph_mail.store.keyfile`) by the process that signs, once, when it first
sends; ``cryptography`` (the ``sign`` extra) is imported only then, or when a reader
meets a signed message: a team without keys never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final

from ralph_mail import codec
from ralph_mail.errors import MailError
from ralph_mail.store import keyfile

if TYPE_CHECKING:
    from ralph_mail.message import Message
    from ralph_mail.team import Team

#: A roster key: this prefix, then the raw public key in base64.
PREFIX: Final = "ed25519:"
#: What a command that needs the extra says when it is not installed.
INSTALL: Final = "pip install 'ralph-mail[sign]'"
_UNSIGNED: Final = ("sig", "ts")  # not covered by the signature
_UNLOADED: Final = object()


def _ed25519() -> Any:
    """The ``cryptography`` Ed25519 module, or `MailError` saying how to install it."""
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise MailError(f"signing needs the cryptography package: {INSTALL}") from None
    return ed25519


def canonical(envelope: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: ``envelope`` without ``sig`` and ``ts``, keys sorted
    at every level, compact JSON.

    >>> canonical({"to": "b", "ts": "x", "from": "a", "metadata": {"z": "1", "a": "2"}})
    b'{"from":"a","metadata":{"a":"2","z":"1"},"to":"b"}'
    """
    return codec.dumps(_sorted({k: v for k, v in envelope.items() if k not in _UNSIGNED}))


def _sorted(value: Any) -> Any:
    kind = type(value)  # (type checks first: an envelope is mostly strings)
    if kind is str or kind is bool or kind is int or value is None:
        return value
    if kind is dict or isinstance(value, Mapping):
        return {key: _sorted(value[key]) for key in sorted(value)}
    if kind is list or kind is tuple:
        return [_sorted(item) for item in value]
    return value


def kid(public: str) -> str:
    """The short id of a roster key (``ed25519:...``): 16 hex digits of its SHA-256."""
    import hashlib  # (here: a send in a team without keys imports neither)

    return hashlib.sha256(_raw_public(public)).hexdigest()[:16]


def _raw_public(public: str) -> bytes:
    import base64

    if not public.startswith(PREFIX):
        raise MailError(f"invalid public key {public!r}: expected {PREFIX}BASE64")
    try:
        raw = base64.b64decode(public[len(PREFIX) :], validate=True)
    except ValueError:
        raise MailError(f"invalid public key {public!r}: not base64") from None
    if len(raw) != 32:
        raise MailError(f"invalid public key {public!r}: not 32 bytes")
    return raw


def generate() -> tuple[bytes, str]:
    """A new key pair: the private key as PEM (PKCS#8) and the public key as the roster
    keeps it."""
    ed25519 = _ed25519()  # (first: says how to install it)
    from cryptography.hazmat.primitives import serialization

    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())  # fmt: skip
    return pem, _public_of(key)


def _public_of(key: Any) -> str:
    import base64

    from cryptography.hazmat.primitives import serialization

    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)  # fmt: skip
    return PREFIX + base64.b64encode(raw).decode()


def load_private(pem: bytes, where: object) -> tuple[Any, str]:
    """The private key in ``pem`` (read from ``where``) and its roster public key."""
    _ed25519()
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise MailError(f"key file {where} is not an unencrypted Ed25519 key ({exc})") from None
    if not isinstance(key, _ed25519().Ed25519PrivateKey):
        raise MailError(f"key file {where} is not an Ed25519 key: make one with 'keys create'")
    return key, _public_of(key)


class Signer:
    """Signs what one agent sends, with the key in its key file (read once, on the first
    envelope, in this process: never handed to a child or put in an environment)."""

    def __init__(self, team: str, agent: str, home: str | os.PathLike[str] | None) -> None:
        self.path = keyfile.path(team, agent, home)
        self._key: Any = _UNLOADED
        self._public: str | None = None
        self._kid = ""

    def public(self) -> str | None:
        """My public key (``ed25519:...``), or None when my agent has no key file."""
        self._load()
        return self._public

    def _load(self) -> None:
        if self._key is not _UNLOADED:
            return
        pem = keyfile.read(self.path)
        if pem is None:
            self._key = None
            return
        self._key, self._public = load_private(pem, self.path)
        self._kid = kid(self._public)

    def sign(self, envelope: dict[str, Any]) -> bool:
        """Add ``kid`` and ``sig`` to ``envelope`` (its ts not yet taken); False when my
        agent has no key (the envelope is left unsigned)."""
        self._load()
        if self._key is None:
            return False
        import base64

        envelope.pop("sig", None)
        envelope["kid"] = self._kid
        envelope["sig"] = base64.b64encode(self._key.sign(canonical(envelope))).decode()
        return True


@lru_cache(maxsize=256)  # one entry a roster key: bounded by the rosters, not the mail
def _verifier(public: str) -> Any:
    return _ed25519().Ed25519PublicKey.from_public_bytes(_raw_public(public))


def check(envelope: Mapping[str, Any], public: str | None) -> bool:
    """Whether ``envelope``'s ``sig`` is its canonical bytes signed by ``public``'s key
    (and its ``kid`` names that key). `MailError` only when ``cryptography`` is missing:
    a reader that cannot check says so, it does not guess."""
    import base64

    _ed25519()
    sig = envelope.get("sig")
    try:
        if public is None or not isinstance(sig, str) or envelope.get("kid") != kid(public):
            return False
        _verifier(public).verify(base64.b64decode(sig, validate=True), canonical(envelope))
    except Exception:  # InvalidSignature, bad base64, a damaged roster key: all bad
        return False
    return True


def required(team: Team, sender: str) -> bool:
    """Whether a message from ``sender`` should be signed: it has a key in the roster."""
    return any(m.name == sender and m.key is not None for m in team.members)


def verify(messages: Iterable[Message], team: Team, *, require: bool = False) -> None:
    """Set `Message.verified` on each of ``messages`` against ``team``'s roster keys; an
    unsigned one from a sender with a key (or any, with ``require``) is marked as such
    for the human output (`ralph_mail.cli.render.seal`). Imports ``cryptography`` only
    for a signed message."""
    keys = {member.name: member.key for member in team.members}
    for message in messages:
        fields = message.__dict__
        if "sig" in fields:
            fields["verified"] = check(message.to_dict(), keys.get(message.from_agent))
        elif require or keys.get(message.from_agent) is not None:
            fields["unsigned"] = True


def seal(message: Message) -> str:
    """What human output says of ``message``'s signature, as `verify` found it:
    ``"BAD-SIGNATURE"`` always, ``"unsigned"`` when its sender has a key or the team
    requires signing, else ""."""
    if message.verified is False:
        return "BAD-SIGNATURE"
    return "unsigned" if message.__dict__.get("unsigned") else ""


class Marks:
    """The `seal` of each message a view shows again at every refresh (``top``, the
    serve page): a message is checked once (a verify costs about 0.1 ms), then its mark
    is remembered, for the last `KEPT` messages and while the roster's keys stay."""

    KEPT: Final = 4096

    def __init__(self) -> None:
        self._keys: tuple[tuple[str, str | None], ...] = ()
        self._known: dict[tuple[str, str, str], str] = {}

    def of(self, messages: list[Message], roster: Callable[[], Team], require: bool) -> list[str]:
        """The marks of ``messages`` (as `seal`), checked against ``roster()`` (asked again
        once when a signature does not verify: a key newer than the view's roster)."""
        team = roster()
        signs = require or any(member.key for member in team.members)
        if not signs and not any("sig" in m.__dict__ for m in messages):
            return [""] * len(messages)
        keys = tuple((member.name, member.key) for member in team.members)
        if keys != self._keys:
            self._keys, self._known = keys, {}
        seen = self._known
        fresh = [m for m in messages if _known_as(m) not in seen]
        if fresh:
            verify(fresh, team, require=require)
            if any(m.verified is False for m in fresh):
                verify(fresh, roster(), require=require)
            for message in fresh:
                seen[_known_as(message)] = seal(message)
            for old in list(seen)[: max(0, len(seen) - self.KEPT)]:
                del seen[old]
        return [seen[_known_as(m)] for m in messages]


def _known_as(message: Message) -> tuple[str, str, str]:
    return message.id, message.from_agent, str(message.__dict__.get("sig", ""))


def refusal(message: Message) -> str:
    """Why a reader under ``require_signed`` sets ``message`` aside, "" if it does not
    (call after `verify`)."""
    if message.verified is True:
        return ""
    said = "a bad signature" if message.verified is False else "no signature"
    return (
        f"message {message.id} from {message.from_agent} has {said} and the team "
        "requires signed messages (require_signed)"
    )
