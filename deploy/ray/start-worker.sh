#!/usr/bin/env bash
# Joins this node to an rlserve Ray cluster whose head runs deploy/ray/start-head.sh.
#
#   POOL=gpu   deploy/ray/start-worker.sh HEAD_IP:6379 [more `ray start` arguments]
#   POOL=cheap NUM_CPUS=16 deploy/ray/start-worker.sh HEAD_IP:6379
#
# POOL (required) puts the node in a resource pool through the Ray node label
# rlserve.io/pool, which the services' placement selects (deploy/serve/all.yaml):
#   gpu    rollout, critic and reference workers (one bundle of {CPU: 8, GPU: 1} each in
#          the shared placement group rlserve-global_pool)
#   cheap  reward replicas (1 CPU each, autoscaled); the node offers no GPU
#   none   no pool: only the services' zero-CPU replicas may land here
#
# Environment (all optional but POOL):
#   RAY_HEAD_ADDRESS    the head's HOST:PORT, instead of the first argument
#   RAY                 ray executable (default: `ray` on PATH, e.g. .venv/bin/ray)
#   NODE_IP             this node's address for the others (default: Ray picks one)
#   NUM_CPUS, NUM_GPUS  logical CPUs / GPUs offered to Ray, whole numbers (default: detected;
#                       a cheap node always offers 0 GPUs)
#   OBJECT_STORE_BYTES  object store size in bytes (default: Ray's, 30% of memory)
#   RESOURCES           custom resources as JSON, e.g. '{"cpu_pool": 1000}'
#   LABELS              more node labels, key=value[,key=value]
#   TEMP_DIR            Ray's temp/log directory (default /tmp/ray)
#   RAY_AUTH_MODE       token (default) or disabled; the same on every node
#   RAY_AUTH_TOKEN      Ray's cluster token; else the file RAY_AUTH_TOKEN_PATH (default
#                       ~/.ray/auth_token), a copy of the head's
#   RLSERVE_AUTH_TOKEN  the rlserve services' token, which replicas on this node check;
#                       else the file RLSERVE_AUTH_TOKEN_FILE (default
#                       ~/.rlserve/auth_token), a copy of the head's
#   DRY_RUN=1           print the `ray start` command instead of running it
#
# A worker never makes tokens: without the head's, it stops here, naming the file.
set -euo pipefail

# shellcheck source=deploy/ray/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RAY="${RAY:-ray}"
if [[ $# -gt 0 && "$1" != -* ]]; then
    HEAD_ADDRESS="$1"
    shift
else
    HEAD_ADDRESS="${RAY_HEAD_ADDRESS:-}"
fi
[[ "$HEAD_ADDRESS" =~ ^[^:[:space:]]+:[0-9]+$ ]] ||
    die "give the head's address as HOST:PORT (first argument or RAY_HEAD_ADDRESS), e.g. 10.0.0.1:6379; got '$HEAD_ADDRESS'"

# A worker must say its pool: a forgotten POOL would make a node no service can use.
[[ -n "${POOL:-}" ]] || die "set POOL to gpu, cheap or none"

ray_start_args "$POOL"
auth_env worker
run_ray "$RAY" start --address="$HEAD_ADDRESS" "${RAY_START_ARGS[@]}" "$@"
