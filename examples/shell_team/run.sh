#!/usr/bin/env bash
# A team of three bash workers (worker.sh) and a Python lead (../lead.py), in a
# temporary mailbox home that is removed at the end. Needs `ralph-mail` and a `python3`
# that has ralph_mail on the PATH, e.g. after `. .venv/bin/activate`:
#
#   bash examples/shell_team/run.sh
#
# Exits with the lead's code: 0 when every task was done and every worker shut down.
set -euo pipefail
set -m # each background job in a process group of its own, so it is stopped whole
here=$(cd "$(dirname "$0")" && pwd)
RALPH_HOME=$(mktemp -d "${TMPDIR:-/tmp}/ralph-shell-team.XXXXXX")
RALPH_TEAM=shell-team
export RALPH_HOME RALPH_TEAM
unset RALPH_AGENT
groups=()

cleanup() {
  # Only after a failure or Ctrl-C is anything still running: stop it, then drop the mail.
  for group in "${groups[@]}"; do kill -- "-$group" 2>/dev/null || true; done
  rm -rf "$RALPH_HOME"
}
trap cleanup EXIT

ralph-mail team create "$RALPH_TEAM" --member lead --member 'worker-1:parses logs' \
  --member 'worker-2:writes reports' --member 'worker-3:checks numbers' >/dev/null

python3 "$here/../lead.py" &
lead=$!
groups+=("$lead")
workers=()
for name in worker-1 worker-2 worker-3; do
  RALPH_AGENT=$name bash "$here/worker.sh" &
  workers+=("$!")
  groups+=("$!")
done

status=0
wait "$lead" || status=$?
if [ "$status" -eq 0 ]; then # every worker accepted the shutdown: they are exiting
  for worker in "${workers[@]}"; do wait "$worker" || status=1; done
fi
exit "$status"
