"""Benchmarks: ralph_mail against the physical limit and the alternatives, side by side.

Run ``python -m bench`` (add ``--quick`` for a one-minute run, ``--json FILE`` for
machine-readable results). Every figure is taken in the same run as the anchors it
is compared with, because the machines this runs on are shared and noisy: a ratio
taken at the same moment means more than an absolute number from another day.

This package imports nothing at import time on purpose: ``python -m bench.child``
runs worker processes, and a heavy ``__init__`` would add to every one of them.
"""
