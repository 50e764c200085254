"""Kubernetes field types shared by every pod the product creates (the RayJob's, the reward server's): positive
quantities, object names, tolerations, pinned image references and the GPU-pool check. Validation only; no
Kubernetes client here."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, create_model, model_validator

from components import deploy_defaults
from components.config_base import Section

INT32_MAX = 2**31 - 1
# A positive Kubernetes quantity ("2", "500m", "8Gi", "1.5"); the API server would reject anything else.
_QUANTITY = re.compile(r"^(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[mkMGTPE])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _quantity(value: str) -> str:
    if not _QUANTITY.fullmatch(value) or float(re.sub(r"[^\d.]", "", value) or 0) == 0:
        raise ValueError("not a positive Kubernetes quantity such as '2', '500m' or '8Gi'")
    return value


_FACTORS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
            "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def quantity_value(value: str) -> float:
    """A valid quantity as a number: "500m" -> 0.5, "8Gi" -> 8 x 2^30."""
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    return float(match.group(1)) * _FACTORS.get(match.group(3) or "", 1)


# Ray's object store lives in /dev/shm and needs at least 75 MiB; it gets half of the volume (object_store_bytes)
MIN_SHM_BYTES = 256 * 2**20


def object_store_bytes(shm_size: str) -> int:
    """Ray's object store on a pod with ``shm_size`` of /dev/shm: half of it, the other half left to NCCL's
    shared-memory transport between the GPUs of one pod (Ray would otherwise size its store from the pod's memory
    and spill past the volume)."""
    return int(quantity_value(shm_size) // 2)


def check_shm(shm_size: str, memory: str, where: str) -> None:
    if quantity_value(shm_size) < MIN_SHM_BYTES:
        raise ValueError(f"{where}.shm_size {shm_size} is below 256Mi: Ray's object store takes half of it and needs "
                         "75 MiB")
    if quantity_value(shm_size) > quantity_value(memory):
        raise ValueError(f"{where}.shm_size {shm_size} exceeds {where}.memory {memory}: /dev/shm is memory-backed "
                         "and counted in the pod's memory limit")


def dns_label(value: str) -> str:
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
        raise ValueError(f"the image has no tag: pin a version (e.g. {deploy_defaults.image('trainer')}) "
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


class PodResources(Section):
    """Resources and placement of one kind of pod (requests = limits; GPUs only on a GPU pool). A section gets
    its fields from ``pod_resources``, with that pod's defaults."""

    GPU_KEY: ClassVar[str] = "gpus"
    WHERE: ClassVar[str] = ""

    @model_validator(mode="after")
    def _gpus_need_a_pool(self) -> PodResources:
        check_gpu_pool(getattr(self, self.GPU_KEY), self.node_selector, self.WHERE)
        return self


def pod_resources(where: str, pods: str, *, cpu: str, memory: str, gpus: int = 0, gpu_key: str = "gpus",
                  node_selector: dict[str, str] | None = None,
                  tolerations: list[Toleration] | None = None) -> type[PodResources]:
    """The base of the section at ``where`` (e.g. ``cluster.workers``) whose ``pods`` (e.g. "each worker pod")
    take ``cpu``, ``memory``, ``gpus`` (named ``gpu_key``), a node selector and tolerations."""
    selector, tolerated = dict(node_selector or {}), list(tolerations or [])
    section = create_model(
        f"PodResources[{where}]", __base__=PodResources,
        cpu=(Quantity, Field(default=cpu, description=f"CPU request = limit of {pods}")),
        memory=(Quantity, Field(default=memory, description=f"memory request = limit of {pods}")),
        node_selector=(dict[str, str], Field(default_factory=lambda: dict(selector),
                                             description=f"node labels {pods} must match, e.g. a GPU pool's")),
        tolerations=(list[Toleration], Field(default_factory=lambda: list(tolerated),
                                             description=f"taints {pods} tolerates, e.g. nvidia.com/gpu NoSchedule")),
        **{gpu_key: (int, Field(default=gpus, ge=0, le=16, description=f"nvidia.com/gpu of {pods}; 0 = CPU only"))},
    )
    section.GPU_KEY, section.WHERE = gpu_key, where
    return section
