#!/usr/bin/env bash
# A team whose members are commands behind `ralph-mail run`: here a small scripted
# "model" (model.py), in real life `claude -p`, `llm` or any script. The coordinator
# asks the analyst, which asks the data agent before it answers (a nested ask, depth
# 2), then delegates a draft to the writer and gets the result back; last, a standup
# post in a channel mentions three of them, who answer in turn, each after the one
# before. Runs in a temporary mailbox home that is removed at the end:
#
#   bash examples/llm_team/run.sh
set -euo pipefail
set -m # each runner in a process group of its own, so it is stopped whole
here=$(cd "$(dirname "$0")" && pwd)
RALPH_HOME=$(mktemp -d "${TMPDIR:-/tmp}/ralph-llm-team.XXXXXX")
RALPH_TEAM=llm
export RALPH_HOME RALPH_TEAM
runners=()
cleanup() {
  for runner in "${runners[@]}"; do kill -TERM -- "-$runner" 2>/dev/null || true; done
  wait || true
  rm -rf "$RALPH_HOME"
}
trap cleanup EXIT

ralph-mail team create llm --member coordinator --member 'analyst:explains the numbers' \
  --member 'data:knows the numbers' --member 'writer:drafts posts' >/dev/null

for agent in analyst data writer; do
  ralph-mail run --agent "$agent" -- python3 "$here/model.py" 2>"$RALPH_HOME/$agent.log" &
  runners+=("$!")
done
for agent in analyst data writer; do # each says on stderr once it is online (30 s at most)
  for _ in $(seq 600); do grep -q 'answers with' "$RALPH_HOME/$agent.log" && break; sleep 0.05; done
  head -n 1 "$RALPH_HOME/$agent.log"
done

export RALPH_AGENT=coordinator
echo "analyst says: $(ralph-mail ask analyst 'How did Q4 revenue go?' --context 'board deck' --timeout 60)"
echo "writer says: $(ralph-mail delegate writer 'Draft the Q4 update' --id T-1 --wait 60)"
ralph-mail tasks

ralph-mail channel create standup --all >/dev/null
ralph-mail channel post standup 'Standup: @writer @analyst @data what are you on?' >/dev/null
for _ in $(seq 1200); do # three answers, one after another (60 s at most)
  [ "$(ralph-mail channel history standup --json | grep -c '"reply_to"')" -ge 3 ] && break
  sleep 0.05
done
ralph-mail channel history standup
