#!/usr/bin/env bash
# Create a virtualenv (or reuse one) and install this project into it.
# torch goes in first, by the exact version pinned in pyproject.toml, so pip keeps that build:
# the CPU wheel on CPU machines, the CUDA wheel from PyPI on GPU nodes.
# Usage: scripts/install.sh VENV_DIR [EXTRAS]   e.g. scripts/install.sh .venv dev
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
extras=${2:-}
torch_version=$(sed -n 's/^ *"torch==\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$torch_version" ] || { echo "install.sh: no torch==X pin found in pyproject.toml" >&2; exit 1; }
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
echo "install.sh: torch==$torch_version into $venv" >&2
"$venv/bin/python" -m pip install --quiet "torch==$torch_version"
echo "install.sh: this project${extras:+ [$extras]}" >&2
"$venv/bin/python" -m pip install --quiet -e ".${extras:+[$extras]}"
