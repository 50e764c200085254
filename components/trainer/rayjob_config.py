"""How a training run is laid out on a Kubernetes cluster as a KubeRay RayJob (the `cluster:` section).

Only the launcher reads it; a local `flowgrpo train` ignores it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from components.config_base import Section

INT32_MAX = 2**31 - 1
# A positive Kubernetes quantity ("2", "500m", "8Gi", "1.5"); the API server would reject anything else.
_QUANTITY = re.compile(r"^(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[mkMGTPE])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Ray's token authentication (kept on in the cluster) needs this Ray version or later (KubeRay validation).
MIN_TOKEN_AUTH_RAY = (2, 52, 0)


def _quantity(value: str) -> str:
    if not _QUANTITY.fullmatch(value) or float(re.sub(r"[^\d.]", "", value) or 0) == 0:
        raise ValueError("not a positive Kubernetes quantity such as '2', '500m' or '8Gi'")
    return value


def _dns_label(value: str) -> str:
    if len(value) > 63 or not _DNS_LABEL.fullmatch(value):
        raise ValueError("not a DNS-1123 label (lowercase letters, digits and '-'; at most 63)")
    return value


def _object_name(value: str | None) -> str | None:
    if value is not None and (len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value)):
        raise ValueError("not a valid Kubernetes object name (a lowercase DNS subdomain)")
    return value


# YAML reads `cpu: 2` as an int; Kubernetes quantities are strings.
Quantity = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int | float) else v),
                     AfterValidator(_quantity)]
# A Secret, ServiceAccount, ... name; None = none.
ObjectName = Annotated[str | None, AfterValidator(_object_name)]


def check_image(image: str) -> str:
    """A pinned image reference: a version tag or a digest, never `latest` nor untagged."""
    if not image or any(c.isspace() for c in image):
        raise ValueError("not an image reference")
    if "@sha256:" in image:
        return image
    name, _, tag = image.rpartition(":")
    if not name or not tag or "/" in tag:  # no tag at all: the last ':' (if any) belongs to a registry port
        raise ValueError("the image has no tag: pin a version (e.g. ghcr.io/flowgrpo/flowgrpo-trainer:0.1.0) "
                         "or a digest (@sha256:...) so every pod of the run gets the same code")
    if tag == "latest":
        raise ValueError("the image uses the moving tag 'latest': pin a version or a digest so every pod "
                         "of the run (and a retry) gets the same code")
    return image


def check_gpu_pool(gpus: int, node_selector: dict[str, str], where: str) -> None:
    """GPUs need a node selector: without one, GPU pods land anywhere the scheduler likes, or stay Pending with no
    hint why."""
    if gpus > 0 and not node_selector:
        raise ValueError(f"GPUs requested without a GPU node pool: set {where}.node_selector "
                         "(e.g. {cloud.google.com/gke-accelerator: nvidia-h100-80gb})")


class HeadConfig(Section):
    cpu: Quantity = Field(default="1", description="CPU request = limit of the Ray head pod (it only coordinates)")
    memory: Quantity = Field(default="4Gi", description="memory request = limit of the Ray head pod")


class Toleration(Section):
    key: str | None = Field(default=None, description="taint key to tolerate, e.g. nvidia.com/gpu")
    operator: Literal["Equal", "Exists"] = Field(default="Equal", description="`Exists` matches any value")
    value: str | None = Field(default=None, description="taint value (operator Equal only)")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="taint effect to tolerate; null = all effects",
    )

    @model_validator(mode="after")
    def _value_matches_operator(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.key is None and self.operator != "Exists":
            raise ValueError("a toleration without a key needs operator Exists")
        return self


class WorkersConfig(Section):
    replicas: int = Field(
        default=1, ge=1, le=1024,
        description="Ray worker pods; the trainer runs one training worker per pod (`--ray-workers`)",
    )
    cpu: Quantity = Field(default="2", description="CPU request = limit of each worker pod")
    memory: Quantity = Field(default="8Gi", description="memory request = limit of each worker pod")
    gpus_per_worker: int = Field(default=0, ge=0, le=16, description="nvidia.com/gpu per worker pod; 0 = CPU only")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="node labels the worker pods must match, e.g. a GPU node pool's label",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="taints the worker pods tolerate, e.g. nvidia.com/gpu NoSchedule",
    )

    @model_validator(mode="after")
    def _gpus_need_a_pool(self) -> WorkersConfig:
        check_gpu_pool(self.gpus_per_worker, self.node_selector, "cluster.workers")
        return self


class RayJobConfig(Section):
    """The KubeRay RayJob a cluster run becomes: where, which image, which pods, how it ends."""

    namespace: Annotated[str, AfterValidator(_dns_label)] = Field(
        default="flowgrpo", description="Kubernetes namespace of the RayJob (and its Secrets)",
    )
    image: Annotated[str, AfterValidator(check_image)] = Field(
        default="ghcr.io/flowgrpo/flowgrpo-trainer:0.1.0",
        description="trainer image for head and workers; a version tag or digest, never `latest`",
    )
    ray_version: str = Field(
        default="2.60.0", pattern=r"^\d+\.\d+\.\d+$", description="Ray version inside the image (rayVersion)",
    )
    ray_token_auth: bool = Field(
        default=True, description="Ray token authentication between submitter, dashboard and nodes (Ray >= 2.52)",
    )
    head: HeadConfig = Field(default_factory=HeadConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    s3_secret: ObjectName = Field(
        default="flowgrpo-s3",
        description="Secret whose keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL_S3 and AWS_REGION "
                    "become the pods' environment (each optional); null = none",
    )
    mlflow_secret: ObjectName = Field(
        default="flowgrpo-mlflow",
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
