#!/usr/bin/env bash
# Install Debian's `chromium` (the headless browser the report tests screenshot with). Idempotent:
# does nothing when a chromium is already on PATH. `apt-get update` runs only if the install fails
# without it, because a fresh image's package lists may be missing or stale, and updating costs time.
# Usage: scripts/install-chromium.sh
set -euo pipefail
for name in chromium chromium-browser; do
    if command -v "$name" >/dev/null 2>&1; then
        echo "install-chromium.sh: $name already installed ($(command -v "$name")), nothing to do" >&2
        exit 0
    fi
done
sudo=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-chromium.sh: not root and no sudo; run as root" >&2; exit 1; }
    sudo=(sudo)
fi
install=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium)
echo "install-chromium.sh: ${install[*]}" >&2
if ! "${install[@]}"; then
    echo "install-chromium.sh: install failed; running apt-get update and trying again" >&2
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
    "${install[@]}"
fi
echo "install-chromium.sh: installed $(command -v chromium) ($(chromium --version 2>/dev/null || echo 'version unknown'))" >&2
