#!/usr/bin/env bash
# Make sure Prometheus's rule checker, promtool, is installed for the alert-rule tests
# (tests/deploy/test_alerts.py runs `promtool check rules` and `promtool test rules` on
# deploy/prometheus/). Called by `make test`; does nothing when promtool is already there.
#
#   scripts/ensure_promtool.sh
#
# Looks for SLOT_TRACKER_PROMTOOL (default: promtool on PATH, else /usr/bin/promtool). When it
# is missing, installs the Debian package `prometheus` (which ships /usr/bin/promtool) with
# apt-get, as root or through passwordless sudo, without its recommended node exporter. The
# package's Prometheus server is then stopped and disabled where an init system started it:
# the tests need the checker, not a server. Exits non-zero when promtool is missing and cannot
# be installed; the alert tests then fail and say why.
set -euo pipefail

log() { echo "ensure_promtool: $*" >&2; }
# shellcheck source=scripts/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

found() {
    if [[ -n "${SLOT_TRACKER_PROMTOOL:-}" ]]; then
        [[ -x "$SLOT_TRACKER_PROMTOOL" ]]
    else
        command -v promtool >/dev/null 2>&1 || [[ -x /usr/bin/promtool ]]
    fi
}

if found; then
    exit 0
fi

log "promtool is missing; installing the Debian package prometheus (it ships /usr/bin/promtool)"
apt_install "install promtool (from a Prometheus release) yourself and point SLOT_TRACKER_PROMTOOL at it" \
    --no-install-recommends prometheus

# The package enables and starts a Prometheus server (where an init system runs); it is not
# wanted here. Both commands fail harmlessly in a container without one.
if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    "${SUDO[@]}" systemctl disable --now prometheus >/dev/null 2>&1 || true
elif command -v service >/dev/null 2>&1; then
    "${SUDO[@]}" service prometheus stop >/dev/null 2>&1 || true
fi
if command -v update-rc.d >/dev/null 2>&1; then
    "${SUDO[@]}" update-rc.d prometheus disable >/dev/null 2>&1 || true
fi

if found; then
    log "installed: $(promtool --version 2>&1 | head -n 1)"
    exit 0
fi
log "apt-get finished but promtool is still missing"
exit 1
