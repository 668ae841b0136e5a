"""Agents' signing keys as governance: who may put a public key in the roster.

The private key is made on the agent's own host and never leaves it (`create`); its
public half goes into the roster, the team's shared truth, where every reader checks
signatures against it. A member's first key is published by the member itself or by
the lead (trust on first use: publish keys before turning ``require_signed`` on);
replacing or removing a published key is the lead's act (`Gate.require_lead`), so that
an agent that claims another's name cannot swap its key for one of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ralph_mail import signing
from ralph_mail.errors import MailError
from ralph_mail.store import keyfile
from ralph_mail.team import change_roster

if TYPE_CHECKING:
    from pathlib import Path

    from ralph_mail.mailbox import Mailbox


def _may_publish(box: Mailbox, agent: str, public: str | None) -> bool:
    """Whether ``public`` (None: no key) is to be written for ``agent``: False when the
    roster has it already; `PermissionDenied` when it is not my agent's to do."""
    current = box.refresh_team().member(agent).key
    if current == public:
        return False
    if current is not None:
        box.gate.require_lead(f"replacing or removing {agent}'s public key")
    elif agent != box.agent:
        box.gate.require_lead(f"publishing {agent}'s public key")
    return True


def create(box: Mailbox, *, force: bool = False) -> tuple[str, Path]:
    """Make a key pair for my agent: the private key in its key file (0600, written
    atomically; an existing one is kept unless ``force``), the public key in the roster.
    Return the key's kid and the file. Checks that the roster may take it first, so a
    refusal leaves the old key file in place."""
    path = keyfile.path(box.team.name, box.agent, box.team.home)
    if not force and keyfile.read(path) is not None:
        raise MailError(f"{box.agent} has a key already, at {path}: it was kept (--force "
                        "replaces it; messages it signed then fail verification)")  # fmt: skip
    pem, public = signing.generate()
    publish = _may_publish(box, box.agent, public)
    keyfile.write(path, pem, force=force)
    box._signer = None  # signs with the new key from the next message on
    if publish:
        change_roster(box.refresh_team(), member=box.agent, key=public)
    return signing.kid(public), path


def publish(box: Mailbox) -> str:
    """Put the public half of my agent's key file in the roster; return its kid."""
    public = box.signer().public()
    if public is None:
        raise MailError(f"{box.agent} has no key at {box.signer().path}: "
                        f"run 'ralph-mail keys create --agent {box.agent}'")  # fmt: skip
    if _may_publish(box, box.agent, public):
        change_roster(box.refresh_team(), member=box.agent, key=public)
    return signing.kid(public)


def forget(box: Mailbox, agent: str) -> None:
    """Remove ``agent``'s public key from the roster (the lead's act): its messages are
    unsigned again, or refused under ``require_signed``, until it publishes another."""
    box.gate.require_lead(f"removing {agent}'s public key")
    if box.refresh_team().member(agent).key is not None:
        change_roster(box.team, member=agent, key="")
