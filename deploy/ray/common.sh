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
# (as rlserve.core.cluster does): left unset, a later plain ray.init() decides by itself.
# "token" (the default here) makes Ray refuse any node, driver, `serve deploy` or dashboard
# call without the cluster's Ray token (RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH,
# by default ~/.ray/auth_token); every client then needs RAY_AUTH_MODE=token too, since
# rlserve.core.cluster sets "disabled" when the variable is unset. "disabled" (what
# rlserve's own local clusters and tests use) leaves the cluster open to anyone who can
# reach its ports.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
case "$RAY_AUTH_MODE" in
    disabled | token) ;;
    *) die "RAY_AUTH_MODE must be 'disabled' or 'token'; got '$RAY_AUTH_MODE'" ;;
esac
export RAY_USAGE_STATS_ENABLED=0 # no usage report over the network
# Serve's direct ingress (as rlserve.core.cluster sets it): each app's replica also
# answers gRPC on a port of its own node (40000-40999), which a trainer on the cluster
# calls instead of the proxy's hop; user code and router on the replica's event loop;
# no 30 s drain before a replica stops. A value already set in the environment wins.
export RAY_SERVE_ENABLE_DIRECT_INGRESS="${RAY_SERVE_ENABLE_DIRECT_INGRESS:-1}"
export RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD="${RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD:-0}"
export RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP="${RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP:-0}"
export RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="${RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S:-0}"
# Serve's gRPC proxy refuses larger messages from their length prefix, before buffering
# them or checking the token (Serve's default: 2 GiB). 64 MiB holds requests of the
# services' default max_request_tokens; raise it with theirs (docs/reliability-and-security.md).
export RAY_SERVE_GRPC_MAX_MESSAGE_SIZE="${RAY_SERVE_GRPC_MAX_MESSAGE_SIZE:-67108864}"
# Serve's controller loop and replicas' metric exports at a slower pace than Serve's
# 0.1 s: CPU every node pays whether it trains or not (rlserve.core.cluster).
export RAY_SERVE_CONTROL_LOOP_INTERVAL_S="${RAY_SERVE_CONTROL_LOOP_INTERVAL_S:-0.5}"
export RAY_SERVE_METRICS_EXPORT_INTERVAL_MS="${RAY_SERVE_METRICS_EXPORT_INTERVAL_MS:-1000}"
SERVE_ENV_NAMES=(RAY_SERVE_ENABLE_DIRECT_INGRESS RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
    RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
    RAY_SERVE_GRPC_MAX_MESSAGE_SIZE RAY_SERVE_CONTROL_LOOP_INTERVAL_S
    RAY_SERVE_METRICS_EXPORT_INTERVAL_MS)

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

# token_path VARIABLE DEFAULT: the token file VARIABLE names, else $HOME/DEFAULT.
token_path() {
    if [[ -n "${!1:-}" ]]; then
        echo "${!1}"
    elif [[ -n "${HOME:-}" ]]; then
        echo "$HOME/$2"
    else
        die "HOME is not set: set $1 to the token file's path"
    fi
}

# ensure_token_file ROLE VARIABLE PATH MAKE: a token file at PATH. The head writes a new one
# (MAKE prints it) when PATH does not exist, readable by this user only; a worker requires
# it, as a copy of the head's. With DRY_RUN=1 nothing is written.
ensure_token_file() {
    local role="$1" variable="$2" path="$3" make="$4"
    if [[ -e "$path" ]]; then
        [[ -r "$path" && -s "$path" ]] || die "$variable=$path: the token file is unreadable or empty"
        echo "token file in use: $path ($variable)" >&2
    elif [[ "$role" != head ]]; then
        die "no token file $path: copy the head's (start-head.sh printed its path) to this path, or set $variable to where it is"
    elif [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "(dry run: would write a new token to $path)" >&2
    else
        (umask 077 && mkdir -p "$(dirname "$path")" && set -o noclobber && "$make" >"$path") ||
            die "cannot write the token file $path"
        echo "new token written to $path (mode 0600): copy it to the same path on every node and client" >&2
    fi
}

new_ray_token() { # as Ray's own generator: 32 random bytes, hex, no newline
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'
}

new_rlserve_token() { # as rlserve.core.auth.generate_token: 32 random bytes, URL-safe base64
    head -c 32 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n'
    echo
}

# auth_env ROLE (head or worker): the two secrets this node's processes need.
# - Ray's token when RAY_AUTH_MODE=token: RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH
#   (default ~/.ray/auth_token).
# - The rlserve services' token (rlserve.core.auth), which Serve's gRPC proxy does not
#   check but every replica does: RLSERVE_AUTH_TOKEN, or the file RLSERVE_AUTH_TOKEN_FILE
#   (default ~/.rlserve/auth_token), exported so that the replicas started on this node
#   read it. Tokens are never printed, only the files' paths.
auth_env() {
    local role="$1" path
    if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" ]]; then
        path="$(token_path RAY_AUTH_TOKEN_PATH .ray/auth_token)" || exit 2
        ensure_token_file "$role" RAY_AUTH_TOKEN_PATH "$path" new_ray_token
    fi
    if [[ -n "${RLSERVE_AUTH_TOKEN:-}" ]]; then
        export RLSERVE_AUTH_TOKEN
    else
        path="$(token_path RLSERVE_AUTH_TOKEN_FILE .rlserve/auth_token)" || exit 2
        ensure_token_file "$role" RLSERVE_AUTH_TOKEN_FILE "$path" new_rlserve_token
        export RLSERVE_AUTH_TOKEN_FILE="$path"
    fi
}

# run_ray COMMAND...: prints the command with the Ray environment; runs it unless DRY_RUN=1.
run_ray() {
    local shown name shown_env=("RAY_AUTH_MODE=$RAY_AUTH_MODE" "RAY_USAGE_STATS_ENABLED=$RAY_USAGE_STATS_ENABLED")
    for name in "${SERVE_ENV_NAMES[@]}"; do
        shown_env+=("$name=${!name}")
    done
    if [[ -z "${RLSERVE_AUTH_TOKEN:-}" && -n "${RLSERVE_AUTH_TOKEN_FILE:-}" ]]; then
        shown_env+=("RLSERVE_AUTH_TOKEN_FILE=$RLSERVE_AUTH_TOKEN_FILE")
    fi
    shown="$(printf '%q ' env "${shown_env[@]}" "$@")"
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "${shown% }"
        return 0
    fi
    echo "+ ${shown% }" >&2
    exec "$@"
}
