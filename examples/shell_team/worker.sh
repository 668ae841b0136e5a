#!/usr/bin/env bash
# A teammate written in bash that talks to its team only through `ralph-mail`.
#
# It waits for mail; for a task it reports status, submits a plan (revised once if the
# lead rejects it), works in steps reporting progress, and reports done; it answers a
# shutdown request with "not yet" while working and accepts it when idle. Text from the
# team is kept as context for its next task. Identity comes from the environment:
# RALPH_HOME, RALPH_TEAM and RALPH_AGENT.
set -uo pipefail

context=""

# field KEY LINE: the string value of KEY in one message of `ralph-mail wait --json`.
# (The envelope is compact JSON with string values; with jq installed,
# `jq -r .metadata.taskId` does the same.)
field() {
  sed -nE "s/.*\"$1\":\"(([^\"\\\\]|\\\\.)*)\".*/\1/p" <<<"$2"
}

work_on() {
  local id=$1 what=$2 plan feedback rc step
  ralph-mail status "starting $id: $what" --state working --task "$id" --progress 0 >/dev/null
  plan="1. read the input 2. $what"
  feedback=$(ralph-mail plan submit "$plan" --task "$id" --wait 30)
  rc=$?
  if [ "$rc" -eq 3 ]; then # rejected: revise the plan with the lead's feedback
    ralph-mail status "revising the plan: $feedback" --task "$id" >/dev/null
    plan="$plan 3. test the result"
    feedback=$(ralph-mail plan submit "$plan" --task "$id" --wait 30)
    rc=$?
  fi
  if [ "$rc" -ne 0 ]; then
    ralph-mail status "no approved plan: $feedback" --state failed --task "$id" >/dev/null
    return
  fi
  for step in 1 2; do
    # A real agent works here (with "$context" in its prompt). Between steps it answers
    # a shutdown request with "not yet": the lead asks again once this one is done.
    if ralph-mail wait --type shutdown_request --timeout 0 >/dev/null; then
      ralph-mail shutdown respond --defer --reason "finishing current task $id" >/dev/null
    fi
    ralph-mail status "step $step of 2" --task "$id" --progress "0.$((step * 33))" >/dev/null
  done
  context=""
  ralph-mail status "$id finished" --state done --task "$id" --progress 1 >/dev/null
}

while true; do
  batch=$(ralph-mail wait --json --timeout 120) || exit 1 # nobody wrote for 2 minutes
  while IFS= read -r message; do
    case "$(field type "$message")" in
    task_assignment) work_on "$(field taskId "$message")" "$(field content "$message")" ;;
    shutdown_request)
      ralph-mail shutdown respond --accept --reason "idle: shutting down" >/dev/null
      exit 0
      ;;
    text | broadcast) context+="$(field content "$message")"$'\n' ;;
    esac
  done <<<"$batch"
done
