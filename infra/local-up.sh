#!/usr/bin/env bash
# Start a local stand-in for the deployment, on this machine only:
#   * a Ray head (`ray start --head --block`) with token authentication, its dashboard / job
#     server on 127.0.0.1, and
#   * a moto S3 server on 127.0.0.1 with one empty bucket,
# then print the variables to export so that `ray job submit` and s3:// URIs reach them.
# Stop both with infra/local-down.sh (same RAYEXPORT_LOCAL_DIR).
#
# Needs `ray` on PATH and moto[server] (with boto3) importable by python3: activate the project's
# virtualenv after `pip install -e '.[test]'`.
#
# Settings (environment, all optional):
#   RAYEXPORT_LOCAL_DIR     state folder: pid files, logs, Ray's temp dir, the token (default
#                           ${TMPDIR:-/tmp}/rayexport-local; keep it short, Ray puts Unix
#                           sockets under it)
#   RAYEXPORT_LOCAL_BUCKET  bucket to create (default rayexport-local)
#   RAYEXPORT_LOCAL_CPUS    CPUs the Ray head offers (default 4)
#   RAYEXPORT_LOCAL_AUTH    token (default) or disabled
#   RAYEXPORT_LOCAL_DASHBOARD_PORT, RAYEXPORT_LOCAL_GCS_PORT, RAYEXPORT_LOCAL_S3_PORT
#                           fixed ports instead of ones picked at start (moto's by the OS as it
#                           binds; Ray's picked free, and picked again if one was taken meanwhile)
set -Eeuo pipefail

STATE_DIR="${RAYEXPORT_LOCAL_DIR:-${TMPDIR:-/tmp}/rayexport-local}"
BUCKET="${RAYEXPORT_LOCAL_BUCKET:-rayexport-local}"
NUM_CPUS="${RAYEXPORT_LOCAL_CPUS:-4}"
AUTH="${RAYEXPORT_LOCAL_AUTH:-token}"
PYTHON="${PYTHON:-python3}"
LOOPBACK=127.0.0.1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# moto accepts any key pair; these are not credentials of anything.
DUMMY_KEY=moto-local-dummy

die() { echo "local-up: $*" >&2; exit 1; }

for tool in ray "$PYTHON" setsid; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found on PATH (activate the virtualenv with moto[server] and ray)"
done
"$PYTHON" -c 'import boto3, moto.server' 2>/dev/null || die "$PYTHON cannot import boto3 and moto.server (pip install -e '.[test]')"
case "$AUTH" in token|disabled) ;; *) die "RAYEXPORT_LOCAL_AUTH must be 'token' or 'disabled', not '$AUTH'" ;; esac

mkdir -p "$STATE_DIR"
STATE_DIR="$(cd "$STATE_DIR" && pwd)"
chmod 700 "$STATE_DIR"
RAY_TEMP_DIR="$STATE_DIR/ray"
# Ray creates Unix sockets below <temp dir>/session_<date>_<pid>/sockets/ (107-byte limit).
[ "${#RAY_TEMP_DIR}" -le 60 ] || die "RAYEXPORT_LOCAL_DIR is too long for Ray's socket paths: $STATE_DIR"

for name in ray moto; do
    if [ -s "$STATE_DIR/$name.pid" ] && kill -0 "$(cat "$STATE_DIR/$name.pid")" 2>/dev/null; then
        die "already running ($name pid $(cat "$STATE_DIR/$name.pid")); run infra/local-down.sh first"
    fi
