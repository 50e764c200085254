"""What a reward server serves and the limits it enforces (the YAML of `python -m components.reward_server
--config`, the same as `flowgrpo reward-server --config`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from components.config_base import Section, format_validation_error, read_yaml_mapping
from components.errors import ConfigError
from components.rewards.config import RewardSpec, check_unique_keys


class Limits(Section):
    max_body_bytes: int = Field(default=64 * 2**20, ge=1024, description="request body size")
    max_images: int = Field(default=256, ge=1, description="images per request")
    max_pixels: int = Field(default=4096 * 4096, ge=1, description="pixels per image, checked before decoding")
    max_request_pixels: int = Field(
        default=256 * 512 * 512, ge=1,
        description="pixels of all images of one request, summed from their headers before anything is decoded "
                    "(default: 256 images of 512 x 512, 192 MiB decoded)",
    )
    max_concurrent_requests: int = Field(
        default=8, ge=1,
        description="requests holding decoded images at once (decoding and scoring); more wait. With "
                    "max_request_pixels it bounds the server's image memory to about 3 x this x that bytes",
    )


class Batching(Section):
    window_ms: float = Field(default=5.0, ge=0, description="how long a batched reward waits for more requests")
    max_batch: int = Field(default=64, ge=1, description="images per batched call")


class ServerSettings(Section):
    rewards: list[RewardSpec] = Field(min_length=1)
    limits: Limits = Field(default_factory=Limits)
    batching: Batching = Field(default_factory=Batching)

    @model_validator(mode="after")
    def _unique(self) -> ServerSettings:
        check_unique_keys(self.rewards, "rewards")
        return self


VLM_JUDGE = "vlm_judge"


def judge_specs(node: Any) -> Iterator[dict[str, Any]]:
    """Every vlm_judge spec in a dumped reward list, also inside wrappers such as ``rank`` (``args.reward``)."""
    if isinstance(node, dict):
        if node.get("name") == VLM_JUDGE and isinstance(node.get("args"), dict):
            yield node
        for value in node.values():
            yield from judge_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from judge_specs(value)


def settings_yaml(rewards: list[RewardSpec], limits: Limits, batching: Batching, judge_url: str | None = None) -> str:
    """The server's ``--config`` YAML: ``rewards``, with every vlm_judge ``base_url`` set to ``judge_url`` when
    given (the run's own judge on a cluster), and the limits and batching."""
    dumped = [s.model_dump(mode="json") for s in rewards]
    if judge_url:
        for spec in judge_specs(dumped):
            spec["args"]["base_url"] = f"{judge_url}/v1"
    settings = ServerSettings(rewards=dumped, limits=limits, batching=batching)
    return yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False)


def load_settings(config: Path | None, reward_names: str | None) -> ServerSettings:
    """From ``--config FILE`` (per-reward options) or ``--rewards a,b`` (defaults, no file)."""
    if (config is None) == (reward_names is None):
        raise ConfigError("give exactly one of --rewards NAME[,NAME...] and --config FILE")
    try:
        if config is None:
            names = [n.strip() for n in reward_names.split(",") if n.strip()]
            return ServerSettings(rewards=[RewardSpec(name=n) for n in names])
        return ServerSettings.model_validate(read_yaml_mapping(config))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(config or "--rewards"))) from exc
