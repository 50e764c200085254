"""MixGRPO's maths (docs/ALGORITHM.md section 12): the sliding window against upstream's GRPOTrainingStates, and
the DPM-Solver++(2M) ODE steps after it (MixGRPO-Flash) against a float64 transcription of upstream's sampler and
against closed forms."""

import itertools
import math

import numpy as np
import pytest
import torch

from components.algorithms.mix_grpo import window_steps
from components.flow_rl.rollout import SamplerSettings, sample_rollout, step_path
from components.flow_rl.sde import data_prediction, dpm2_step, euler_step, sde_step_with_logprob

# -- the window -------------------------------------------------------------------------------------


class UpstreamWindow:
    """Tencent-Hunyuan/MixGRPO fastvideo/utils/grpo_states.py GRPOTrainingStates (zqqqqz2000/MixGRPO@75c797f),
    sample_strategy "progressive" with prog_overlap and roll_back, max_timesteps = sampling_steps - 2
    (fastvideo/train_grpo_flux.py): one get_current_timesteps / update_iteration per training step."""

    def __init__(self, num_steps, group_size, overlap_step, iters_per_group):
        self.max_timesteps = num_steps - 2
        self.group_size, self.overlap_step, self.iters = group_size, overlap_step, iters_per_group
        self.cur_timestep, self.cur_iter_in_group = 0, 0

    def current(self):
        return list(range(self.cur_timestep, min(self.cur_timestep + self.group_size, self.max_timesteps)))

    def update(self):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters:
            self.cur_iter_in_group = 0
            self.cur_timestep += self.overlap_step
        if self.cur_timestep > self.max_timesteps:
            self.cur_timestep = 0
            self.cur_iter_in_group = 0


@pytest.mark.parametrize(("num_steps", "size", "stride", "interval"), [
    (25, 4, 1, 25),  # MixGRPO's published settings
    (25, 4, 1, 20),  # MixGRPO-Flash
    (25, 4, 0, 20),  # MixGRPO-Flash*
    (10, 2, 1, 3), (10, 3, 2, 1), (12, 4, 3, 2), (10, 2, 4, 5), (3, 2, 1, 1),
])
def test_window_follows_upstreams_schedule_without_its_empty_window(num_steps, size, stride, interval):
    upstream = UpstreamWindow(num_steps, size, stride, interval)
    theirs = []
    for _ in range(6 * interval * num_steps):
        theirs.append(tuple(upstream.current()))
        upstream.update()
    # upstream visits start == max_timesteps, an empty window (no policy gradient for `interval` steps), before it
    # rolls back; ours rolls back at once: the same windows in the same order with the empty ones left out
    expected = [w for w in theirs if w]
    ours = [window_steps(e, num_steps, size, stride, interval) for e in range(len(expected))]
    assert ours == expected
    assert all(w == tuple(range(w[0], w[0] + len(w))) for w in ours)


def test_window_moves_by_epoch_only_and_refuses_too_few_steps():
    assert window_steps(24, 25, 4, 1, 25) == (0, 1, 2, 3) and window_steps(25, 25, 4, 1, 25) == (1, 2, 3, 4)
    assert window_steps(22 * 25, 25, 4, 1, 25) == (22,) and window_steps(23 * 25, 25, 4, 1, 25) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="num_steps >= 3"):
        window_steps(0, 2, 1, 1, 1)


def test_config_notes_the_unread_sde_window_and_refuses_too_few_steps():
    from components.errors import ConfigError
    from components.trainer.config import algorithm_notes
    from pipeline.config import TINY_CONFIG, load_config

    config = load_config(TINY_CONFIG, ["train.algorithm=mix_grpo", "sampling.sde_window={size: 2, range: [0, 5]}"])
    assert any("sampling.sde_window is not used" in note for note in algorithm_notes(config))
    assert config.train.mix_grpo.window_size == 4 and config.train.mix_grpo.ode_solver == "euler"
    with pytest.raises(ConfigError, match="num_steps >= 3"):
        load_config(TINY_CONFIG, ["train.algorithm=mix_grpo", "sampling.num_steps=2"])
    with pytest.raises(ConfigError, match="tail_ratio"):
        load_config(TINY_CONFIG, ["train.mix_grpo.tail_ratio=0"])


