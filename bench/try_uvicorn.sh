#!/bin/sh
# Run the direct path's tests against another uvicorn release (the newest by default) in a
# scratch virtualenv, before moving uvicorn's bound in pyproject.toml: kv_slot_tracker/http/fast_protocol.py
# and connection.py use uvicorn's httptools protocol, which is not a public API.
#
#   bench/try_uvicorn.sh [VERSION]     (needs Redis on 127.0.0.1:6379, as the tests do)
#
# The package is installed with its pinned dependencies, then uvicorn is replaced (pip warns
# that the pin is not met: expected). tests/api/test_uvicorn_compat.py names any attribute the
# protocol lost; test_direct_http.py and test_http_limits.py drive both paths over sockets.
set -eu
REPO=$(cd "$(dirname "$0")/.." && pwd)
VERSION=${1:-}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
python3 -m venv "$DIR/venv"
PIP="$DIR/venv/bin/pip"
"$PIP" install -q "$REPO" "$REPO/clients/python" httpx pytest pytest-asyncio pytest-timeout hypothesis
"$PIP" install -q --upgrade "uvicorn[standard]${VERSION:+==$VERSION}" 2>&1 | grep -v "^ERROR: pip's dependency resolver\|incompatible" || true
"$DIR/venv/bin/python" -c 'import uvicorn; print("uvicorn", uvicorn.__version__)'
cd "$DIR"  # the installed package, not the checkout
"$REPO/scripts/with_redis.sh" "$DIR/venv/bin/python" -m pytest -q -p no:cacheprovider \
    --rootdir "$REPO" -c "$REPO/pyproject.toml" \
    "$REPO/tests/api/test_uvicorn_compat.py" "$REPO/tests/api/test_direct_http.py" \
    "$REPO/tests/api/test_http_limits.py"
