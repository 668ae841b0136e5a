"""A small scripted "model" that stands in for an LLM CLI behind `ralph-mail run`.

It reads what `run` gives a command on stdin (the conversation, then the request headed
``[Agent Request from X | Pattern: ask]``) and answers by role, deterministically, the
way a model with tools would: the analyst asks the data agent before it answers (a
nested ask: it counts toward the team's depth limit through ``RALPH_CHAIN``), the data
agent answers from its "database", the writer drafts from the task it was given.

    ralph-mail run --agent analyst -- python examples/llm_team/model.py
"""

from __future__ import annotations

import os
import subprocess
import sys


def request_of(stdin: str) -> str:
    """The request: what follows the last ``[Agent Request ...]`` header (and context)."""
    body = stdin.rsplit("[Agent Request", 1)[-1].split("\n", 1)[1]
    paragraphs = [p for p in body.strip().split("\n\n") if not p.startswith("Context:")]
    return "\n\n".join(paragraphs).strip()


def main() -> int:
    agent = os.environ["RALPH_AGENT"]
    request = request_of(sys.stdin.read())
    if agent == "data":
        print("revenue Q4: 2.4M (Q3: 2.1M)")
    elif agent == "analyst":  # a tool call: ask the data agent, then answer from it
        found = subprocess.run(
            ["ralph-mail", "ask", "data", f"numbers for: {request}", "--timeout", "30"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        print(f"Q4 revenue grew 14% to 2.4M ({found}; chain {os.environ['RALPH_CHAIN']})")
    elif agent == "writer":
        print(f"Draft saved: '{request}' in 3 paragraphs")
    else:
        print(f"{agent} has no script for: {request}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
