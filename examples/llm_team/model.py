"""A small scripted "model" that stands in for an LLM CLI behind `ralph-mail run`.

It reads what `run` gives a command on stdin (the conversation, then the request headed
``[Agent Request from X | Pattern: ask]``) and answers by role, deterministically, the
way a model with tools would: the analyst asks the data agent before it answers (a
nested ask: it counts toward the team's depth limit through ``RALPH_CHAIN``), the data
agent answers from its "database", the writer drafts from the task it was given. At a
standup (a channel post that mentions it) each says what it is on, and whom it heard
answer before it.

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


#: What each says at a standup (a channel post that mentions it).
STANDUP = {
    "writer": "drafting the Q4 update",
    "analyst": "checking the Q4 numbers",
    "data": "idle: ask me for numbers",
}


def main() -> int:
    agent = os.environ["RALPH_AGENT"]
    stdin = sys.stdin.read()
    request = request_of(stdin)
    if os.environ.get("RALPH_PATTERN") == "mention":  # in turn: earlier answers are above
        said = [line.split("] ", 1)[0].rsplit("[", 1)[-1] for line in stdin.splitlines()
                if line[:1].isdigit() and "] " in line]  # fmt: skip
        after = [name for name in said if name != os.environ["RALPH_FROM"]]
        print(f"{STANDUP.get(agent, 'here')} (after: {', '.join(after) or 'no one'})")
    elif agent == "data":
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
