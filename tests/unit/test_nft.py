"""DiffusionNFT's maths (docs/ALGORITHM.md section 8) against an independent float64 transcription of NVlabs'
train_nft_sd3.py, a closed-form gradient, and its decay schedule."""

import numpy as np
import pytest
import torch

from components.algorithms.diffusion_nft import nft_loss, old_policy_decay, optimality_probability, soft_update
from components.flow_rl.sde import forward_noise


def _transcribed_loss(v_theta, v_old, xt, x0, t, adv, beta, clip, v_ref=None, kl_weight=0.0):
    """NVlabs' loss, written out in numpy float64 from its formulas, one sample at a time."""
    r = np.clip(np.clip(adv, -clip, clip) / clip / 2.0 + 0.5, 0, 1)
    per_sample = []
    for i in range(len(x0)):
        pos = beta * v_theta[i] + (1 - beta) * v_old[i]
        neg = (1.0 + beta) * v_old[i] - beta * v_theta[i]
        x0_pos, x0_neg = xt[i] - t * pos, xt[i] - t * neg
        w_pos = max(np.abs(x0_pos - x0[i]).mean(), 1e-5)
        w_neg = max(np.abs(x0_neg - x0[i]).mean(), 1e-5)
        loss_pos = ((x0_pos - x0[i]) ** 2 / w_pos).mean()
        loss_neg = ((x0_neg - x0[i]) ** 2 / w_neg).mean()
        per_sample.append(r[i] * loss_pos / beta + (1.0 - r[i]) * loss_neg / beta)
    total = float(np.mean(np.array(per_sample) * clip))
    if v_ref is not None:
        total += kl_weight * float(np.mean([((v_theta[i] - v_ref[i]) ** 2).mean() for i in range(len(x0))]))
    return total


@pytest.mark.parametrize(("beta", "kl_weight"), [(1.0, 0.0), (0.1, 1e-4), (2.5, 0.3)])
def test_loss_equals_the_transcription(beta, kl_weight):
    rng = np.random.default_rng(0)
    shape = (6, 4, 5, 5)
    x0, noise = rng.normal(size=shape), rng.normal(size=shape)
    t = 0.63
    xt = (1 - t) * x0 + t * noise
    v_theta, v_old, v_ref = (noise - x0 + 0.3 * rng.normal(size=shape) for _ in range(3))
    adv = np.array([-7.0, -1.2, 0.0, 0.4, 2.5, 9.0])  # beyond the clip at both ends
    expected = _transcribed_loss(v_theta, v_old, xt, x0, t, adv, beta, 5.0, v_ref, kl_weight)
    as_t = {k: torch.tensor(v) for k, v in dict(v_theta=v_theta, v_old=v_old, xt=xt, x0=x0, v_ref=v_ref).items()}
    loss, metrics = nft_loss(as_t["v_theta"], as_t["v_old"], as_t["xt"], as_t["x0"], t,
                             optimality_probability(torch.tensor(adv), 5.0), beta=beta, clip=5.0,
                             v_ref=as_t["v_ref"] if kl_weight else None, kl_weight=kl_weight)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert set(metrics) >= {"policy_loss", "nft/positive_loss", "nft/negative_loss"}
    assert ("kl" in metrics) == bool(kl_weight)


def test_gradient_at_the_old_policy_follows_the_advantage():
    """Where the trained velocity equals the old one, d loss / d v_theta_i = -2 t A_i e_i / (B w_i N): e = the x0
    error, w = its mean absolute value, N its elements; a positive advantage pulls x0 towards the sample."""
    rng = np.random.default_rng(1)
    shape = (4, 3, 4, 4)
    x0, noise = torch.tensor(rng.normal(size=shape)), torch.tensor(rng.normal(size=shape))
    t = 0.4
    xt = forward_noise(x0, noise, t)
    v = torch.tensor(rng.normal(size=shape))
    adv = torch.tensor([-2.0, -0.5, 1.0, 3.0], dtype=torch.float64)
    v_theta = v.clone().requires_grad_(True)
    loss, _ = nft_loss(v_theta, v, xt, x0, t, optimality_probability(adv, 5.0), beta=0.7, clip=5.0)
    loss.backward()
    e = xt - t * v - x0
    w = e.abs().mean(dim=(1, 2, 3), keepdim=True)
    n = e[0].numel()
    expected = -2 * t * adv.view(-1, 1, 1, 1) * e / (len(x0) * w * n)
    torch.testing.assert_close(v_theta.grad, expected, rtol=1e-10, atol=1e-14)


def test_optimality_probability_maps_the_clipped_advantage_to_0_1():
    adv = torch.tensor([-9.0, -5.0, -2.5, 0.0, 1.0, 5.0, 12.0])
    assert optimality_probability(adv, 5.0).tolist() == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0])


def _return_decay(step, decay_type):
    """NVlabs' return_decay, transcribed."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


@pytest.mark.parametrize(("decay_type", "flat", "rate", "max_decay"),
                         [(0, 0, 0.0, 0.0), (1, 0, 0.001, 0.5), (2, 75, 0.0075, 0.999)])
def test_old_policy_decay_is_nvlabs_schedule(decay_type, flat, rate, max_decay):
    for step in (0, 1, 74, 75, 76, 200, 499, 500, 501, 10_000):
        assert old_policy_decay(step, flat, rate, max_decay) == pytest.approx(_return_decay(step, decay_type))


def test_soft_update_moves_the_old_weights_towards_the_current():
    old = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    current = [torch.tensor([3.0, -2.0]), torch.tensor([[4.0]])]
    soft_update(old, current, 0.25)
    assert old[0].tolist() == pytest.approx([0.25 * 1 + 0.75 * 3, 0.25 * 2 - 0.75 * 2])
    assert old[1].item() == pytest.approx(3.0)
    soft_update(old, current, 0.0)
    assert torch.equal(old[0], current[0])


def test_the_old_policy_restores_its_copy_and_refuses_a_checkpoint_without_one():
    from components.algorithms.diffusion_nft import DiffusionNFTConfig, OldPolicy

    old = OldPolicy([torch.nn.Parameter(torch.zeros(2))], DiffusionNFTConfig())
    with pytest.raises(ValueError, match="the checkpoint holds no AWM EMA anchor"):
        old.load_state_dict(None, "AWM EMA anchor")
    old.load_state_dict({"old_policy": [torch.ones(2)]}, "DiffusionNFT old policy")
    assert torch.equal(old.weights[0], torch.ones(2))
