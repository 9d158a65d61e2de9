#!/usr/bin/env bash
# Load test a local instance: start it, run Locust headless against it, stop it.
#
#   loadtest/run.sh [EXTRA LOCUST ARGS...]        (make loadtest runs this)
#
# Environment (all optional):
#   LOADTEST_TIME        run time, Locust syntax (default 60s)
#   LOADTEST_USERS       simulated users (default 50; one of them polls /loads)
#   LOADTEST_SPAWN_RATE  users started per second (default 10)
#   LOADTEST_PORT        port of the instance (default: a free one)
#   LOADTEST_OUT         output folder (default loadtest/out): run_stats.csv, run_failures.csv,
#                        run_exceptions.csv, run_stats_history.csv, report.html, server.log
#   LOADTEST_ARGS        extra Locust arguments, e.g. "--lt-workers 32 --lt-inject-ratio 0.1"
#   LOADTEST_* / SLOT_TRACKER_API_KEY: workload options read by loadtest/locustfile.py
# The locustfile starts simulated engines (loadtest/kv_engines.py) that publish KV events to
# the instance on loopback ports. The instance gets this environment too (SLOT_TRACKER_* settings apply; with
# SLOT_TRACKER_API_KEY set both sides use the key). Exits with Locust's exit code: non-zero on
# unexpected failures, or 1 when the instance does not come up or dies during the run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
TIME="${LOADTEST_TIME:-60s}"
USERS="${LOADTEST_USERS:-50}"
SPAWN_RATE="${LOADTEST_SPAWN_RATE:-10}"
OUT="${LOADTEST_OUT:-$ROOT/loadtest/out}"

log() { echo "loadtest: $*" >&2; }

if [[ ! -x "$PY" ]] || ! "$PY" -c 'import locust' 2>/dev/null; then
    log "no locust in .venv: run 'make loadtest' (or pip install -e '.[loadtest]') first"
    exit 1
fi
PORT="${LOADTEST_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
    fi
}
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$PY" -m kv_slot_tracker --host 127.0.0.1 --port "$PORT" --log-level warning >"$OUT/server.log" 2>&1 &
SERVER_PID=$!

# Wait up to 30 s for /health.
if ! "$PY" - "$URL/health" "$SERVER_PID" <<'PY'; then
import os, sys, time, urllib.request

url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            if resp.status == 200:
                sys.exit(0)
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)  # the instance exited
    time.sleep(0.2)
sys.exit(1)
PY
    log "the instance on $URL did not come up; its log:"
    tail -n 20 "$OUT/server.log" >&2
    exit 1
fi
log "instance up on $URL (pid $SERVER_PID); $USERS users, spawn rate $SPAWN_RATE/s, for $TIME"

# shellcheck disable=SC2086  # LOADTEST_ARGS is split into arguments on purpose
set +e
"$PY" -m locust -f "$ROOT/loadtest/locustfile.py" --headless \
    -u "$USERS" -r "$SPAWN_RATE" -t "$TIME" -H "$URL" \
    --csv "$OUT/run" --csv-full-history --html "$OUT/report.html" --only-summary \
    --lt-check-drained ${LOADTEST_ARGS:-} "$@"
RC=$?
set -e

if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    log "the instance died during the run; its log:"
    tail -n 20 "$OUT/server.log" >&2
    RC=1
fi
log "stats in $OUT (run_stats.csv, report.html); exit code $RC"
exit "$RC"
