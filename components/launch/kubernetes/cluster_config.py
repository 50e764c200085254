"""How a training run is laid out on a Kubernetes cluster as a KubeRay RayJob (the `cluster:` section).

Only the launcher reads it; a local `flowgrpo train` ignores it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from components import deploy_defaults
from components.config_base import Section
from components.launch.kubernetes.types import (
    INT32_MAX,
    ObjectName,
    Quantity,
    check_image,
    check_shm,
    dns_label,
    pod_resources,
)

# Ray's token authentication (kept on in the cluster) needs this Ray version or later (KubeRay validation).
MIN_TOKEN_AUTH_RAY = (2, 52, 0)


_SHM = ("/dev/shm of {pods} (memory-backed, counted in its memory): Ray's object store gets half (rayStartParams "
        "object-store-memory), NCCL's transport between a pod's GPUs the rest")


class HeadConfig(Section):
    cpu: Quantity = Field(default="1", description="CPU request = limit of the Ray head pod (it only coordinates)")
    memory: Quantity = Field(default="4Gi", description="memory request = limit of the Ray head pod")
    shm_size: Quantity = Field(default="512Mi", description=_SHM.format(pods="the head pod"))

    @model_validator(mode="after")
    def _shm_fits(self) -> HeadConfig:
        check_shm(self.shm_size, self.memory, "cluster.head")
        return self


class WorkersConfig(pod_resources("cluster.workers", "each worker pod", cpu="2", memory="8Gi",
                                  gpu_key="gpus_per_worker")):
    replicas: int = Field(
        default=1, ge=1, le=1024,
        description="Ray worker pods; the trainer runs one training worker per GPU of each (one per pod without "
                    "GPUs): `--ray-workers` = replicas x max(gpus_per_worker, 1)",
    )

    shm_size: Quantity = Field(default="1Gi", description=_SHM.format(pods="each worker pod"))

    @model_validator(mode="after")
    def _shm_fits(self) -> WorkersConfig:
        check_shm(self.shm_size, self.memory, "cluster.workers")
        return self

    @property
    def training_workers(self) -> int:
        """Ray Train workers of the run: one per GPU (each asks for one), or one per CPU-only pod."""
        return self.replicas * max(self.gpus_per_worker, 1)


class RayJobConfig(Section):
    """The KubeRay RayJob a cluster run becomes: where, which image, which pods, how it ends."""

    namespace: Annotated[str, AfterValidator(dns_label)] = Field(
        default="flowgrpo", description="Kubernetes namespace of the RayJob (and its Secrets)",
    )
    image: Annotated[str, AfterValidator(check_image)] = Field(
        default=deploy_defaults.image("trainer"),
        description="trainer image for head and workers; a version tag or digest, never `latest`",
    )
    ray_version: str = Field(
        default="2.60.0", pattern=r"^\d+\.\d+\.\d+$", description="Ray version inside the image (rayVersion)",
    )
    ray_token_auth: bool = Field(
        default=True, description="Ray token authentication between submitter, dashboard and nodes (Ray >= 2.52)",
    )
    network_interface: str = Field(
        default="eth0", pattern=r"^[A-Za-z0-9_.-]{1,15}$",
        description="the pods' interface for the training collective (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME): a "
                    "pod's own is eth0; name another where the GPU nodes have a dedicated network",
    )
    termination_grace_s: int = Field(
        default=120, ge=20, le=3600,
        description="terminationGracePeriodSeconds of the worker pods: a pod being deleted (a drained or preempted "
                    "node) first lets a checkpoint it is writing finish (its preStop hook waits up to this less 10 s)",
    )
    head: HeadConfig = Field(default_factory=HeadConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    s3_secret: ObjectName = Field(
        default=deploy_defaults.S3_SECRET,
        description="Secret whose keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL_S3 and AWS_REGION "
                    "become the pods' environment (each optional); null = none",
    )
    mlflow_secret: ObjectName = Field(
        default=deploy_defaults.MLFLOW_SECRET,
        description="Secret whose keys MLFLOW_TRACKING_URI, MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                    "become the pods' environment (each optional); null = none",
    )
    submission_mode: Literal["K8sJobMode", "HTTPMode", "SidecarMode"] = Field(
        default="K8sJobMode",
        description="how KubeRay submits the entrypoint: a submitter Job (its log is the driver log), an HTTP "
                    "request from the operator, or a sidecar in the head pod",
    )
    shutdown_after_job_finishes: bool = Field(
        default=True, description="delete the Ray cluster when the job ends (frees the GPUs)",
    )
    ttl_seconds_after_finished: int = Field(
        default=3600, ge=0, le=INT32_MAX,
        description="seconds the finished cluster is kept for inspection before deletion",
    )
    active_deadline_seconds: int | None = Field(
        default=86400, ge=1, le=INT32_MAX,
        description="KubeRay fails the RayJob (DeadlineExceeded) after this many seconds; null = no limit",
    )
    backoff_limit: int = Field(
        default=0, ge=0, le=100, description="retries on failure, each on a new Ray cluster",
    )

    @model_validator(mode="after")
    def _auth_needs_ray(self) -> RayJobConfig:
        version = tuple(int(p) for p in self.ray_version.split("."))
        if self.ray_token_auth and version < MIN_TOKEN_AUTH_RAY:
            raise ValueError(f"cluster.ray_token_auth needs Ray >= 2.52.0, got ray_version {self.ray_version}; "
                             "use a newer image or set ray_token_auth: false")
        return self
