"""The launch layer's interface: what a launcher reads of an experiment config (``LauncherConfig``), what it does
(``Launcher``), and the launcher for a place (``launcher_for``): this machine (``local.LocalLauncher``) or Kubernetes
(``kubernetes.launcher.KubernetesLauncher``). The pipeline's steps are handed one; a KFP component builds it from the
pipeline's ``launcher`` parameter. The launchers satisfy the Protocols by their shape and import nothing of this
module, so no import comes back to it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from components.errors import ConfigError

if TYPE_CHECKING:
    from components.launch.kubernetes.cluster_config import RayJobConfig
    from components.launch.kubernetes.reward_deploy_config import RewardDeployConfig
    from components.rewards.registry import RewardSpec

LOCAL_PREFIX = "local:"
KUBERNETES = "kubernetes"


class LauncherConfig(Protocol):
    """What a launcher reads of an experiment config (``pipeline.config.ExperimentConfig``): the rewards its server
    serves and how that server is deployed, the Ray cluster, and the config itself (the local launcher trains it as
    it is, the Kubernetes one puts what the run is handed of it, ``run_data``, in the RayJob, named by a hash of the
    whole ``model_dump``)."""

    rewards: list[RewardSpec]
    reward_deploy: RewardDeployConfig
    cluster: RayJobConfig

    def model_dump(self, *, mode: str = ...) -> dict[str, Any]: ...

    def run_data(self) -> dict[str, Any]: ...


class Launcher(Protocol):
    def start_reward_server(self, config: LauncherConfig, run_id: str, log: Callable[[str], None]) -> str:
        """Start the run's reward server for ``config.rewards`` and return its URL once it is ready."""

    def stop_reward_server(self, config: LauncherConfig, run_id: str, log: Callable[[str], None]) -> None:
        """Stop what ``start_reward_server`` started for ``run_id``; fine when nothing (or part of it) is there."""

    def train(self, config: LauncherConfig, output: str, *, run_id: str, parent_run_id: str | None, workers: int,
              log: Callable[[str], None]) -> None:
        """Train ``config`` into ``output`` and return when the training has finished (raise when it failed)."""


def launcher_for(where: str) -> Launcher:
    """``kubernetes`` (a Deployment and a RayJob in the config's ``cluster.namespace``) or ``local:STATE_DIR``
    (processes on this machine, recorded under STATE_DIR; what ``flowgrpo run --local`` passes)."""
    if where == KUBERNETES:
        from components.launch.kubernetes.launcher import KubernetesLauncher

        return KubernetesLauncher()
    if where.startswith(LOCAL_PREFIX) and where[len(LOCAL_PREFIX):]:
        from components.launch.local import LocalLauncher

        state_dir = Path(where[len(LOCAL_PREFIX):])
        if not state_dir.is_dir():  # a cluster run pointed at a laptop's folder: its pods have no such folder
            raise ConfigError(f"launcher {where!r}: {state_dir} is not a folder on this machine; local launchers are "
                              f"what `flowgrpo run --local` passes (it creates the folder), a cluster run uses "
                              f"{KUBERNETES!r}")
        return LocalLauncher(state_dir)
    raise ConfigError(f"launcher {where!r}: use {KUBERNETES!r} or '{LOCAL_PREFIX}STATE_DIR'")
