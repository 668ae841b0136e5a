"""The lead's plan review policies: `approve_all` (``auto``), `reject_all` (``reject``)
and `command_reviewer` (``cmd:COMMAND``, a shell command decides)."""

from __future__ import annotations

import os

from ralph_mail.children import communicate, end, spawn
from ralph_mail.orchestrator.records import Plan, PlanReviewer
from ralph_mail.settings import PLAN_REVIEW_TIMEOUT_S

#: The most of a review command's stdout (and stderr) kept for its feedback (bytes).
_REVIEW_OUTPUT_BYTES = 64 * 1024


def approve_all(plan: Plan) -> tuple[bool, str]:
    """The ``auto`` review policy: approve every plan.

    >>> approve_all(Plan("w1", "step 1", None, None))  # type: ignore[arg-type]
    (True, 'approved')
    """
    return True, "approved"


def reject_all(plan: Plan) -> tuple[bool, str]:
    """The ``reject`` review policy: reject every plan (to exercise an agent's revisions)."""
    return False, "rejected by policy: revise the plan and submit it again"


def command_reviewer(command: str, timeout: float = PLAN_REVIEW_TIMEOUT_S) -> PlanReviewer:
    """The ``cmd:COMMAND`` review policy: a shell command decides.

    The plan is the command's standard input; ``RALPH_PLAN_AGENT``, ``RALPH_PLAN_TASK``
    and ``RALPH_PLAN_ID`` are in its environment. Exit status 0 approves, anything else
    rejects; the feedback is its standard output (else its standard error). A command
    that cannot start, fails or runs longer than ``timeout`` seconds is a rejection whose
    feedback says why; a command that times out is killed with its whole process group.

    Example:
        >>> review = command_reviewer("grep -q test && echo 'looks good'")  # doctest: +SKIP
        >>> TeamOrchestrator("demo", review_plan=review)  # doctest: +SKIP
    """

    def review(plan: Plan) -> tuple[bool, str]:
        env = dict(os.environ)
        env.update(
            RALPH_PLAN_AGENT=plan.agent,
            RALPH_PLAN_TASK=plan.task or "",
            RALPH_PLAN_ID=plan.message.id,
        )
        try:
            # A session of its own, under a keeper: on a timeout, or once it exits, what
            # it started is killed (a pipeline, a daemon), and a Ctrl-C at the lead's
            # terminal is the lead's to handle.
            child = spawn(["/bin/sh", "-c", command], env)
        except OSError as exc:
            return False, f"plan review command could not start ({exc.strerror}): {command}"
        try:
            # What it printed by the time it exited: a job it left in the background,
            # holding the pipes, is not waited for.
            code, out, _, err = communicate(
                child, plan.text.encode(), timeout, _REVIEW_OUTPUT_BYTES, _REVIEW_OUTPUT_BYTES
            )
        finally:
            end(child)
        if code is None:
            return False, f"plan review command timed out after {timeout:g}s: {command}"
        feedback = out.decode(errors="replace").strip() or err.decode(errors="replace").strip()
        if code == 0:
            return True, feedback or "approved"
        return False, feedback or f"rejected by {command!r} (exit status {code})"

    return review