def test_the_guard_mean_shift_is_flow_grpos_key_read_by_mix_grpo_and_refused_in_its_own_section():
    """MixGRPO's policy gradient is FlowGRPO's: its one key train.flow_grpo.guard_mean_shift (the loss reading it:
    tests/integration/test_update_fidelity.py), never a second copy under train.mix_grpo that the documented key
    would silently lose to."""
    from components.errors import ConfigError
    from components.trainer.config import algorithm_notes
    from pipeline.config import TINY_CONFIG, load_config

    mix = ["train.algorithm=mix_grpo", "train.flow_grpo.guard_mean_shift=batch"]
    assert algorithm_notes(load_config(TINY_CONFIG, [*mix, "train.grpo_guard=true"])) == []
    assert algorithm_notes(load_config(TINY_CONFIG, mix)) == [
        "train.flow_grpo.guard_mean_shift is not used: train.grpo_guard is false"]
    with pytest.raises(ConfigError, match=r"train\.mix_grpo\.guard_mean_shift.*unknown key"):
        load_config(TINY_CONFIG, ["train.algorithm=mix_grpo", "train.mix_grpo.guard_mean_shift=batch"])


# -- the solver: closed forms -------------------------------------------------------------------------


def _solve(velocity, sigmas, x, solver):
    previous = None
    for s, s_next in itertools.pairwise(sigmas):
        v = velocity(x, s)
        x_next = dpm2_step(v, s, s_next, x, previous) if solver == "dpm2" else euler_step(v, s, s_next, x)
        previous = (data_prediction(v, s, x), s)
        x = x_next
    return x


def test_dpm2_is_exact_when_the_data_is_one_point():
    # data x0*: the flow is x = (1 - sigma) x0* + sigma eps, v = (x - x0*) / sigma; DPM-Solver++ integrates the
    # exponential-integrator form exactly when the data prediction is constant, on any grid
    x0 = torch.tensor([0.7, -1.3, 2.0])
    eps = torch.tensor([1.1, 0.4, -0.9])
    sigmas = [1.0, 0.93, 0.71, 0.6, 0.32, 0.2, 0.05]
    x = _solve(lambda x, s: (x - x0) / s, sigmas, eps, "dpm2")
    assert torch.allclose(x, (1 - sigmas[-1]) * x0 + sigmas[-1] * eps, atol=1e-6)


def _gaussian_flow(mu, std):
    """Data N(mu, std^2): the ODE from eps at sigma 1 is x(sigma) = (1 - sigma) mu + g(sigma) eps with
    g = sqrt((1 - sigma)^2 std^2 + sigma^2), so x(0) = mu + std eps and v = -mu + g'/g (x - (1 - sigma) mu)."""

    def velocity(x, s):
        g2 = (1 - s) ** 2 * std**2 + s**2
        return -mu + (s - (1 - s) * std**2) / g2 * (x - (1 - s) * mu)

    return velocity


@pytest.mark.parametrize(("solver", "order"), [("dpm2", 2.0), ("euler", 1.0)])
def test_convergence_order_on_the_gaussian_flow(solver, order):
    # from sigma 0.9 to 0.05 on a grid uniform in the log-SNR, where the multistep theory's step h shrinks
    # everywhere as the steps double (near sigma 0 a shifted grid's last log-SNR steps do not shrink)
    mu, std, (a, b) = 0.8, 0.6, (0.9, 0.05)
    eps = torch.linspace(-2, 2, 9, dtype=torch.float64)
    errors = []
    for n in (16, 32, 64, 128):
        sigmas = [1 / (1 + math.exp(lam)) for lam in np.linspace(math.log((1 - a) / a), math.log((1 - b) / b), n + 1)]
        start, exact = ((1 - s) * mu + math.sqrt((1 - s) ** 2 * std**2 + s**2) * eps for s in (sigmas[0], sigmas[-1]))
        x = _solve(_gaussian_flow(mu, std), sigmas, start.float(), solver)
        errors.append(float((x.double() - exact).abs().max()))
    observed = [math.log2(e / e_half) for e, e_half in itertools.pairwise(errors)]
    assert all(abs(o - order) < 0.15 for o in observed[1:]), (errors, observed)


# -- the solver in the sampler: upstream's transcription -----------------------------------------------------

SHAPE = (2, 3, 3)


