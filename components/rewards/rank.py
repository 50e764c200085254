"""`rank`: a groupwise wrapper that replaces any pointwise reward by its rank within the prompt group."""

from __future__ import annotations

from typing import Any

import numpy as np

from components.rewards.base import GroupwiseReward, RewardOutput
from components.rewards.registry import RankArgs, RewardCache


class Rank(GroupwiseReward):
    """``argsort(argsort(s)) / K`` over the group's valid scores (docs/ALGORITHM.md section 8).

    ``args.reward`` is the wrapped reward's config, e.g. ``{name: jpeg_compressibility}``. Samples whose
    inner score failed stay failed and are not ranked.
    """

    name = "rank"
    Args = RankArgs

    def __init__(self, args: RankArgs, cache: RewardCache) -> None:
        self.inner = cache.get(args.reward, "rank.reward")
        if self.inner.kind != "pointwise":
            raise ValueError(f"rank wraps a pointwise reward; {args.reward.name!r} is {self.inner.kind}")

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        inner = self.inner(images, prompts, metadata)
        valid = np.flatnonzero(np.isfinite(inner.scores))
        scores = np.full(len(images), np.nan)
        if valid.size:
            ranks = np.argsort(np.argsort(inner.scores[valid], kind="stable"), kind="stable")
            scores[valid] = ranks / valid.size
        return RewardOutput(scores=scores, errors=list(inner.errors), extra={"inner": inner.scores.tolist()})
