#!/usr/bin/env bash
# A conversation in bash, with nothing but `ralph-mail`: an analyst answers questions
# and a writer takes tasks, each a shell loop in the background; the coordinator asks
# the analyst a question and delegates a draft to the writer, and gets both answers
# back. Runs in a temporary mailbox home that is removed at the end:
#
#   bash examples/conversation/run.sh
set -euo pipefail
set -m # each background job in a process group of its own, so it is stopped whole
RALPH_HOME=$(mktemp -d "${TMPDIR:-/tmp}/ralph-conversation.XXXXXX")
RALPH_TEAM=office
export RALPH_HOME RALPH_TEAM
groups=()
cleanup() {
  for group in "${groups[@]}"; do kill -- "-$group" 2>/dev/null || true; done
  rm -rf "$RALPH_HOME"
}
trap cleanup EXIT

ralph-mail team create office --member coordinator --member 'analyst:knows the numbers' \
  --member 'writer:drafts posts' >/dev/null

field() { # field NAME JSON: one field of a message envelope (or of its metadata)
  python3 -c 'import json, sys
m = json.loads(sys.argv[2])
print(m.get(sys.argv[1]) or m["metadata"][sys.argv[1]])' "$1" "$2"
}

analyst() { # answers one question, then stops
  export RALPH_AGENT=analyst
  request=$(ralph-mail wait --type request --timeout 60 --json)
  ralph-mail reply "$(field id "$request")" 'Q4 revenue was $2.4M' >/dev/null
}

writer() { # takes one task, then stops
  export RALPH_AGENT=writer
  assignment=$(ralph-mail wait --type task_assignment --timeout 60 --json)
  task=$(field taskId "$assignment")
  ralph-mail task start "$task"
  ralph-mail task done "$task" "Saved as 'Q4 Blog Post Draft'"
}

# Both say they are there before the coordinator turns to them: an ask or a delegation
# to an agent that is offline is refused (exit 4).
RALPH_AGENT=analyst ralph-mail presence idle
RALPH_AGENT=writer ralph-mail presence idle
analyst & groups+=("$!")
writer & groups+=("$!")
export RALPH_AGENT=coordinator
echo "analyst says: $(ralph-mail ask analyst 'What was Q4 revenue?' --context 'investor update' --timeout 30)"
echo "writer says: $(ralph-mail delegate writer 'Draft the Q4 blog post' --id T-100 --wait 30)"
ralph-mail tasks
wait
