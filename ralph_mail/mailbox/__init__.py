"""The core (DESIGN §7, layer 5): `Mailbox` writes through the Gate (`box`), and reads and
waits as its inbox's owner (`consuming`)."""

from __future__ import annotations

from ralph_mail.mailbox.box import ALL, THREAD_STARTERS, Judge, Mailbox, pair_key

__all__ = ["ALL", "THREAD_STARTERS", "Judge", "Mailbox", "pair_key"]
