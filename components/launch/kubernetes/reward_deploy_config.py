"""How a run's reward server (and its vLLM judge) is deployed: the `reward_deploy:` section.

Only the pipeline's deploy step reads it: on a cluster it becomes a Deployment + ClusterIP Service (see
reward_server.py beside this file); a local run starts the same server as a process and uses only the limits,
the batching and ``ready_timeout_s``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from components import deploy_defaults
from components.launch.kubernetes.types import ObjectName, Toleration, check_image, pod_resources
from components.reward_server.settings import Batching, Limits

Image = Annotated[str, AfterValidator(check_image)]
MODEL_SCHEMES = ("pvc://", "s3://")


def _judge_model(value: str) -> str:
    scheme = next((s for s in MODEL_SCHEMES if value.startswith(s)), None)
    if scheme is None or not value[len(scheme):].strip("/"):
        raise ValueError("not pvc://CLAIM/PATH (a Hugging Face directory on a PersistentVolumeClaim) nor "
                         "s3://BUCKET/PREFIX")
    if scheme == "pvc://" and "/" not in value[len(scheme):].strip("/"):
        raise ValueError("pvc:// needs a claim and a path in it, e.g. pvc://flowgrpo-models/judge")
    return value


class JudgeDeployConfig(pod_resources(
        "reward_deploy.judge", "the judge pod", cpu="8", memory="32Gi", gpus=1,
        node_selector={"nvidia.com/gpu.present": "true"},
        tolerations=[Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")])):
    """The vLLM OpenAI server deployed beside the reward server when a `vlm_judge` reward is served."""

    enabled: bool = Field(
        default=True,
        description="deploy a judge for vlm_judge rewards and point their base_url at it; false = keep their "
                    "base_url (a judge running elsewhere)",
    )
    image: Image = Field(
        default=deploy_defaults.image("vllm-judge"),
        description="`vllm serve` image (images/Dockerfile, target vllm-judge: vllm/vllm-openai:v0.32.0, non-root, "
                    "offline); pinned",
    )
    model: Annotated[str, AfterValidator(_judge_model)] = Field(
        default="pvc://flowgrpo-models/judge",
        description="the judge model, a Hugging Face directory: pvc://CLAIM/PATH (mounted read-only) or "
                    "s3://BUCKET/PREFIX (copied into the pod by an init container with the reward_deploy.s3_secret "
                    "keys); served under the `model` name(s) of the vlm_judge rewards",
    )
    fetch_image: Image = Field(
        default=deploy_defaults.image("components"),
        description="image of the init container that copies an s3:// model (components.storage.download_dir)",
    )
    port: int = Field(default=8000, ge=1024, le=65535, description="port of the judge's OpenAI API")
    args: list[str] = Field(
        default_factory=lambda: ["--max-model-len", "8192", "--gpu-memory-utilization", "0.90",
                                 "--limit-mm-per-prompt", '{"image": 2, "video": 0}'],
        description="further `vllm serve` arguments (model, name, host and port are set by the deploy step); "
                    "the default takes 2 images a prompt, an edit's input and result (vlm_judge `with_inputs`)",
    )
    ready_timeout_s: float = Field(
        default=1800.0, gt=0, description="seconds the judge may take to become ready (a large model loads slowly)",
    )



class RewardDeployConfig(pod_resources("reward_deploy", "each reward server pod (GPUs for model rewards)", cpu="2",
                                        memory="3Gi")):
    """The reward server a pipeline run deploys for its training rewards, and removes when the run ends."""

    image: Image = Field(
        default=deploy_defaults.image("reward-server"),
        description="reward server image (images/Dockerfile, target reward-server); a version tag or digest, never "
                    "`latest`",
    )
    replicas: int = Field(default=1, ge=1, le=64, description="reward server pods behind the Service")
    port: int = Field(default=8600, ge=1024, le=65535, description="port of the reward server and its Service")
    ready_timeout_s: float = Field(
        default=600.0, gt=0, description="seconds the reward server may take to become ready before the step fails",
    )
    unschedulable_grace_s: float = Field(
        default=0.0, ge=0,
        description="seconds a pod may stay Unschedulable before the step fails; raise it where a cluster "
                    "autoscaler adds nodes on demand",
    )
    service_account: ObjectName = Field(
        default=None, description="ServiceAccount of the pods (e.g. one bound to cloud storage); null = default",
    )
    s3_secret: ObjectName = Field(
        default=deploy_defaults.S3_SECRET,
        description="Secret whose AWS_* keys become the pods' environment (reward weights from s3://; the judge's "
                    "s3:// model); null = none",
    )
    limits: Limits = Field(default_factory=Limits, description="request limits the reward server enforces")
    batching: Batching = Field(default_factory=Batching, description="how the reward server batches requests")
    judge: JudgeDeployConfig = Field(
        default_factory=JudgeDeployConfig, description="the vLLM judge, deployed only for vlm_judge rewards",
    )
