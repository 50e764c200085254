"""The contracts of .importlinter cover a module the day it is added.

`lint-imports` runs on a copy of components/ and pipeline/ (never the real tree: tests run side by side): the copy
passes; then new modules, one per contract written with wildcards, each make the import that contract forbids, and
`lint-imports` fails naming each of those contracts and each import.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# A new module each (path, source) and what `lint-imports` must then report: the contract's name and the import.
PROBES = {
    "model families only behind the adapters (components.models)": (
        {"components/models/newfamily_probe/__init__.py": "", "components/models/newfamily_probe/adapter.py": "",
         "components/trainer/newfamily_user_probe.py": "import components.models.newfamily_probe.adapter\n"},
        "components.trainer.newfamily_user_probe -> components.models.newfamily_probe.adapter"),
    "mlflow only in components.tracking and components.registry": (
        {"components/dataset/mlflow_probe.py": "import mlflow\n"},
        "components.dataset.mlflow_probe -> mlflow"),
    "the Kubernetes client only in the Kubernetes launcher's client modules (api, rayjob_client, objects_client)": (
        {"components/launch/kubernetes/client_probe.py": "from kubernetes import client\n"},
        "components.launch.kubernetes.client_probe -> kubernetes"),
    "the layers of components/ (docs/DESIGN.md): launch over the stages over the algorithm over models, data, "
    "tracking and rewards": (
        {"components/newlayer_probe.py": ""},
        "components.newlayer_probe"),
}


def _copy_tree(dest: Path) -> None:
    """The Python sources of components/ and pipeline/, and .importlinter: all that `lint-imports` reads."""
    for package in ("components", "pipeline"):
        for source in (REPO / package).rglob("*.py"):
            target = dest / source.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    shutil.copyfile(REPO / ".importlinter", dest / ".importlinter")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    # a wide console, so that no contract's name is wrapped over two lines
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "1000"}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def _broken_contracts(output: str) -> set[str]:
    return set(re.findall(r"^(.+) BROKEN(?: \(\d+ ignored imports?\))?$", output, flags=re.MULTILINE))


def test_a_new_module_that_makes_a_forbidden_import_breaks_its_contract(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    kept = _lint_imports(tmp_path)
    assert kept.returncode == 0, kept.stdout + kept.stderr

    for files, _ in PROBES.values():
        for path, source in files.items():
            (tmp_path / path).parent.mkdir(exist_ok=True)
            (tmp_path / path).write_text(source)
    broken = _lint_imports(tmp_path)

    assert broken.returncode != 0
    assert _broken_contracts(broken.stdout) == set(PROBES), broken.stdout
    for contract, (_, reported) in PROBES.items():
        assert reported in broken.stdout, f"{contract}: {reported!r} not reported in\n{broken.stdout}"
