"""The NATS JetStream backend, for a team whose agents run on several hosts.

``backend`` holds `NatsBackend` and the team store; ``wire`` its round trips over a
blocking socket per thread; ``push`` what nats-py carries (the asyncio connection, the
feeds that wake waiters, the bucket's watch), imported only when first needed.
"""

from __future__ import annotations

from ralph_mail.store.nats.backend import NatsBackend

__all__ = ["NatsBackend"]
