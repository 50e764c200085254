#!/usr/bin/env bash
# Install the Debian packages the tests use on this machine: `chromium` (the headless browser the report tests
# screenshot with), `iproute2` (`ip netns`, `ss`: the multi-host tests' hosts, scripts/hosts.sh) and `postgresql`
# (the server the tests' MLflow keeps its runs in, as the cluster's does: tests/postgres_server.py). Idempotent: a
# package whose command is already installed is skipped. `apt-get update` runs only if the install fails without
# it, because a fresh image's package lists may be missing or stale, and updating costs time.
# Usage: scripts/install-debian.sh
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
{ command -v ip >/dev/null 2>&1 && command -v ss >/dev/null 2>&1; } || missing+=(iproute2)
# Debian puts the server (initdb, postgres) in /usr/lib/postgresql/NN/bin, not on PATH
compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null || missing+=(postgresql)
if [ ${#missing[@]} -eq 0 ]; then
    echo "install-debian.sh: chromium, iproute2 and postgresql already installed, nothing to do" >&2
    exit 0
fi
sudo=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-debian.sh: not root and no sudo; run as root" >&2; exit 1; }
    sudo=(sudo)
fi
install=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}")
echo "install-debian.sh: ${install[*]}" >&2
if ! "${install[@]}"; then
    echo "install-debian.sh: install failed; running apt-get update and trying again" >&2
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
    "${install[@]}"
fi
echo "install-debian.sh: installed ${missing[*]}" >&2
