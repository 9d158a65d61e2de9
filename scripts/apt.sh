# Sourced by the scripts/ensure_*.sh scripts: installing Debian packages the tests need.
#
# apt_install HINT PKG_OR_OPTION...: `apt-get update`, then `apt-get install -y PKG_OR_OPTION...`,
# as root or through passwordless sudo (left in SUDO for the caller's later steps), waiting for
# another apt/dpkg run's lock rather than failing on it. Returns 1 after saying what to do when
# it cannot: HINT where there is no apt-get, the command to run as root otherwise. Uses the
# caller's log().

SUDO=()

apt_install() {
    local hint=$1
    shift
    if ! command -v apt-get >/dev/null 2>&1; then
        log "no apt-get on this machine: $hint"
        return 1
    fi
    SUDO=()
    if [[ "$(id -u)" -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            SUDO=(sudo -n)
        else
            log "not root and no passwordless sudo: run as root"
            log "  apt-get update && apt-get install -y $*"
            return 1
        fi
    fi
    export DEBIAN_FRONTEND=noninteractive
    local apt=(apt-get -q -o DPkg::Lock::Timeout=300)
    "${SUDO[@]}" "${apt[@]}" update
    "${SUDO[@]}" "${apt[@]}" install -y "$@"
}
