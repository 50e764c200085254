"""Reward names -> classes, and building rewards from their config."""

from __future__ import annotations

import inspect

from components.errors import RewardError
from components.rewards.base import Reward
from components.rewards.brightness import Brightness
from components.rewards.config import RewardSpec
from components.rewards.jpeg import JpegCompressibility, JpegIncompressibility

REWARDS: dict[str, type[Reward]] = {
    cls.name: cls for cls in (Brightness, JpegCompressibility, JpegIncompressibility)
}


def build_reward(spec: RewardSpec, where: str = "rewards") -> Reward:
    """Instantiate ``spec``; unknown names and bad arguments raise ``RewardError`` naming ``where``."""
    cls = REWARDS.get(spec.name)
    if cls is None:
        raise RewardError(f"{where}.name: unknown reward {spec.name!r}; known: {', '.join(sorted(REWARDS))}")
    try:
        inspect.signature(cls).bind(**spec.args)
    except TypeError as exc:
        raise RewardError(f"{where}.args: {exc} (reward {spec.name!r})") from exc
    return cls(**spec.args)
