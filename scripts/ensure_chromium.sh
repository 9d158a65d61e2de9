#!/usr/bin/env bash
# Make sure headless Chromium and its WebDriver are installed for the browser tests
# (tests/browser/). Called by `make test`; does nothing when both are already there.
#
#   scripts/ensure_chromium.sh
#
# Looks for SLOT_TRACKER_CHROMIUM (default /usr/bin/chromium) and SLOT_TRACKER_CHROMEDRIVER
# (default /usr/bin/chromedriver). When either is missing, installs the Debian packages
# `chromium` and `chromium-driver` with apt-get (as root, or through passwordless sudo).
# Exits non-zero when they are missing and cannot be installed; the browser tests then fail
# and say why.
set -euo pipefail

CHROMIUM="${SLOT_TRACKER_CHROMIUM:-/usr/bin/chromium}"
DRIVER="${SLOT_TRACKER_CHROMEDRIVER:-/usr/bin/chromedriver}"

log() { echo "ensure_chromium: $*" >&2; }
# shellcheck source=scripts/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

if [[ -x "$CHROMIUM" && -x "$DRIVER" ]]; then
    exit 0
fi

log "$CHROMIUM or $DRIVER is missing; installing the Debian packages chromium and chromium-driver"
apt_install "install Chromium and its chromedriver yourself and point SLOT_TRACKER_CHROMIUM and SLOT_TRACKER_CHROMEDRIVER at them" \
    chromium chromium-driver

if [[ -x "$CHROMIUM" && -x "$DRIVER" ]]; then
    log "installed: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
    exit 0
fi
log "apt-get finished but $CHROMIUM or $DRIVER is still missing"
exit 1
