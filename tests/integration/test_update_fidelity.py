"""The policy update against upstream's training loop: zero-advantage samples left out
(`train.skip_zero_advantage`), checked against an update on the non-zero samples alone."""

import pytest
import torch
from algorithm_runs import algorithm_on

from components.flow_rl.rollout import Rollout, SamplerSettings, plan_steps, sample_rollout
from components.flow_rl.update import Optimization, micro_batches
from pipeline.config import TINY_CONFIG, load_config

ADVANTAGES = torch.tensor([0.5, 0.0, -1.2, 0.0, 0.8, 0.0, 0.0, 1.1])
REWARDS = torch.full((8,), float("nan"))  # FlowGRPO reads the advantages alone
NONZERO = torch.nonzero(ADVANTAGES).flatten()


@pytest.mark.parametrize(("n", "batch_size", "zeros"), [(8, 4, 4), (8, 4, 5), (10, 4, 9), (7, 3, 7), (16, 4, 0)])
def test_micro_batches_keep_every_nonzero_sample_in_the_same_number_of_equal_batches(n, batch_size, zeros):
    advantages = torch.randn(n).abs() + 0.1
    advantages[torch.randperm(n)[:zeros]] = 0
    batches = micro_batches(advantages, batch_size, True, torch.Generator().manual_seed(0))
    count = -(-n // batch_size)
    assert len(batches) == count and min(len(b) for b in batches) >= 1
    assert max(len(b) for b in batches) - min(len(b) for b in batches) <= 1
    trained = torch.cat(batches)
    assert len(set(trained.tolist())) == len(trained)  # no sample twice
    assert set(torch.nonzero(advantages).flatten().tolist()) <= set(trained.tolist())
    # zero-advantage samples only pad the kept ones up to a multiple of the batch count (at least one per
    # batch, at most every sample)
    kept = n - zeros
    assert len(trained) == min(n, max(count, -(-kept // count) * count))
    plain = micro_batches(advantages, batch_size, False, torch.Generator().manual_seed(0))
    assert sorted(torch.cat(plain).tolist()) == list(range(n)) and [len(b) for b in plain][:-1] == [batch_size] * (
        len(plain) - 1)


def _rollout(keep_means: bool = False, group_size: int = 2):
    config = load_config(TINY_CONFIG, [])
    from components.models.loading import load_model

    model = load_model(config.model, 0)
    torch.manual_seed(0)
    params = model.add_lora(config.model.lora)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.05)
    sde, train = plan_steps(3, 0.99, None)
    settings = SamplerSettings(3, 1.0, 0.7, "sde", 32, sde, train, keep_means=keep_means)
    prompts = ["a cat", "a dog", "a red apple", "a blue car"][:8 // group_size]
    rollout = sample_rollout(model, prompts, group_size, 8, settings, torch.Generator().manual_seed(0),
                             embeds=model.encode_prompts(prompts))
    return model, params, settings, rollout


def _subset(rollout: Rollout, idx: torch.Tensor) -> Rollout:
    return Rollout(rollout.prompts, rollout.embeds, rollout.prompt_index[idx], rollout.sigmas, rollout.sigmas_next,
                   rollout.trajectory[idx], rollout.log_probs[idx], rollout.images[idx.numpy()])


class _Recorder(torch.optim.SGD):
    """Keeps the gradient of each step and leaves the weights as they are (lr 0)."""

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def _gradient(model, params, settings, rollout, advantages, batch_size, skip) -> tuple[list[torch.Tensor], int, dict]:
    """The update's gradient (one optimizer step, no clipping) and the rows the training forwards saw."""
    optimizer = _Recorder(params, lr=0.0)
    algorithm = algorithm_on(model, params, load_config(TINY_CONFIG, []), batch_size_per_worker=batch_size,
                             gradient_accumulation_steps=2, inner_epochs=1, clip_range=0.2, beta=0.0,
                             max_grad_norm=1e9, skip_zero_advantage=skip)
    optim = Optimization(optimizer, params, algorithm.config.train.max_grad_norm)
    rows = []
    hook = model.transformer.register_forward_pre_hook(lambda _m, args, kwargs: rows.append(
        kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        metrics = algorithm.update(rollout, REWARDS[:len(rollout)], advantages, settings,
                                   torch.Generator().manual_seed(1), optim)
    finally:
        hook.remove()
    assert optim.step == 1
    return optimizer.grads, sum(rows), metrics


def test_skipping_zero_advantages_is_the_update_on_the_nonzero_samples_alone_with_fewer_forward_rows():
    model, params, settings, rollout = _rollout()
    skipped, skipped_rows, metrics = _gradient(model, params, settings, rollout, ADVANTAGES, 4, True)
    # independently: the same update, all samples trained, on a rollout holding only the non-zero ones
    alone, alone_rows, _ = _gradient(model, params, settings, _subset(rollout, NONZERO), ADVANTAGES[NONZERO], 2,
                                     False)
    every, every_rows, every_metrics = _gradient(model, params, settings, rollout, ADVANTAGES, 4, False)
    for a, b in zip(skipped, alone, strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    assert any(float(b.abs().max()) > 0 for b in alone)
    # training all 8 dilutes the same policy gradient over twice the samples: half the step
    for a, b in zip(every, alone, strict=True):
        assert float((a - 0.5 * b).abs().max()) <= 1e-5 * float(b.abs().max())
    steps = len(settings.train_steps)
    assert skipped_rows == alone_rows == len(NONZERO) * steps and every_rows == len(ADVANTAGES) * steps
    assert metrics["trained_fraction"] == 0.5 and every_metrics["trained_fraction"] == 1.0


@pytest.mark.parametrize("algorithm", ["flow_grpo", "mix_grpo"])
@pytest.mark.parametrize("shift", ["sample", "batch"])
def test_flow_grpo_and_mix_grpo_hand_its_guard_mean_shift_to_the_guarded_loss(monkeypatch, algorithm, shift):
    """With train.grpo_guard every loss of the update takes train.flow_grpo.guard_mean_shift, MixGRPO's too (it is
    FlowGRPO's key; MixGRPO read a copy of it in its own section, and the documented key was silently lost)."""
    import components.algorithms.flow_grpo as flow_grpo

    model, params, settings, rollout = _rollout(keep_means=True)
    seen, real = [], flow_grpo.flow_grpo_loss
    monkeypatch.setattr(flow_grpo, "flow_grpo_loss",
                        lambda *args, **kwargs: seen.append(kwargs["guard"].mean_shift) or real(*args, **kwargs))
    config = load_config(TINY_CONFIG, [f"train.algorithm={algorithm}", "train.grpo_guard=true",
                                       f"train.flow_grpo.guard_mean_shift={shift}"])
    algorithm = algorithm_on(model, params, config)
    algorithm.update(rollout, REWARDS, ADVANTAGES, settings, torch.Generator().manual_seed(1),
                     Optimization(torch.optim.SGD(params, lr=0.0), params, 1.0))
    assert len(seen) == len(settings.train_steps) and set(seen) == {shift}  # one micro-batch: 8 samples, 16 a batch


def test_online_dpo_pairs_a_groups_best_and_worst_reward_where_clipped_advantages_tie():
    """The authors rank a group's samples by their rewards: two samples whose advantages clip to the same value
    (here adv_clip_max 5 on Dr.GRPO's undivided advantages) still have a best and a worst, which the pair takes."""
    from components.flow_rl.advantages import compute_advantages

    model, params, settings, rollout = _rollout(group_size=4)
    assert rollout.prompt_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    rewards = torch.tensor([-10.0, -20.0, 10.0, 20.0, 0.1, 0.4, 0.3, 0.2])
    advantages = compute_advantages(rewards, rollout.prompt_index, std="none", clip=5.0)
    assert advantages[:4].tolist() == [-5.0, -5.0, 5.0, 5.0]  # the clip ties both ends of the first group
    algorithm = algorithm_on(model, params, load_config(TINY_CONFIG, ["train.algorithm=dpo"]))
    metrics = algorithm.update(rollout, rewards, advantages, settings, torch.Generator().manual_seed(1),
                               Optimization(torch.optim.SGD(params, lr=0.0), params, 1.0))
    assert algorithm.winners.tolist() == [3, 5] and algorithm.losers.tolist() == [1, 4]
    assert metrics["dpo/pairs"] == 2.0 and metrics["trained_fraction"] == 0.5


def test_ema_follows_upstreams_warmup_and_schedule_in_closed_form():
    """Upstream: at optimizer step s, update when (s + 1) % k == 0 with decay min(d, (1 + s) / (10 + s))."""
    from fractions import Fraction

    from components.flow_rl.ema import LoRAEMA

    initial = Fraction(100)
    weight = torch.nn.Parameter(torch.full((1,), float(initial), dtype=torch.float64))
    ema = LoRAEMA([weight], decay=0.9, update_every=8)
    expected, carried = initial, Fraction(1)  # the EMA value, and the share of the initial weights left in it
    for s in range(1, 61):  # 30 epochs of the SD3.5 recipe (2 optimizer steps each)
        with torch.no_grad():
            weight.fill_(float(s))
        ema.step([weight], s)
        if (s + 1) % 8 == 0:
            d = min(Fraction(9, 10), Fraction(1 + s, 10 + s))
            expected, carried = d * expected + (1 - d) * s, carried * d
    assert float(ema.shadow[0]) == pytest.approx(float(expected), rel=1e-12)
    # updates at s = 7, 15, ..., 55: 8/17 * 16/25 * ... * 56/65 = 10% of the initial LoRA is left, not 0.9^7 = 48%
    assert 0.10 < float(carried) < 0.11
    assert ema.decay_at(7) == pytest.approx(8 / 17) and ema.decay_at(80) == 0.9 and ema.decay_at(1000) == 0.9


def test_the_sde_window_lies_inside_its_range_as_upstreams_does():
    """Upstream draws the window's start with random.randint(lo, hi - size): inclusive, inside [lo, hi)."""
    from components.algorithms.flow_grpo import FlowGRPO

    def _sampler_settings(config, generator):
        return FlowGRPO(config, None, []).sampler_settings(generator, 0)  # reads only the config

    config = load_config(TINY_CONFIG, ["sampling.sde_window.size=2", "sampling.sde_window.range=[1,6]"])
    windows = {_sampler_settings(config, torch.Generator().manual_seed(seed)).sde_steps for seed in range(200)}
    assert windows == {(1, 2), (2, 3), (3, 4), (4, 5)}
    settings = _sampler_settings(config, torch.Generator().manual_seed(0))
    assert settings.train_steps == settings.sde_steps  # only the window is trained
    edge = load_config(TINY_CONFIG, ["sampling.sde_window.size=3", "sampling.sde_window.range=[7,10]"])
    assert _sampler_settings(edge, torch.Generator().manual_seed(0)).sde_steps == (7, 8, 9)  # the last steps