class FakeModel:
    """What sample_rollout needs of a model: a nonlinear velocity field (so a second-order solver differs from
    Euler), SD3's shifted schedule, a sigmoid 'decoder'."""

    device = torch.device("cpu")

    def __init__(self, num_steps):
        t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
        self.schedule = (3 * t / (1 + 2 * t)).float()

    def sigmas(self, num_steps, resolution):
        return self.schedule.clone()

    def latent_shape(self, resolution):
        return SHAPE

    def predict_velocity(self, x, sigma, cond, guidance_scale, uncond_grad=True):
        return torch.tanh(1.5 * x + cond) * (1 + sigma) - 0.3 * x

    def decode(self, latents):
        return torch.sigmoid(latents[:, :1].expand(-1, 3, -1, -1))


class Embeds:
    def __init__(self, rows):
        self.rows = rows

    def select(self, index):
        return self.rows[index].view(-1, 1, 1, 1)


def upstream_rollout(model, cond, x, window, noise_level, generator, num_steps, compress_ratio):
    """Tencent-Hunyuan/MixGRPO fastvideo/utils/sampling_utils.py@d270daf run_sample_step with
    dpm_algorithm_type "dpmsolver++", dpm_apply_strategy "post", dpm_solver_order 2, dpm_solver_type "midpoint",
    flow_grpo_sampling, sde_type "sde", in float64; the SDE noise drawn from ``generator`` in the sampler's order."""
    f64 = torch.float64
    sigma_schedule = torch.linspace(1, 0, num_steps + 1, dtype=f64)
    sigma_schedule = 3 * sigma_schedule / (1 + 2 * sigma_schedule)  # sd3_time_shift(3, t)
    determistic = [i not in window for i in range(num_steps)]
    last_false_index = max(window)
    num_post_steps = int(max((sigma_schedule.size(0) - 1 - last_false_index) * compress_ratio, 1))
    post_time_step = torch.linspace(1, 0, sigma_schedule.size(0), dtype=f64)[last_false_index + 1].item()
    post = torch.linspace(post_time_step, 0, num_post_steps, dtype=f64)
    sigma_schedule = torch.cat([sigma_schedule[:last_false_index + 1], 3 * post / (1 + 2 * post)])
    timesteps = sigma_schedule[:-1]

    def alpha_sigma_lambda(sig):
        return 1 - sig, sig, torch.log(1 - sig) - torch.log(sig)

    model_outputs, lower_order_nums = [None, None], 0
    z = x.to(f64)
    for i in range(len(timesteps)):
        sigma, sigma_prev = sigma_schedule[i], sigma_schedule[i + 1]
        pred = model.predict_velocity(z, sigma.item(), cond.to(f64), 1.0)
        x_0 = z - sigma * pred
        model_outputs = [model_outputs[1], x_0]
        if i <= last_false_index:  # flow_grpo_step
            dt = sigma_prev - sigma
            if determistic[i]:
                z = z + dt * pred
            else:
                sigma_max = sigma_schedule[1]
                std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
                mean = z * (1 + std_dev_t**2 / (2 * sigma) * dt) + pred * (1 + std_dev_t**2 * (1 - sigma) / (
                    2 * sigma)) * dt
                noise = torch.randn(z.shape, generator=generator, dtype=torch.float32).to(f64)
                z = mean + std_dev_t * torch.sqrt(-1 * dt) * noise
        else:  # dpm_step, deterministic
            lower_order_final = i == len(timesteps) - 1
            alpha_t, sigma_t, lambda_t = alpha_sigma_lambda(sigma_prev)
            _, sigma_s0, lambda_s0 = alpha_sigma_lambda(sigma)
            if lower_order_nums < 1 or lower_order_final:
                h = lambda_t - lambda_s0
                z = (sigma_t / sigma_s0) * z - (alpha_t * (torch.exp(-h) - 1.0)) * x_0
            else:
                _, _, lambda_s1 = alpha_sigma_lambda(sigma_schedule[i - 1])
                m0, m1 = model_outputs[-1], model_outputs[-2]
                h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
                r0 = h_0 / h
                d0, d1 = m0, (1.0 / r0) * (m0 - m1)
                z = (sigma_t / sigma_s0) * z - (alpha_t * (torch.exp(-h) - 1.0)) * d0 - 0.5 * (
                    alpha_t * (torch.exp(-h) - 1.0)) * d1
        lower_order_nums = min(lower_order_nums + 1, 2)
    return z, len(timesteps)


class CountingModel(FakeModel):
    def predict_velocity(self, *args, **kwargs):
        self.forwards += 1
        return super().predict_velocity(*args, **kwargs)