done
rm -f "$STATE_DIR"/*.pid "$STATE_DIR/env.sh" "$STATE_DIR/auth_token"

# Loopback traffic never goes through a proxy (urllib, boto3, requests and Ray honour these).
PROXY_SET="${http_proxy:-}${HTTP_PROXY:-}${https_proxy:-}${HTTPS_PROXY:-}"
NO_PROXY_LIST="$LOOPBACK,localhost${NO_PROXY:+,$NO_PROXY}"
export NO_PROXY="$NO_PROXY_LIST" no_proxy="$NO_PROXY_LIST"

# Ray's ports: GCS, dashboard, and the ones with fixed defaults (client server 10001, dashboard
# agent 52365, ...), so that another Ray on this machine does not collide. Ray binds the ports it
# is given (its client server and dashboard take no port 0), so they are picked free, all held at
# once so that they differ, and released for Ray to bind; should another process take one in
# between, `ray start` fails and is tried again with new ones (step 4).
pick_ray_ports() {
    read -r -a PORTS <<<"$("$PYTHON" - <<'EOF'
import socket
held = []
for _ in range(7):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    held.append(s)
print(" ".join(str(s.getsockname()[1]) for s in held))
for s in held:
    s.close()
EOF
)"
    GCS_PORT="${RAYEXPORT_LOCAL_GCS_PORT:-${PORTS[0]}}"
    DASHBOARD_PORT="${RAYEXPORT_LOCAL_DASHBOARD_PORT:-${PORTS[1]}}"
    DASHBOARD_URL="http://$LOOPBACK:$DASHBOARD_PORT"
}
RAY_START_ATTEMPTS=3

# Start "$@" detached in a new session whose id is its pid (so local-down.sh can end exactly the
# processes it started) and write that pid to $STATE_DIR/<name>.pid.
start_detached() {
    local name="$1"; shift
    setsid "$@" >"$STATE_DIR/$name.log" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$STATE_DIR/$name.pid"
    sleep 0.2
    local sid
    sid="$(ps -o sid= -p "$pid" 2>/dev/null | tr -d ' ')" || true
    if [ "$sid" != "$pid" ]; then
        echo "local-up: $name exited at once or did not get its own session (pid $pid, sid '$sid'); see $STATE_DIR/$name.log" >&2
        return 1
    fi
}

cleanup_on_error() {
    echo "local-up: failed; stopping what was started (logs in $STATE_DIR)" >&2
    RAYEXPORT_LOCAL_KEEP=1 RAYEXPORT_LOCAL_DIR="$STATE_DIR" bash "$HERE/local-down.sh" >&2 || true
}
trap cleanup_on_error ERR

# 1. moto's S3 server, loopback only, on the port the OS gives it as it binds (or the fixed one),
#    which it writes to moto.port once it listens.
rm -f "$STATE_DIR/moto.port"
start_detached moto "$PYTHON" -c '
import os, sys, threading
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address=sys.argv[1], port=int(sys.argv[2]), verbose=False)
server.start()
with open(sys.argv[3] + ".new", "w") as handle:
    handle.write(str(server.get_host_and_port()[1]))
os.replace(sys.argv[3] + ".new", sys.argv[3])
threading.Event().wait()
' "$LOOPBACK" "${RAYEXPORT_LOCAL_S3_PORT:-0}" "$STATE_DIR/moto.port"

# 2. Wait for it and create the bucket (boto3, which moto[server] depends on; no AWS CLI).
S3_PORT="$(STATE_DIR="$STATE_DIR" MOTO_PID="$(cat "$STATE_DIR/moto.pid")" "$PYTHON" - <<'EOF'
import os, sys, time
port_file, deadline = os.path.join(os.environ["STATE_DIR"], "moto.port"), time.monotonic() + 30
while not os.path.exists(port_file):
    try:
        os.kill(int(os.environ["MOTO_PID"]), 0)
    except OSError:
        sys.exit("local-up: moto's server exited; see moto.log")
    if time.monotonic() > deadline:
        sys.exit("local-up: moto's server did not start listening; see moto.log")
    time.sleep(0.1)
print(open(port_file).read())
EOF
)"
S3_ENDPOINT="http://$LOOPBACK:$S3_PORT"
S3_ENDPOINT="$S3_ENDPOINT" BUCKET="$BUCKET" DUMMY_KEY="$DUMMY_KEY" "$PYTHON" - <<'EOF'
import os
endpoint, bucket = os.environ["S3_ENDPOINT"], os.environ["BUCKET"]
import boto3
s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                  aws_access_key_id=os.environ["DUMMY_KEY"], aws_secret_access_key=os.environ["DUMMY_KEY"])
s3.create_bucket(Bucket=bucket)
EOF

# 3. Ray's token. RAY_AUTH_TOKEN would take precedence over RAY_AUTH_TOKEN_PATH, so it is unset;
#    the token lives in the state folder (mode 600), not in ~/.ray/auth_token.
unset RAY_AUTH_TOKEN RAY_ADDRESS RAY_API_SERVER_ADDRESS
if [ "$AUTH" = token ]; then
    (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32), end="")' >"$STATE_DIR/auth_token")
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$STATE_DIR/auth_token"
else
    # Set explicitly: with RAY_AUTH_MODE unset, `ray start` turns token auth on by itself when a
    # token exists (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH).
    export RAY_AUTH_MODE=disabled
    unset RAY_AUTH_TOKEN_PATH
fi

# 4. The Ray head. Jobs' drivers inherit its environment, so they reach moto with no runtime_env.
#    RAYEXPORT_LOCAL_STACK marks every process of the Ray head, including job drivers that Ray
#    starts in sessions of their own; local-down.sh looks for it.
#    RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: on SIGTERM, stop at once instead of draining the
#    node for up to 30 s while jobs still run (nothing here to hand work over to).
export AWS_ENDPOINT_URL="$S3_ENDPOINT" AWS_ACCESS_KEY_ID="$DUMMY_KEY" AWS_SECRET_ACCESS_KEY="$DUMMY_KEY" \
    AWS_DEFAULT_REGION=us-east-1
unset AWS_ENDPOINT_URL_S3 AWS_SESSION_TOKEN AWS_PROFILE

# 5. Wait until the job server answers an authenticated request: exit status 0, 3 when `ray start`
#    exited (a port taken meanwhile, say: tried again), 1 for anything else.
wait_for_ray() {
    DASHBOARD_URL="$DASHBOARD_URL" RAY_PID="$(cat "$STATE_DIR/ray.pid")" "$PYTHON" - <<'EOF'
import os, sys, time, urllib.error, urllib.request
url = os.environ["DASHBOARD_URL"] + "/api/version"
headers = {}
if os.environ.get("RAY_AUTH_MODE") == "token":
    with open(os.environ["RAY_AUTH_TOKEN_PATH"]) as handle:
        headers["Authorization"] = "Bearer " + handle.read().strip()
deadline = time.monotonic() + 120
while True:
    try:
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2).read()
        break
    except Exception as error:
        try:
            os.kill(int(os.environ["RAY_PID"]), 0)
        except OSError:
            print("local-up: `ray start` exited: see ray.log", file=sys.stderr)
            sys.exit(3)
        if time.monotonic() > deadline:
            sys.exit(f"local-up: the Ray job server did not answer at {url}: {error}")
        time.sleep(0.5)
EOF
}

# 4 and 5, with new ports while `ray start` fails (RAY_START_ATTEMPTS in all).
for attempt in $(seq "$RAY_START_ATTEMPTS"); do
    pick_ray_ports
    status=0
    start_detached ray env RAYEXPORT_LOCAL_STACK="$STATE_DIR" RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 ray start --head --block --disable-usage-stats \
        --temp-dir="$RAY_TEMP_DIR" --num-cpus="$NUM_CPUS" \
        --port="$GCS_PORT" --dashboard-host="$LOOPBACK" --dashboard-port="$DASHBOARD_PORT" \
        --ray-client-server-port="${PORTS[2]}" --dashboard-agent-listen-port="${PORTS[3]}" \
        --dashboard-agent-grpc-port="${PORTS[4]}" --metrics-export-port="${PORTS[5]}" \
        --runtime-env-agent-port="${PORTS[6]}" || status=3
    if [ "$status" -eq 0 ]; then
        wait_for_ray || status=$?
    fi
    [ "$status" -eq 0 ] && break
    if [ "$status" -ne 3 ] || [ "$attempt" -eq "$RAY_START_ATTEMPTS" ]; then
        false  # the ERR trap stops what was started
    fi
    kill -KILL -- "-$(cat "$STATE_DIR/ray.pid")" 2>/dev/null || true  # what the failed start left in its session
    mv "$STATE_DIR/ray.log" "$STATE_DIR/ray.attempt$attempt.log"
    echo "local-up: \`ray start\` failed (attempt $attempt of $RAY_START_ATTEMPTS; see ray.attempt$attempt.log); trying new ports" >&2
done
trap - ERR

{
    echo "# rayexport local stack ($STATE_DIR), written by infra/local-up.sh"
    echo "export RAY_API_SERVER_ADDRESS=$DASHBOARD_URL"
    echo "export RAY_AUTH_MODE=$RAY_AUTH_MODE"
    if [ "$AUTH" = token ]; then
        echo "export RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH"
    fi
    echo "export AWS_ENDPOINT_URL=$S3_ENDPOINT"
    echo "export AWS_ACCESS_KEY_ID=$DUMMY_KEY"
    echo "export AWS_SECRET_ACCESS_KEY=$DUMMY_KEY"
    echo "export AWS_DEFAULT_REGION=us-east-1"
    if [ -n "$PROXY_SET" ]; then
        echo "export NO_PROXY=$NO_PROXY_LIST"
        echo "export no_proxy=$NO_PROXY_LIST"
    fi
    echo "# To run python -m rayexport.run on this machine against this head (not via a job):"
    echo "#   export RAY_ADDRESS=$LOOPBACK:$GCS_PORT"
} >"$STATE_DIR/env.sh"

echo "Ray head:   job server / dashboard $DASHBOARD_URL, GCS $LOOPBACK:$GCS_PORT (auth: $RAY_AUTH_MODE)"
echo "S3 (moto):  $S3_ENDPOINT, bucket s3://$BUCKET"
echo "State:      $STATE_DIR (pids, logs)"
echo
echo "Export these (or: source $STATE_DIR/env.sh):"
cat "$STATE_DIR/env.sh"
