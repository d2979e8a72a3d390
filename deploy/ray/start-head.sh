#!/usr/bin/env bash
# Starts the head node of a multi-node rlserve Ray cluster (hosts or VMs; on Kubernetes use
# deploy/kuberay/ instead).
#
#   deploy/ray/start-head.sh [more `ray start` arguments, e.g. --block]
#
# The head runs Ray's GCS and dashboard, Serve's controller and its one gRPC proxy
# (proxy_location HeadOnly in deploy/serve/all.yaml, port 9000) and the trainer. It belongs
# to no pool unless POOL says so, so no service worker or reward replica lands on it; the
# services' own replicas take no CPU and may run anywhere. Then, on each other node:
#   deploy/ray/start-worker.sh HEAD_IP:6379     (POOL=gpu or POOL=cheap)
# and here: serve deploy deploy/serve/all.yaml
#
# Environment (all optional):
#   RAY                 ray executable (default: `ray` on PATH, e.g. .venv/bin/ray)
#   RAY_PORT            GCS port the workers join (default 6379)
#   NODE_IP             this node's address for the others (default: Ray picks one)
#   NUM_CPUS, NUM_GPUS  logical CPUs / GPUs offered to Ray, whole numbers (default: detected)
#   OBJECT_STORE_BYTES  object store size in bytes (default: Ray's, 30% of memory)
#   RESOURCES           custom resources as JSON, e.g. '{"cpu_pool": 1000}'
#   POOL                rlserve pool of this node: gpu, cheap or none (default); sets the
#                       node label rlserve.io/pool that the services' placement selects
#   LABELS              more node labels, key=value[,key=value]
#   DASHBOARD_HOST      dashboard address (default 127.0.0.1: this host only; run
#                       `serve deploy` here or through an SSH tunnel. 0.0.0.0 exposes it,
#                       and with it job submission, to the network)
#   DASHBOARD_PORT      (default 8265)
#   TEMP_DIR            Ray's temp/log directory (default /tmp/ray)
#   RAY_AUTH_MODE       token (default) or disabled (as rlserve.core.cluster sets it for
#                       its own local clusters: anyone who reaches Ray's ports runs code)
#   RAY_AUTH_TOKEN      Ray's cluster token; else the file RAY_AUTH_TOKEN_PATH (default
#                       ~/.ray/auth_token), written with a new token when it does not exist
#   RLSERVE_AUTH_TOKEN  the rlserve services' token (every RPC must carry it); else the
#                       file RLSERVE_AUTH_TOKEN_FILE (default ~/.rlserve/auth_token),
#                       written with a new token when it does not exist
#   DRY_RUN=1           print the `ray start` command instead of running it (writes nothing)
#
# New token files are readable by this user only; the script prints their paths, never the
# tokens. Copy both files to the same paths on every node and on each machine that runs
# `rlserve train`, `serve` or `ray` against the cluster; there, export RAY_AUTH_MODE=token
# and RLSERVE_AUTH_TOKEN_FILE (see deploy/README.md, Authentication).
#
# Ports other nodes must reach: 6379 (GCS) and Ray's node ports; clients: 10001 (Ray
# client), 9000 (Serve gRPC), and on nodes running rlserve apps 40000-40999 (each replica's
# own gRPC server: Serve's direct ingress). Both bind every interface, and neither token
# is encrypted on the wire: keep the ports on a private network or firewalled, and put a
# TLS-terminating proxy in front of 9000 for callers elsewhere. On a single machine,
# NODE_IP=127.0.0.1 makes Ray use loopback addresses for its nodes.
set -euo pipefail

# shellcheck source=deploy/ray/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RAY="${RAY:-ray}"
RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_HOST="${DASHBOARD_HOST:-127.0.0.1}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
require_uint RAY_PORT "$RAY_PORT"
require_uint DASHBOARD_PORT "$DASHBOARD_PORT"

ray_start_args "${POOL:-}"
auth_env head
run_ray "$RAY" start --head \
    --port="$RAY_PORT" \
    --include-dashboard=true \
    --dashboard-host="$DASHBOARD_HOST" \
    --dashboard-port="$DASHBOARD_PORT" \
    "${RAY_START_ARGS[@]}" \
    "$@"
