"""What a reward server serves and the limits it enforces (the YAML of `python -m components.reward_server
--config`, the same as `flowgrpo reward-server --config`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from components.config_base import Section, chained, check_strings, format_validation_error, read_yaml_mapping
from components.errors import ConfigError
from components.rewards.registry import RewardSpec, check_unique_keys

# A request's body, per pixel of its images: base64 of raw RGB (what the trainer sends: 3 bytes, 4 characters) and
# about the worst a PNG can be (incompressible); a JPEG is far smaller. Plus an allowance for the prompts, metadata
# and JSON punctuation of the images of one request.
BODY_BYTES_PER_PIXEL = 4
BODY_ALLOWANCE_BYTES = 2**20
DEFAULT_REQUEST_PIXELS = 16 * 512 * 512
# what the transport timeouts were called: each names the part of a request it bounds now
RENAMED_TIMEOUTS = {"header_timeout_s": "request_head_timeout_s", "body_timeout_s": "body_grace_s"}


def body_bytes_for(request_pixels: int) -> int:
    """The body size a request of ``request_pixels`` pixels needs at most: ``max_body_bytes``'s default."""
    return BODY_BYTES_PER_PIXEL * request_pixels + BODY_ALLOWANCE_BYTES


class Limits(Section):
    max_body_bytes: int = Field(
        default=body_bytes_for(DEFAULT_REQUEST_PIXELS), ge=1024,
        description="request body size, refused (413) from Content-Length or while reading. Default: derived from "
                    "max_request_pixels, 4 bytes per pixel (base64 of raw RGB, or an incompressible PNG) + 1 MiB "
                    "for prompts and metadata (17 MiB for the default 4 Mi pixels)",
    )
    max_images: int = Field(default=256, ge=1, description="images per request")
    max_pixels: int = Field(default=4096 * 4096, ge=1, description="pixels per image, checked before decoding")
    max_frames: int = Field(
        default=81, ge=1,
        description="frames per video (Wan2.1's default length); a video's frames count as images against "
                    "max_request_pixels, so video recipes raise that budget too",
    )
    max_request_pixels: int = Field(
        default=DEFAULT_REQUEST_PIXELS, ge=1,
        description="pixels of all images of one request, summed from their headers before anything is decoded "
                    "(default: 16 images of 512 x 512, 12 MiB decoded: a sampling batch of every shipped recipe; "
                    "a groupwise reward, sent an epoch's images per worker at once, needs more)",
    )
    max_concurrent_requests: int = Field(
        default=8, ge=1,
        description="requests parsed, decoded and scored at once; more wait, their bodies read (bodies held at "
                    "once, read or waiting: at most 2 x this x max_body_bytes, 272 MiB by default; more get 503). "
                    "With max_request_pixels it bounds the decoded images to about 3 copies x this x that x 3 bytes",
    )
    max_json_values: int = Field(
        default=100_000, ge=64,
        description="JSON values (strings, numbers, lists, objects) in a body, counted from its commas and brackets "
                    "before it is parsed (413): a parsed value costs ~50-100 bytes, so many short ones in a body "
                    "within max_body_bytes would cost ~10x its size",
    )
    request_head_timeout_s: float = Field(
        default=10.0, gt=0,
        description="a request's line and headers (its head) must arrive within this of the connection opening or of "
                    "the previous response, else the connection is closed: it bounds a kept-alive connection's wait "
                    "for its next request too",
    )
    body_grace_s: float = Field(
        default=10.0, gt=0,
        description="the time a body may take before min_body_bytes_per_s applies: it must arrive within this + its "
                    "bytes / min_body_bytes_per_s, else 408 and the connection is closed",
    )
    min_body_bytes_per_s: int = Field(default=2**20, ge=1, description="see body_grace_s")

    @model_validator(mode="before")
    @classmethod
    def _body_from_pixels(cls, data: Any) -> Any:
        """A pixel budget that is given, and no body size: the body size follows it. A timeout spelt by its old name
        is refused naming the new one."""
        if isinstance(data, dict):
            for old, new in RENAMED_TIMEOUTS.items():
                if old in data:
                    raise ValueError(f"{old} was renamed {new}")
        if isinstance(data, dict) and "max_body_bytes" not in data and isinstance(data.get("max_request_pixels"), int):
            return {**data, "max_body_bytes": body_bytes_for(data["max_request_pixels"])}
        return data


class Batching(Section):
    window_ms: float = Field(default=5.0, ge=0, description="how long a batched reward waits for more requests")
    max_batch: int = Field(default=64, ge=1, description="images per batched call (a video counts its frames; a "
                                                          "call waits for no more once it holds this many)")


class ServerSettings(Section):
    rewards: list[RewardSpec] = Field(min_length=1)
    limits: Limits = Field(default_factory=Limits)
    batching: Batching = Field(default_factory=Batching)

    @model_validator(mode="before")
    @classmethod
    def _check_strings(cls, data: Any) -> Any:
        return check_strings(data)

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
        source = str(config or "--rewards")
        raise ConfigError(format_validation_error(exc, source)) from chained(exc, source)
