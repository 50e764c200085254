#!/usr/bin/env bash
# Create a virtualenv (or reuse one) and install this project into it at the versions of locks/flowgrpo.txt (every
# distribution, pip and setuptools included; refresh it with scripts/lock.sh).
# torch goes in first, by the exact version pinned in pyproject.toml and the lock, so pip keeps the build it finds
# first: the CPU wheel on CPU machines (a local +cpu build satisfies the lock's torch==X), the CUDA wheel from PyPI on
# GPU nodes.
# Usage: scripts/install.sh VENV_DIR [EXTRAS]   e.g. scripts/install.sh .venv dev
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
extras=${2:-}
lock=locks/flowgrpo.txt
torch_version=$(sed -n 's/^ *"torch==\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$torch_version" ] || { echo "install.sh: no torch==X pin found in pyproject.toml" >&2; exit 1; }
grep -qx "torch==$torch_version" "$lock" \
    || { echo "install.sh: $lock does not lock torch==$torch_version (pyproject.toml): run scripts/lock.sh" >&2; exit 1; }
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip_quiet() {
    # pip's global config on some machines names local indexes that lack most packages: drop its warning per package.
    "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
echo "install.sh: pip and setuptools from $lock into $venv" >&2
pip_quiet install --quiet -c "$lock" pip setuptools
echo "install.sh: torch==$torch_version" >&2
pip_quiet install --quiet -c "$lock" "torch==$torch_version"
echo "install.sh: this project${extras:+ [$extras]}, every dependency at its locked version" >&2
# No build isolation: setuptools is the locked one just installed, not whatever the index has today.
pip_quiet install --quiet --no-build-isolation -c "$lock" -e ".${extras:+[$extras]}"
