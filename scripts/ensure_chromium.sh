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

if [[ -x "$CHROMIUM" && -x "$DRIVER" ]]; then
    exit 0
fi

log "$CHROMIUM or $DRIVER is missing; installing the Debian packages chromium and chromium-driver"
if ! command -v apt-get >/dev/null 2>&1; then
    log "no apt-get on this machine: install Chromium and its chromedriver yourself and point"
    log "SLOT_TRACKER_CHROMIUM and SLOT_TRACKER_CHROMEDRIVER at them"
    exit 1
fi

SUDO=()
if [[ "$(id -u)" -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        log "not root and no passwordless sudo: run as root"
        log "  apt-get update && apt-get install -y chromium chromium-driver"
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# Wait for another apt/dpkg run to finish rather than failing on its lock.
APT=(apt-get -q -o DPkg::Lock::Timeout=300)
"${SUDO[@]}" "${APT[@]}" update
"${SUDO[@]}" "${APT[@]}" install -y chromium chromium-driver

if [[ -x "$CHROMIUM" && -x "$DRIVER" ]]; then
    log "installed: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
    exit 0
fi
log "apt-get finished but $CHROMIUM or $DRIVER is still missing"
exit 1
