#!/usr/bin/env bash
# The main job on this machine: install into .venv, then train the embedded default
# (tiny random SD3-shaped model, CPU) and print whether it learned.
# Extra arguments are passed to `flowgrpo train`, e.g. scripts/run-local.sh seed=3
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh .venv
export HF_HUB_OFFLINE=1
exec .venv/bin/flowgrpo train --config pipeline/configs/tiny-cpu.yaml "$@"
