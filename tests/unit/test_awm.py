"""AWM's maths (components/algorithms/awm.py, docs/ALGORITHM.md section 11) against an independent float64
transcription of the authors' code (scxue/advantage_weighted_matching @ 12b1397, scripts/train_sd3_awm.py:
compute_log_prob_awm and the training loop's exp_first loss with the Uniform KL and EMA KL), gradients included."""

import pytest
import torch

from components.algorithms.awm import awm_loss, level_indices, matching_log_prob

T, B, SHAPE = 3, 4, (2, 3, 3)
WEIGHTINGS = {"uniform": "Uniform", "t": "t", "t2": "t**2", "huber": "huber", "ghuber": "ghuber"}


def authors_log_prob(model_output, random_noise, clean_latents, timestep, weighting, ghuber_power):
    """compute_log_prob_awm from ``noise_pred`` on: timestep is (N, 1, 1, 1), the rest (N, C, H, W)."""
    model_output = model_output.double()
    log_prob = -(model_output - (random_noise.double() - clean_latents.double())) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if weighting == "t":
        log_prob = log_prob * timestep.view(-1)
    elif weighting == "t**2":
        log_prob = log_prob * timestep.view(-1) ** 2
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * timestep.view(-1)
    elif weighting == "ghuber":
        log_prob = -(torch.pow(-log_prob + 1e-10, ghuber_power)
                     - torch.pow(torch.tensor(1e-10, dtype=log_prob.dtype), ghuber_power)) \
            * timestep.view(-1) / ghuber_power
    return log_prob


