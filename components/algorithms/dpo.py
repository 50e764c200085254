"""Online DPO (docs/ALGORITHM.md section 14): ODE rollouts sampled by the trained weights; in each group the best
and the worst sample by reward make a preference pair, trained with Diffusion-DPO's loss on flow matching: the
winner's and the loser's flow-matching errors under the policy minus under the reference (the base model, the
adapter disabled), at a shared noise level and noise, through ``-log sigmoid(-beta / 2 (w_diff - l_diff))``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field

from components.algorithms.base import Algorithm, AlgorithmConfig, JobConfig, MicroBatch, Update, register

if TYPE_CHECKING:
    import torch

    from components.flow_rl.rollout import Rollout, SamplerSettings
    from components.flow_rl.update import Optimization

TRAINING_LEVELS = 1000  # the training scheduler's timesteps the authors index with (u * 1000).long()


class DPOConfig(AlgorithmConfig):
    """Online DPO's own settings (`train.dpo`); the noise levels per micro-batch are int(sampling.num_steps *
    train.timestep_fraction), as the authors' loop over num_train_timesteps."""

    beta: float = Field(default=100.0, gt=0, le=1e6,
                        description="the preference's temperature: loss = -log sigmoid(-beta / 2 ((err_w - ref_w) - "
                                    "(err_l - ref_l))) with err the per-sample mean squared flow-matching error")
    logit_mean: float = Field(default=0.0, ge=-10, le=10,
                              description="the noise level's index among the model's 1000 training levels is "
                                          "int(1000 sigmoid(n)), n ~ Normal(logit_mean, logit_std^2) ...")
    logit_std: float = Field(default=1.0, gt=0, le=10, description="... (logit-normal, as the authors)")


