"""The NATS JetStream backend, for a team whose agents run on several hosts.

``backend`` holds `NatsBackend`, which creates, lists, removes and checks teams
(``doctor``: what it checks of a team); the team store, `NatsStore`, is ``team`` (gc,
search, and how the whole fits together), built on ``commits`` (when cursors moved)
over ``logs`` (inboxes, channels, team logs, indexes: subjects of the team's stream),
``claims`` (the one consumer of an inbox and its cursor, fenced), ``bucket`` (the
key/value side: roster, presence, state, rates, inbox starts) and ``stream`` (the round
trips they all make, and the tunables); ``index`` is the team's search index, kept in
the home; ``waiter`` waits for a line; ``background`` makes index and commit-time
writes in order off the caller's thread; ``names`` names streams, subjects, keys and
index files. ``wire`` makes the round trips over a blocking socket per thread;
``push`` holds what nats-py carries (the asyncio connection, the bucket's watch),
imported only when first needed.
"""

from __future__ import annotations

from ralph_mail.store.nats.backend import NatsBackend

__all__ = ["NatsBackend"]