def authors_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip_max, advantage_max, model_output,
                 model_output_ref, beta, model_output_ema, ema_beta):
    """The training loop's loss_type exp_first, kl_weight and kl_ema_weight Uniform: log_prob (T, B), the model
    outputs (T, B, C, H, W), advantages (B,)."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    if advantage_max is not None:
        advantages = advantages / adv_clip_max * advantage_max
    ratio = torch.exp(log_prob.view(-1) - old_log_prob.view(-1).detach())
    advantages = advantages.unsqueeze(0).repeat(T, 1).view(-1)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    kl_loss = ((model_output - model_output_ref) ** 2).mean(dim=(2, 3, 4), keepdim=True).mean(dim=0).mean()
    ema_kl_loss = ((model_output - model_output_ema) ** 2).mean(dim=(2, 3, 4), keepdim=True).mean(dim=0).mean()
    return policy_loss + beta * kl_loss + ema_beta * ema_kl_loss


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(T, B, *SHAPE, generator=g, dtype=torch.float64)
    eps = torch.randn(T, B, *SHAPE, generator=g, dtype=torch.float64)
    t = torch.tensor([0.9, 0.55, 0.2], dtype=torch.float64)
    v = (eps - x0 + 0.7 * torch.randn(T, B, *SHAPE, generator=g, dtype=torch.float64)).requires_grad_()
    v_ref = eps - x0 + 0.5 * torch.randn(T, B, *SHAPE, generator=g, dtype=torch.float64)
    v_ema = v.detach() + 0.2 * torch.randn(T, B, *SHAPE, generator=g, dtype=torch.float64)
    adv = torch.tensor([2.0, -7.0, 0.5, -1.5], dtype=torch.float64)  # -7 beyond adv_clip_max
    return x0, eps, t, v, v_ref, v_ema, adv


def _ours(x0, eps, t, v, v_ref, v_ema, adv, old, *, weighting="ghuber", clip_range=0.2, advantage_max=1.0,
          beta=0.003, ema_beta=1.0):
    """The levels one at a time, as the update runs them, each loss scaled by 1 / T."""
    total = 0.0
    for k in range(T):
        log_prob = matching_log_prob(v[k], eps[k] - x0[k], float(t[k]), weighting, 0.25)
        loss, _ = awm_loss(log_prob, old[k], adv, clip_range=clip_range, adv_clip_max=5.0,
                           advantage_max=advantage_max, v=v[k], v_ref=v_ref[k], kl_weight=beta, v_ema=v_ema[k],
                           ema_kl_weight=ema_beta)
        total = total + loss / T
    return total


def _theirs(x0, eps, t, v, v_ref, v_ema, adv, old, *, weighting="ghuber", clip_range=0.2, advantage_max=1.0,
            beta=0.003, ema_beta=1.0):
    flat = (T * B, *SHAPE)
    timesteps = torch.repeat_interleave(t, B).view(-1, 1, 1, 1)
    log_prob = authors_log_prob(v.reshape(flat), eps.reshape(flat), x0.reshape(flat), timesteps,
                                WEIGHTINGS[weighting], 0.25).reshape(T, B)
    return authors_loss(log_prob, old, adv, clip_range, 5.0, advantage_max, v, v_ref, beta, v_ema, ema_beta)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_log_prob_matches_the_authors_for_every_weighting(weighting):
    x0, eps, t, v, *_ = _case()
    theirs = authors_log_prob(v[1], eps[1], x0[1], t[1].expand(B).view(-1, 1, 1, 1), WEIGHTINGS[weighting], 0.25)
    ours = matching_log_prob(v[1].float(), (eps[1] - x0[1]).float(), float(t[1]), weighting, 0.25)
    assert ours.dtype == torch.float64  # computed in float64 from float32 velocities, as the authors
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("weighting", "clip_range", "advantage_max"),
                         [("ghuber", 0.2, 1.0), ("uniform", 0.05, None), ("huber", 0.5, 2.0), ("t2", 0.2, 1.0)])
def test_loss_and_gradient_match_the_authors(weighting, clip_range, advantage_max):
    x0, eps, t, v, v_ref, v_ema, adv = _case()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an old policy a little off, so that some ratios leave the clip range
        exact = torch.stack([authors_log_prob(v[k], eps[k], x0[k], t[k].expand(B).view(-1, 1, 1, 1),
                                              WEIGHTINGS[weighting], 0.25) for k in range(T)])
        old = exact + 0.3 * torch.randn(T, B, generator=g, dtype=torch.float64)
    kw = dict(weighting=weighting, clip_range=clip_range, advantage_max=advantage_max)
    theirs = _theirs(x0, eps, t, v, v_ref, v_ema, adv, old, **kw)
    (grad_theirs,) = torch.autograd.grad(theirs, v)
    ours = _ours(x0, eps, t, v, v_ref, v_ema, adv, old, **kw)
    (grad_ours,) = torch.autograd.grad(ours, v)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-10, atol=1e-14)
    ratio = torch.exp(exact - old)
    assert ((ratio - 1).abs() > clip_range).any() and ((ratio - 1).abs() < clip_range).any()  # both branches


def test_on_policy_the_gradient_is_the_advantage_weighted_matching_gradient():
    """With the old log-prob the forward's own (the update's first optimizer step) the ratio is 1 and the policy
    gradient is -mean_{k,b} A_b d logp_{k,b} / d v: advantage-weighted flow matching."""
    x0, eps, t, v, *_, adv = _case()
    log_probs = [matching_log_prob(v[k], eps[k] - x0[k], float(t[k]), "uniform", 0.25) for k in range(T)]
    total = sum(awm_loss(lp, lp.detach(), adv, clip_range=0.2, adv_clip_max=5.0, advantage_max=1.0)[0] / T
                for lp in log_probs)
    (grad,) = torch.autograd.grad(total, v)
    a = adv.clamp(-5, 5) / 5
    n = torch.tensor(SHAPE).prod()
    # d/dv of -A * (-mean((v - (eps - x0))^2)) / (T B) = 2 A (v - (eps - x0)) / (n T B)
    expected = 2 * a.view(1, B, 1, 1, 1) * (v.detach() - (eps - x0)) / (n * T * B)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def test_zero_advantages_leave_only_the_kl_terms():
    x0, eps, t, v, v_ref, v_ema, _ = _case()
    zero = torch.zeros(B, dtype=torch.float64)
    lp = matching_log_prob(v[0], eps[0] - x0[0], float(t[0]), "ghuber", 0.25)
    loss, metrics = awm_loss(lp, lp.detach() - 0.5, zero, clip_range=0.2, adv_clip_max=5.0, advantage_max=1.0)
    assert float(loss.detach()) == 0.0 and float(metrics["policy_loss"]) == 0.0
    (grad,) = torch.autograd.grad(loss, v)
    assert torch.count_nonzero(grad) == 0
    loss, metrics = awm_loss(lp, lp.detach(), zero, clip_range=0.2, adv_clip_max=5.0, advantage_max=1.0, v=v[0],
                             v_ref=v_ref[0], kl_weight=0.5, v_ema=v_ema[0], ema_kl_weight=2.0)
    kl, ema_kl = ((v[0] - v_ref[0]) ** 2).mean(), ((v[0] - v_ema[0]) ** 2).mean()
    torch.testing.assert_close(loss, 0.5 * kl + 2.0 * ema_kl)
    torch.testing.assert_close(metrics["kl"], kl.detach())
    torch.testing.assert_close(metrics["awm/ema_kl"], ema_kl.detach())


def test_a_kl_term_without_the_trained_velocity_is_refused():
    lp = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs the trained velocity"):
        awm_loss(lp, lp, lp, clip_range=0.2, adv_clip_max=5.0, advantage_max=1.0, v_ref=torch.zeros(2, 3))


def _authors_indices(num_steps, fraction, count, lo, u):
    """discrete / discrete_wo_init of the training loop, in plain Python on the same uniforms."""
    hi = int(num_steps * fraction)
    bounds = [lo + (hi - lo) * j / count for j in range(count + 1)]
    return [int(bounds[j]) + int(u[j] * (int(bounds[j + 1]) - int(bounds[j]))) for j in range(count)]


@pytest.mark.parametrize(("time_sampling", "lo"), [("discrete_wo_init", 1), ("discrete", 0)])
def test_levels_are_one_per_stratum_as_the_authors_draw_them(time_sampling, lo):
    # the published recipe: 14 steps, timestep_fraction 0.9, 6 levels
    seen = set()
    for seed in range(200):
        ours = level_indices(14, 0.9, 6, time_sampling, torch.Generator().manual_seed(seed))
        u = torch.rand(6, generator=torch.Generator().manual_seed(seed)).tolist()
        assert ours == _authors_indices(14, 0.9, 6, lo, u)
        seen.update(ours)
    assert seen == set(range(lo, 12))  # every step below int(14 * 0.9) = 12 from lo, none beyond
    strata = {"discrete_wo_init": [1, 2, 4, 6, 8, 10, 12], "discrete": [0, 2, 4, 6, 8, 10, 12]}[time_sampling]
    ours = level_indices(14, 0.9, 6, time_sampling, torch.Generator().manual_seed(3))
    assert all(a <= i < b for i, a, b in zip(ours, strata[:-1], strata[1:], strict=True))


def test_a_config_with_no_step_to_train_is_refused_and_the_section_has_the_published_defaults():
    from components.errors import ConfigError
    from pipeline.config import TINY_CONFIG, load_config

    config = load_config(TINY_CONFIG, ["train.algorithm=awm"])
    awm = config.train.awm
    assert (awm.train_timesteps, awm.time_sampling, awm.weighting, awm.ghuber_power, awm.advantage_max,
            awm.ema_kl_weight, awm.decay_rate, awm.max_decay) == (6, "discrete_wo_init", "ghuber", 0.25, 1.0, 1.0,
                                                                  0.001, 0.3)
    # int(10 * 0.1) = 1: discrete_wo_init's strata start at step 1, so none is left
    with pytest.raises(ConfigError, match=r"int\(sampling.num_steps \* train.timestep_fraction\)"):
        load_config(TINY_CONFIG, ["train.algorithm=awm", "train.timestep_fraction=0.1"])
    assert load_config(TINY_CONFIG, ["train.algorithm=awm", "train.timestep_fraction=0.1",
                                     "train.awm.time_sampling=discrete"]).train.awm.time_sampling == "discrete"


def test_a_note_names_where_the_shared_settings_depart_from_the_authors_recipe():
    """AWM shares timestep_fraction, beta, skip_zero_advantage and the accumulation with every algorithm, whose
    defaults are not the authors' recipe: one note says where a run departs from it, none where it follows it."""
    from components.trainer.config import algorithm_notes
    from pipeline.config import TINY_CONFIG, load_config

    (note,) = algorithm_notes(load_config(TINY_CONFIG, ["train.algorithm=awm"]))
    assert note.startswith("AWM departs from its authors' recipe (docs/ALGORITHM.md section 11) in ")
    for departure in ("train.timestep_fraction 0.99 (theirs 0.9)", "train.beta 0, no KL",
                      "train.skip_zero_advantage true", "4 optimizer steps an epoch on one worker (theirs 1: "
                      "train.gradient_accumulation_steps 4"):  # 64 samples in micro-batches of 16
        assert departure in note
    recipe = ["train.algorithm=awm", "train.timestep_fraction=0.9", "train.beta=0.001",
              "train.skip_zero_advantage=false", "train.gradient_accumulation_steps=4"]
    assert algorithm_notes(load_config(TINY_CONFIG, recipe)) == []
    (note,) = algorithm_notes(load_config(TINY_CONFIG, [*recipe, "train.gradient_accumulation_steps=2"]))
    assert note.endswith("in 2 optimizer steps an epoch on one worker (theirs 1: train.gradient_accumulation_steps "
                         "4, the epoch's micro-batches)")
