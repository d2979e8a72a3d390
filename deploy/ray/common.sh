# shellcheck shell=bash
# Shared by start-head.sh and start-worker.sh (sourced, not run): turns the environment
# variables both scripts document into `ray start` arguments, checking each value first so
# a typo fails here rather than as a node that silently lacks its label or GPUs.

RLSERVE_POOL_LABEL="rlserve.io/pool"
RLSERVE_POOLS="gpu cheap"

die() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

require_uint() { # NAME VALUE: VALUE must be a non-negative integer
    [[ "$2" =~ ^[0-9]+$ ]] || die "$1 must be a whole number; got '$2'"
}

# The environment every Ray process of this node inherits. RAY_AUTH_MODE is set explicitly
# (as rlserve.core.cluster does): left unset, a later plain ray.init() turns token auth on
# and `ray start` / `serve deploy` against this cluster fail. "token" needs the same token on
# every node and client (RAY_AUTH_TOKEN or ~/.ray/auth_token); rlserve is tested with
# "disabled", which leaves the cluster open to anyone who can reach its ports.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
case "$RAY_AUTH_MODE" in
    disabled | token) ;;
    *) die "RAY_AUTH_MODE must be 'disabled' or 'token'; got '$RAY_AUTH_MODE'" ;;
esac
export RAY_USAGE_STATS_ENABLED=0 # no usage report over the network

# ray_start_args POOL: sets the array RAY_START_ARGS from NUM_CPUS, NUM_GPUS,
# OBJECT_STORE_BYTES, RESOURCES, LABELS, NODE_IP, TEMP_DIR and the pool ("" or none: none).
ray_start_args() {
    local pool="$1"
    [[ "$pool" != none ]] || pool=""
    local labels=()
    RAY_START_ARGS=(--disable-usage-stats)
    if [[ -n "$pool" ]]; then
        [[ " $RLSERVE_POOLS " == *" $pool "* ]] || die "POOL must be one of: $RLSERVE_POOLS (or none); got '$pool'"
        labels+=("$RLSERVE_POOL_LABEL=$pool")
    fi
    if [[ -n "${LABELS:-}" ]]; then
        [[ "$LABELS" != *"$RLSERVE_POOL_LABEL="* ]] || die "set the pool with POOL, not in LABELS"
        labels+=("$LABELS")
    fi
    if ((${#labels[@]})); then
        local joined
        joined="$(IFS=,; echo "${labels[*]}")"
        RAY_START_ARGS+=("--labels=$joined")
    fi
    if [[ -n "${NUM_CPUS:-}" ]]; then
        require_uint NUM_CPUS "$NUM_CPUS"
        RAY_START_ARGS+=("--num-cpus=$NUM_CPUS")
    fi
    local gpus="${NUM_GPUS:-}"
    if [[ "$pool" == cheap ]]; then
        # Cheap nodes run the reward replicas, which never take a GPU; offer none, so no
        # GPU work is ever scheduled there either.
        [[ -z "$gpus" || "$gpus" == 0 ]] || die "a cheap node offers no GPU; unset NUM_GPUS"
        gpus=0
    fi
    if [[ -n "$gpus" ]]; then
        require_uint NUM_GPUS "$gpus"
        [[ "$pool" != gpu || "$gpus" -gt 0 ]] || die "a gpu node needs NUM_GPUS > 0 (or unset to detect)"
        RAY_START_ARGS+=("--num-gpus=$gpus")
    fi
    if [[ -n "${OBJECT_STORE_BYTES:-}" ]]; then
        require_uint OBJECT_STORE_BYTES "$OBJECT_STORE_BYTES"
        RAY_START_ARGS+=("--object-store-memory=$OBJECT_STORE_BYTES")
    fi
    if [[ -n "${RESOURCES:-}" ]]; then
        [[ "$RESOURCES" == "{"*"}" ]] || die "RESOURCES must be a JSON object, e.g. '{\"cpu_pool\": 1000}'; got '$RESOURCES'"
        RAY_START_ARGS+=("--resources=$RESOURCES")
    fi
    if [[ -n "${NODE_IP:-}" ]]; then
        RAY_START_ARGS+=("--node-ip-address=$NODE_IP")
    fi
    if [[ -n "${TEMP_DIR:-}" ]]; then
        RAY_START_ARGS+=("--temp-dir=$TEMP_DIR")
    fi
}

# run_ray COMMAND...: prints the command with the Ray environment; runs it unless DRY_RUN=1.
run_ray() {
    local shown
    shown="$(printf '%q ' env "RAY_AUTH_MODE=$RAY_AUTH_MODE" "RAY_USAGE_STATS_ENABLED=$RAY_USAGE_STATS_ENABLED" "$@")"
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "${shown% }"
        return 0
    fi
    echo "+ ${shown% }" >&2
    exec "$@"
}