# compressed so that upstream's re-gridded points fall on the schedule's own: (25, window 0..3, 0.2) is Flash*
@pytest.mark.parametrize(("num_steps", "window", "ratio"), [
    (10, (0, 1), 1.0), (10, (2, 3, 4), 1.0), (12, (5,), 1.0), (8, (0,), 1.0),
    (10, (0, 1), 0.56), (25, (0, 1, 2, 3), 0.2), (25, (3, 4, 5, 6), 0.4),
])
def test_flash_rollout_matches_upstreams_sampler(num_steps, window, ratio):
    cond = torch.tensor([0.2, -0.4, 0.7])
    finals, forwards = {}, {}
    for solver in ("dpm2", "euler"):
        model = CountingModel(num_steps)
        model.forwards = 0
        settings = SamplerSettings(num_steps, 1.0, 0.7, "sde", 8, window, (), ode_solver=solver, tail_ratio=ratio)
        rollout = sample_rollout(model, ["a", "b", "c"], 2, 6, settings, torch.Generator().manual_seed(3),
                                 embeds=Embeds(cond))
        finals[solver], forwards[solver] = rollout.trajectory[:, -1], model.forwards
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((6, *SHAPE), generator=gen, dtype=torch.float32)
    reference, steps = upstream_rollout(FakeModel(num_steps), cond.repeat_interleave(2).view(-1, 1, 1, 1), x, window,
                                        0.7, gen, num_steps, ratio)
    assert torch.allclose(finals["dpm2"].double(), reference, atol=2e-5, rtol=1e-5)
    assert forwards["dpm2"] == forwards["euler"] == steps  # one forward per step, fewer when compressed
    assert (finals["euler"].double() - reference).abs().max() > 1e-3  # the solvers differ where the test looks


@pytest.mark.parametrize("ratio", [0.2, 0.3, 0.4, 0.56, 0.75, 1.0])
def test_the_compressed_tail_is_upstreams_regridding_rounded_to_the_schedules_points(ratio):
    for num_steps in range(3, 31):
        for last in range(num_steps):
            path = step_path(num_steps, last, ratio)
            assert path[:last + 2] == list(range(last + 2))
            n = int(max((num_steps - last) * ratio, 1))  # upstream's num_post_steps
            if n < 2:  # upstream would stop at sigma[last + 1]; ours still takes one step to 0
                assert path[last + 1:] == sorted({last + 1, num_steps})
                continue
            # upstream's points are linspace(t[last + 1], 0, n) in the unshifted time t = 1 - index / num_steps
            t = np.linspace(1 - (last + 1) / num_steps, 0, n)
            upstream = (1 - t) * num_steps
            assert len(path) - (last + 1) == n
            assert np.all(np.abs(np.array(path[last + 1:]) - upstream) <= 0.5 + 1e-9)
    assert step_path(10, 3, 1.0) == list(range(11)) and step_path(10, -1, 0.5) == [0, 3, 5, 8, 10]


def test_euler_default_is_the_plain_loop_bit_for_bit():
    num_steps, window = 6, (1, 2)
    model, cond = FakeModel(num_steps), torch.tensor([0.5, -0.1])
    settings = SamplerSettings(num_steps, 1.0, 0.7, "sde", 8, window, ())  # (): keep the final latent
    assert settings.ode_solver == "euler"
    rollout = sample_rollout(model, ["a", "b"], 2, 4, settings, torch.Generator().manual_seed(1), embeds=Embeds(cond))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((4, *SHAPE), generator=gen, dtype=torch.float32)
    c = cond.repeat_interleave(2).view(-1, 1, 1, 1)
    levels = model.schedule.tolist()
    for i in range(num_steps):
        v = model.predict_velocity(x, levels[i], c, 1.0)
        if i in window:
            x = sde_step_with_logprob(v, levels[i], levels[i + 1], x, noise_level=0.7, generator=gen)[0]
        else:
            x = euler_step(v, levels[i], levels[i + 1], x)
    assert torch.equal(rollout.trajectory[:, -1], x)


def test_unknown_solver_and_ratio_are_refused():
    with pytest.raises(ValueError, match="ode_solver must be one of"):
        SamplerSettings(4, 1.0, 0.7, "sde", 8, (0,), (0,), ode_solver="heun")
    with pytest.raises(ValueError, match="tail_ratio must be in"):
        SamplerSettings(4, 1.0, 0.7, "sde", 8, (0,), (0,), tail_ratio=0)
