#!/usr/bin/env bash
# Stop what infra/local-up.sh started (same RAYEXPORT_LOCAL_DIR): the Ray head and everything it
# spawned, and the moto S3 server. Only processes this stack started are signalled, by pid:
#   * the session of each process local-up.sh started (its pid is the session id), and
#   * processes whose environment carries RAYEXPORT_LOCAL_STACK=<state dir> (Ray starts job
#     drivers in sessions of their own; they inherit that mark from the head).
# Then the state folder (logs, Ray's temp dir, the token) is removed, unless
# RAYEXPORT_LOCAL_KEEP=1. Exit status 1 if anything of the stack is still running.
set -euo pipefail

STATE_DIR="${RAYEXPORT_LOCAL_DIR:-${TMPDIR:-/tmp}/rayexport-local}"
if [ ! -d "$STATE_DIR" ]; then
    echo "local-down: nothing to stop ($STATE_DIR does not exist)"
    exit 0
fi
STATE_DIR="$(cd "$STATE_DIR" && pwd)"
MARK="RAYEXPORT_LOCAL_STACK=$STATE_DIR"

# Live (not zombie) processes of session $1.
session_members() {
    ps -eo pid=,sid=,stat= | awk -v sid="$1" '$2 == sid && $3 !~ /^Z/ {print $1}'
}

# Live processes whose initial environment holds the mark (only our own are readable).
marked() {
    local file pid
    grep -lzxF -- "$MARK" /proc/[0-9]*/environ 2>/dev/null | while read -r file; do
        pid="${file#/proc/}"; pid="${pid%/environ}"
        [ "$pid" = "$$" ] && continue
        case "$(ps -o stat= -p "$pid" 2>/dev/null)" in Z*|"") ;; *) echo "$pid" ;; esac
    done || true
}

# The pid in $STATE_DIR/$1.pid if that process is still the one local-up.sh started: it leads
# its own session and its command line holds $2.
owned_pid() {
    local file="$STATE_DIR/$1.pid" pid
    [ -s "$file" ] || return 0
    pid="$(cat "$file")"
    [ -r "/proc/$pid/cmdline" ] || return 0
    [ "$(ps -o sid= -p "$pid" 2>/dev/null | tr -d ' ')" = "$pid" ] || return 0
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2" || return 0
    echo "$pid"
}

# Wait up to $1 seconds until command $2 (a function) lists nothing; print what is left.
wait_gone() {
    local deadline=$((SECONDS + $1)) left
    while :; do
        left="$("${@:2}")"
        [ -z "$left" ] && return 0
        [ "$SECONDS" -ge "$deadline" ] && { echo "$left"; return 0; }
        sleep 0.5
    done
}

kill_list() {  # signal, pids...
    local signal="$1"; shift
    [ "$#" -gt 0 ] && kill "-$signal" "$@" 2>/dev/null || true
}

stop_session() {  # name, command-line marker, seconds to wait after SIGTERM
    local name="$1" pid left
    pid="$(owned_pid "$1" "$2")"
    if [ -z "$pid" ]; then
        echo "local-down: $name is not running"
        return 0
    fi
    echo "local-down: stopping $name (session $pid)"
    kill -TERM "$pid" 2>/dev/null || true   # `ray start --block` drains, then ends its children
    left="$(wait_gone "$3" session_members "$pid")"
    if [ -n "$left" ]; then
        echo "local-down: $name: SIGKILL to what is left of session $pid:" $left
        # shellcheck disable=SC2086
        kill_list KILL $left
        wait_gone 5 session_members "$pid" >/dev/null
    fi
}

RAY_TEMP_DIR="$STATE_DIR/ray"
stop_session ray "--temp-dir=$RAY_TEMP_DIR" 45

left="$(marked)"
if [ -n "$left" ]; then
    echo "local-down: ending processes left by the Ray head:" $left
    # shellcheck disable=SC2086
    kill_list TERM $left
    left="$(wait_gone 10 marked)"
    # shellcheck disable=SC2086
    [ -n "$left" ] && kill_list KILL $left
    wait_gone 5 marked >/dev/null
fi

stop_session moto "$STATE_DIR/moto.port" 10  # moto's server, told on its command line where to write its port

# Anything still alive is reported, and the state folder is kept for its logs.
still=""
for name in ray moto; do
    if [ -s "$STATE_DIR/$name.pid" ]; then
        members="$(session_members "$(cat "$STATE_DIR/$name.pid")")"
        [ -n "$members" ] && still="$still $members"
    fi
done
marked_left="$(marked)"
[ -n "$marked_left" ] && still="$still $marked_left"
if [ -n "$still" ]; then
    echo "local-down: still running:$still (state kept in $STATE_DIR)" >&2
    exit 1
fi

rm -f "$STATE_DIR/auth_token" "$STATE_DIR"/*.pid "$STATE_DIR/env.sh"
if [ "${RAYEXPORT_LOCAL_KEEP:-0}" = 1 ]; then
    echo "local-down: stopped; logs kept in $STATE_DIR"
else
    rm -rf "$STATE_DIR"
    echo "local-down: stopped; removed $STATE_DIR"
fi
echo "In shells that sourced env.sh:"
echo "  unset RAY_API_SERVER_ADDRESS RAY_AUTH_MODE RAY_AUTH_TOKEN_PATH AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_DEFAULT_REGION"