def matching_error(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per sample, the mean over every latent element of ``(v - target)^2``, in at least float32."""
    import torch

    dtype = torch.promote_types(torch.promote_types(v.dtype, target.dtype), torch.float32)
    return ((v.to(dtype) - target.to(dtype)) ** 2).mean(dim=tuple(range(1, v.ndim)))


def dpo_loss(
    policy_w: torch.Tensor,
    policy_l: torch.Tensor,
    ref_w: torch.Tensor,
    ref_l: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Diffusion-DPO's loss on flow matching for a batch of pairs, each argument one error per pair (winner ``w``,
    loser ``l``; policy and reference): ``w_diff = policy_w - ref_w``, ``l_diff = policy_l - ref_l``, loss
    ``mean_pairs -log sigmoid(-beta / 2 (w_diff - l_diff))``. Gradients flow through the policy's errors only.
    Returns the loss and detached metrics (implicit_acc: the share of pairs whose inside term is positive)."""
    import torch

    w_diff = policy_w - ref_w.detach()
    l_diff = policy_l - ref_l.detach()
    inside = -0.5 * beta * (w_diff - l_diff)
    loss = -torch.nn.functional.logsigmoid(inside).mean()
    metrics = {"policy_loss": loss.detach(), "dpo/implicit_acc": (inside.detach() > 0).double().mean(),
               "dpo/w_diff": w_diff.detach().mean(), "dpo/l_diff": l_diff.detach().mean(),
               "dpo/winner_error": policy_w.detach().mean(), "dpo/loser_error": policy_l.detach().mean()}
    return loss, metrics


def preference_pairs(prompt_index: torch.Tensor, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The (winner, loser) sample indices, one pair per group (``prompt_index``): the first sample with the group's
    highest reward and the first with its lowest, groups in increasing index, ranked by the rewards themselves as the
    authors do (a clipped advantage can tie two samples whose rewards differ); a failed (non-finite) reward is no
    candidate. A group whose highest reward equals its lowest (one sample, equal rewards, all failed) has no
    preference and gives no pair; their number is returned third."""
    import torch

    groups, r = prompt_index.cpu(), rewards.cpu()
    winners, losers, unpaired = [], [], 0
    for group in torch.unique(groups).tolist():
        members = ((groups == group) & torch.isfinite(r)).nonzero().flatten()
        values = r[members]
        if len(members) < 2 or values.max() == values.min():
            unpaired += 1
            continue
        winners.append(int(members[torch.argmax(values)]))
        losers.append(int(members[torch.argmin(values)]))
    return torch.tensor(winners, dtype=torch.long), torch.tensor(losers, dtype=torch.long), unpaired


def training_level(grid: list[float], generator: torch.Generator, logit_mean: float, logit_std: float) -> float:
    """A noise level of ``grid`` (the model's training levels, from 1 down) at index ``int(len(grid) u)``,
    ``u = sigmoid(n)``, ``n ~ Normal(logit_mean, logit_std^2)``: the authors' logit-normal timestep sampling."""
    import torch

    u = torch.sigmoid(logit_mean + logit_std * torch.randn((), generator=generator, dtype=torch.float64))
    return grid[min(int(u * len(grid)), len(grid) - 1)]


@register("dpo")
class DPO(Algorithm):
    name = "Online DPO"
    Config = DPOConfig

    @classmethod
    def check(cls, config: JobConfig) -> list[str]:
        notes = super().check(config)
        if config.train.beta > 0:
            notes.append("train.beta is not used: Online DPO's reference term is its KL anchor (train.dpo.beta "
                         "sets its strength)")
        return notes

    def update(self, rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor, sampler: SamplerSettings,
               generator: torch.Generator, optim: Optimization) -> dict[str, float]:
        """Train on this worker's pairs; returns mean metrics.

        The pairs are split into ``ceil(groups / pairs_per_batch)`` micro-batches of at most
        ``max(1, train.batch_size_per_worker // 2)`` pairs (a forward holds the winners and the losers), so every
        worker, holding whole groups, takes the same forwards and optimizer steps whatever its number of pairs; a
        micro-batch left without a pair trains a placeholder pair with weight 0. A pair takes two samples' places,
        so the other algorithms' gradient accumulation can exceed DPO's micro-batches: the last step of an epoch
        then takes what is left."""
        import torch

        from components.flow_rl.update import noise_generator

        self.winners, self.losers, unpaired = preference_pairs(rollout.prompt_index, rewards)
        per_batch = max(1, self.config.train.batch_size_per_worker // 2)
        self.batch_count = math.ceil(len(torch.unique(rollout.prompt_index)) / per_batch)
        self.noise = noise_generator(generator, self.model.device)
        metrics = super().update(rollout, rewards, advantages, sampler, generator, optim)
        metrics.update({"dpo/pairs": float(len(self.winners)), "dpo/unpaired_groups": float(unpaired)})
        return metrics

    def micro_batches(self, update: Update) -> list[torch.Tensor]:
        """Pair indices."""
        import torch

        return list(torch.randperm(len(self.winners), generator=update.generator).tensor_split(self.batch_count))

    def prepare(self, update: Update, indices: torch.Tensor) -> MicroBatch:
        """The winners then the losers of the pairs ``indices``; int(num_steps * train.timestep_fraction) noise
        levels and a noise per level and pair, shared by its winner and loser; the reference forwards (adapter
        disabled). A term: (noised latents, noise, level, reference velocity)."""
        import torch

        from components.flow_rl.sde import forward_noise

        train, section, model, sampler = self.config.train, self.section, self.model, update.sampler
        if len(indices):
            batch = MicroBatch(update, torch.cat([self.winners[indices], self.losers[indices]]))
        else:
            batch = MicroBatch(update, torch.zeros(2, dtype=torch.long), weight=0.0)
        grid = model.sigmas(TRAINING_LEVELS, sampler.resolution)[:-1].tolist()  # the terminal 0 is the clean sample
        levels = [training_level(grid, update.generator, section.logit_mean, section.logit_std)
                  for _ in range(max(1, int(sampler.num_steps * train.timestep_fraction)))]
        x0 = batch.x0
        noises = [torch.randn(x0[:len(x0) // 2].shape, generator=self.noise, device=model.device, dtype=x0.dtype)
                  for _ in levels]
        noised = [forward_noise(x0, torch.cat([eps, eps]), s) for eps, s in zip(noises, levels, strict=True)]
        with torch.no_grad(), model.adapter_disabled():
            v_ref = [model.predict_velocity(x, s, batch.cond, update.guidance) for x, s in zip(
                noised, levels, strict=True)]
        batch.terms = list(zip(noised, noises, levels, v_ref, strict=True))
        return batch

    def loss(self, batch: MicroBatch, term: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        x_t, eps, s, v_ref = term
        target = torch.cat([eps, eps]) - batch.x0
        err = matching_error(self.model.predict_velocity(x_t, s, batch.cond, batch.update.guidance), target)
        ref = matching_error(v_ref, target)
        return dpo_loss(*err.chunk(2), *ref.chunk(2), beta=self.section.beta)
