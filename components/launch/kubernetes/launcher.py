"""Launching on Kubernetes: the reward server as a Deployment + Service, training as a KubeRay RayJob followed
to its end, both in the config's ``cluster.namespace``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from components.console import status_line
from components.launch.kubernetes.rayjob_manifest import LaunchableConfig, build_rayjob
from components.launch.kubernetes.reward_deploy import (
    DeployableConfig,
    deploy_to_kubernetes,
    reward_server_name,
    teardown_kubernetes,
)

Log = Callable[[str], None]


class KubernetesLauncherConfig(DeployableConfig, LaunchableConfig, Protocol):
    """What this launcher reads of an experiment config: the reward server's deployment and the RayJob's."""


class KubernetesLauncher:
    """``host``: an API server URL without credentials (``kubectl proxy``, tests); default the in-cluster service
    account or the kubeconfig."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host

    def start_reward_server(self, config: KubernetesLauncherConfig, run_id: str, log: Log = status_line) -> str:
        return deploy_to_kubernetes(config, name=reward_server_name(run_id), namespace=config.cluster.namespace,
                                    run_id=run_id, log=log, host=self.host)

    def stop_reward_server(self, config: KubernetesLauncherConfig, run_id: str, log: Log = status_line) -> None:
        teardown_kubernetes(reward_server_name(run_id), config.cluster.namespace, log=log, host=self.host)

    def train(self, config: KubernetesLauncherConfig, output: str, *, run_id: str, parent_run_id: str | None,
              workers: int, log: Log = status_line) -> None:
        """Submit the run's RayJob (``cluster.workers.replicas`` workers; ``workers`` is for local runs) and
        follow it to its end; a resubmitted one with the same name is followed, not duplicated."""
        from components.launch.kubernetes.rayjob_client import client_for, submit_rayjob

        manifest = build_rayjob(config, run_id=run_id, output=output, parent_run_id=parent_run_id)
        submit_rayjob(manifest, timeout_s=config.cluster.active_deadline_seconds, log=log, api=client_for(self.host))
