"""launcher_for: the pipeline's `launcher` parameter names where a run's parts start."""

from pathlib import Path

import pytest

from components.errors import ConfigError
from components.launch.interface import launcher_for
from components.launch.kubernetes.launcher import KubernetesLauncher
from components.launch.local import LocalLauncher


def test_kubernetes_and_local_launchers_by_name(tmp_path):
    assert isinstance(launcher_for("kubernetes"), KubernetesLauncher)
    local = launcher_for(f"local:{tmp_path}")
    assert isinstance(local, LocalLauncher) and local.state_dir == Path(tmp_path)


@pytest.mark.parametrize("value", ["", "local:", "Kubernetes", "k8s", "local"])
def test_an_unknown_launcher_is_one_line_naming_both_forms(value):
    with pytest.raises(ConfigError, match=r"use 'kubernetes' or 'local:STATE_DIR'"):
        launcher_for(value)


def test_a_local_launcher_needs_its_folder_on_this_machine(tmp_path):
    """A cluster run whose `launcher` parameter names a laptop's folder fails at its first step, saying why."""
    with pytest.raises(ConfigError, match=r"is not a folder on this machine; .*a cluster run uses 'kubernetes'"):
        launcher_for(f"local:{tmp_path / 'elsewhere'}")
