"""The algorithm's sections: `sampling:` (the rollouts) and `train:` (the policy update), with the SDE window
and EMA they hold."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictFloat, StrictInt, field_validator, model_validator

from components.config_base import Section

# Batch sizes are per worker (images in one forward pass on one worker), as upstream flow_grpo's per-GPU
# `sample.train_batch_size` / `train.batch_size`. The old global `train.batch_size` was split across workers,
# so a config that still spells `batch_size` is refused rather than silently changing meaning.
SAMPLES_PER_STEP = ("samples per optimizer step = train.batch_size_per_worker x train.gradient_accumulation_steps "
                    "x workers")
# Bounds on the counts that size loops and tensors, far above any recipe (upstream flow_grpo's largest epochs hold a
# few thousand images; its configs say num_epochs=100000), so a typo such as 1e12 is refused here instead of
# overflowing or allocating without end on the workers.
MAX_EPOCHS = 1_000_000
MAX_IMAGES_PER_EPOCH = 65_536


def _refuse_renamed_batch_size(data: Any, section: str, meaning: str) -> Any:
    if isinstance(data, dict) and "batch_size" in data:
        raise ValueError(
            f"{section}.batch_size was renamed {section}.batch_size_per_worker: {meaning} on ONE worker "
            f"(the old train.batch_size was global and split across workers); {SAMPLES_PER_STEP}"
        )
    return data


class SDEWindowConfig(Section):
    size: int = Field(ge=1, description="number of consecutive SDE steps")
    range: tuple[StrictInt, StrictInt] = Field(
        strict=False,  # a YAML list
        description="[lo, hi]: the window lies within steps lo .. hi - 1, its first step drawn uniformly from "
                    "lo .. hi - size once per epoch (upstream's sde_window_range)",
    )


class SamplingConfig(Section):
    num_steps: int = Field(default=10, ge=2, le=1000, description="sampling steps during training rollouts")
    eval_num_steps: int = Field(default=20, ge=1, le=1000, description="ODE steps for evaluation sampling")
    guidance_scale: float = Field(
        default=1.0, ge=1.0,
        description="CFG scale (SD3), true-CFG scale (Qwen-Image) or embedded guidance (FLUX.1-dev); 1 disables CFG",
    )
    noise_level: float = Field(default=0.7, gt=0, le=10,
                               description="SDE noise level a (dance: DanceGRPO's eta, published 0.3)")
    sde_type: Literal["sde", "cps", "dance"] = Field(
        default="sde",
        description="the rollout's stochastic step: sde (Flow-GRPO, docs/ALGORITHM.md section 1), cps "
                    "(coefficient-preserving, section 2) or dance (DanceGRPO's SDE, constant diffusion "
                    "coefficient noise_level, section 13)",
    )
    same_initial_noise: bool = Field(
        default=False,
        description="a prompt's K images start from one noise and differ only by the SDE steps' noise "
                    "(DanceGRPO's init_same_noise, docs/ALGORITHM.md section 13); an algorithm sampling with the "
                    "ODE does not read it",
    )
    group_size: int = Field(default=8, ge=1, le=MAX_IMAGES_PER_EPOCH, description="images per prompt (K)")
    prompts_per_epoch: int = Field(default=8, ge=1, le=MAX_IMAGES_PER_EPOCH,
                                   description="prompt groups sampled per epoch")
    batch_size_per_worker: int = Field(
        default=16, ge=1, le=MAX_IMAGES_PER_EPOCH,
        description="images per sampling forward pass on one worker (CFG doubles the rows)",
    )
    sde_window: SDEWindowConfig | None = Field(default=None, description="Flow-GRPO-Fast: SDE only on a window")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return _refuse_renamed_batch_size(data, "sampling", "images per sampling forward pass")

    @model_validator(mode="after")
    def _check(self) -> SamplingConfig:
        if self.prompts_per_epoch * self.group_size > MAX_IMAGES_PER_EPOCH:
            raise ValueError(f"sampling.prompts_per_epoch x sampling.group_size = "
                             f"{self.prompts_per_epoch * self.group_size:,} images per epoch; at most "
                             f"{MAX_IMAGES_PER_EPOCH:,}")
        if self.sde_window is not None:
            lo, hi = self.sde_window.range
            size = self.sde_window.size
            if not 0 <= lo <= hi - size or hi > self.num_steps:
                raise ValueError(
                    f"sampling.sde_window.range [lo, hi] must hold the window of size {size} within the "
                    f"{self.num_steps} steps (0 <= lo <= hi - size, hi <= sampling.num_steps), got [{lo}, {hi}]"
                )
        return self


class EMAConfig(Section):
    enabled: bool = Field(default=False, description="keep an EMA of the LoRA weights for saving and eval")
    decay: float = Field(default=0.9, gt=0, lt=1,
                         description="the decay's ceiling: at optimizer step s it is min(decay, (1 + s) / (10 + s))")
    update_every: int = Field(default=8, ge=1,
                              description="optimizer steps between EMA updates (at steps s with (s + 1) % n == 0)")


class TrainConfig(Section):
    algorithm: str = Field(
        default="flow_grpo",
        description="the training algorithm, one of components/algorithms (flow_grpo: the policy gradient on SDE "
                    "transitions; diffusion_nft: DiffusionNFT; ... docs/ALGORITHM.md, \"Choosing the algorithm\"); "
                    "its own settings are the section train.<algorithm>",
    )
    epochs: int = Field(default=40, ge=1, le=MAX_EPOCHS, description="rollout + update rounds")
    learning_rate: float = Field(default=3e-3, gt=0, le=1)
    adam_betas: tuple[StrictFloat, StrictFloat] = Field(
        default=(0.9, 0.999), strict=False, description="AdamW's (beta1, beta2), each in [0, 1)",  # a YAML list
    )
    weight_decay: float = Field(default=1e-4, ge=0)
    adam_eps: float = Field(default=1e-8, gt=0)
    batch_size_per_worker: int = Field(
        default=16, ge=1, le=MAX_IMAGES_PER_EPOCH,
        description="samples per training forward pass (micro-batch) on one worker",
    )
    gradient_accumulation_steps: int = Field(
        default=1, ge=1, le=MAX_IMAGES_PER_EPOCH,
        description=f"micro-batches each worker accumulates per optimizer step; {SAMPLES_PER_STEP}",
    )
    inner_epochs: int = Field(default=1, ge=1, le=100, description="passes over each epoch's samples")
    skip_zero_advantage: bool = Field(
        default=True,
        description="train only the samples whose advantage is not 0 (groups whose rewards all agree, failed rewards), "
                    "spread over the same micro-batches and padded to equal sizes with random zero-advantage samples, "
                    "as upstream; false trains every sample (their policy gradient is 0, they dilute the rest and "
                    "still add KL)",
    )
    clip_range: float = Field(default=0.2, gt=0, lt=1, description="PPO ratio clip epsilon")
    grpo_guard: bool = Field(
        default=False,
        description="GRPO-Guard (flow_grpo, sampling.sde_type sde or dance): the ratio normalised per step, "
                    "exp(s (logp - logp_old) + mean((mu - mu_old)^2) / (2 s)) with s the step's noise std, and the "
                    "policy loss divided by the step's |dt|, as the paper's code (its recipes clip at 2e-6)",
    )
    adv_clip_max: float = Field(default=5.0, gt=0)
    advantage_std: Literal["global", "group", "none"] = Field(
        default="global",
        description="what divides each reward's deviation from its group mean (with reward_aggregation 'sum'): the "
                    "batch's std (global), the group's own (group, GRPO as first published) or nothing (none: "
                    "Dr.GRPO, as verl's norm_adv_by_std_in_grpo false; advantages keep the reward's scale)",
    )
    gdpo_reward_std: Literal["group", "global"] = Field(
        default="group",
        description="with reward_aggregation 'gdpo': each reward is normalised by its std within the group (the "
                    "method's definition, as Flow-Factory) or by its std over the batch, before the weighted sum is "
                    "batch-normalised",
    )
    beta: float = Field(default=0.0, ge=0, description="KL weight to the adapter-disabled model (diffusion_nft: "
                                                       "of the velocities' mean squared difference)")
    timestep_fraction: float = Field(default=0.99, gt=0, le=1,
                                     description="share of the steps trained on (diffusion_nft: of the sampler's "
                                                 "noise levels, drawn per micro-batch)")
    train_cfg: bool = Field(default=False, description="repeat CFG in the training forward")
    max_grad_norm: float = Field(default=1.0, gt=0)
    ema: EMAConfig = Field(default_factory=EMAConfig)
    checkpoint_every: int = Field(default=10, ge=1, description="epochs between checkpoints (the last is kept too)")
    gradient_checkpointing: bool = Field(
        default=False,
        description="recompute each transformer block's activations in the backward pass instead of keeping them "
                    "(training forward only; sampling is unchanged); same gradients, less memory, ~1 more forward",
    )
    compile: bool = Field(
        default=False,
        description="compile each repeated transformer block once with torch.compile (regional compilation) and "
                    "use it in the sampling, training and KL reference forwards; the first epoch pays the compile",
    )
    cfg_uncond_grad: bool = Field(
        default=True,
        description="with train_cfg: let the gradient flow through the unconditional (negative-prompt) CFG branch "
                    "too (the exact gradient, as upstream flow_grpo's current train_sd3.py); false runs that branch "
                    "without gradient, as upstream did between commits 2d76907 and ac4c86e: a cheaper backward and a "
                    "different gradient, missing (1 - scale) x d v_uncond / d theta (docs/ALGORITHM.md section 6)",
    )
    sharding: Literal["none", "fsdp"] = Field(
        default="none",
        description="`fsdp`: shard the frozen transformer weights across the Ray Train workers (PyTorch FSDP2, per "
                    "transformer block); the LoRA stays replicated. Needs Ray Train workers (--ray-workers, a cluster)",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "global_std" in data:
            raise ValueError("train.global_std was replaced by train.advantage_std: global (was true), group (was "
                             "false) or none (Dr.GRPO)")
        if isinstance(data, dict) and "nft" in data:
            raise ValueError("train.nft was renamed train.diffusion_nft (each algorithm's section is "
                             "train.<algorithm>)")
        return _refuse_renamed_batch_size(data, "train", "samples per training forward pass (micro-batch)")

    @field_validator("adam_betas")
    @classmethod
    def _check_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas
