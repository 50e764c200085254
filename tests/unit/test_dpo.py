"""Online DPO's maths (docs/ALGORITHM.md section 14): the loss against a float64 transcription of the authors'
train_sd3_dpo.py (which Flow-Factory's dpo_objective and verl-omni's compute_diffusion_dpo_fm_loss repeat), its
gradient's sign, the pairs chosen per group, and the logit-normal noise level."""

import math

import pytest
import torch

from components.algorithms.base import algorithm_class
from components.algorithms.dpo import (
    DPO,
    DPOConfig,
    dpo_loss,
    matching_error,
    preference_pairs,
    training_level,
)


def _authors_loss(model_pred, ref_pred, target, beta):
    """yifan123/flow_grpo_refactor scripts/train_sd3_dpo.py @7be03dc, line by line in float64: the first half of
    the batch are the winners, the second the losers."""
    bsz = target.shape[0] // 2
    theta_mse = ((model_pred - target) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    ref_mse = ((ref_pred - target) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    w_diff = theta_mse[:bsz] - ref_mse[:bsz]
    l_diff = theta_mse[bsz:] - ref_mse[bsz:]
    inside_term = -0.5 * beta * (w_diff - l_diff)
    losses = [-math.log(1 / (1 + math.exp(-float(x)))) for x in inside_term]
    implicit_acc = sum(float(x) > 0 for x in inside_term) / len(inside_term)
    return sum(losses) / len(losses), implicit_acc


@pytest.mark.parametrize("beta", [1.0, 100.0, 2000.0])
def test_the_loss_is_the_authors(beta):
    g = torch.Generator().manual_seed(0)
    shape = (32, 4, 3, 3)  # 16 pairs: winners first
    target = torch.randn(shape, generator=g, dtype=torch.float64)
    model_pred = target + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    ref_pred = target + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    expected_loss, expected_acc = _authors_loss(model_pred, ref_pred, target, beta)

    err, ref = matching_error(model_pred, target), matching_error(ref_pred, target)
    assert err.dtype == torch.float64
    loss, metrics = dpo_loss(*err.chunk(2), *ref.chunk(2), beta=beta)
    assert float(loss) == pytest.approx(expected_loss, rel=1e-12, abs=1e-12)
    assert float(metrics["dpo/implicit_acc"]) == expected_acc
    assert 0 < expected_acc < 1  # the draw holds pairs on both sides of the reference


def test_matching_error_is_float32_at_least_and_per_sample():
    v = torch.ones(2, 3, 4, dtype=torch.bfloat16)
    target = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    target[1] = 3
    err = matching_error(v, target)
    assert err.dtype == torch.float32
    assert err.tolist() == [1.0, 4.0]


def test_lowering_the_winners_error_lowers_the_loss_and_the_gradient_says_so():
    """Raising the winner's likelihood (a smaller flow-matching error) must lower the loss; raising the loser's
    must raise it; the reference gets no gradient."""
    policy_w = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    policy_l = torch.tensor([1.5, 1.0], dtype=torch.float64, requires_grad=True)
    ref_w = torch.tensor([1.2, 1.9], dtype=torch.float64, requires_grad=True)
    ref_l = torch.tensor([1.4, 1.1], dtype=torch.float64, requires_grad=True)
    loss, _ = dpo_loss(policy_w, policy_l, ref_w, ref_l, beta=10.0)
    loss.backward()
    assert (policy_w.grad > 0).all() and (policy_l.grad < 0).all()
    assert ref_w.grad is None and ref_l.grad is None
    with torch.no_grad():
        better, _ = dpo_loss(policy_w - 0.05, policy_l, ref_w, ref_l, beta=10.0)
        worse, _ = dpo_loss(policy_w, policy_l - 0.05, ref_w, ref_l, beta=10.0)
    assert better < loss < worse


def test_at_the_reference_the_loss_is_log_2_and_no_pair_is_preferred():
    err = torch.tensor([0.7, 1.3, 2.0])
    loss, metrics = dpo_loss(err, err.flip(0), err, err.flip(0), beta=100.0)
    assert float(loss) == pytest.approx(math.log(2))
    assert float(metrics["dpo/implicit_acc"]) == 0.0  # inside terms are exactly 0


def test_pairs_are_each_groups_best_and_worst():
    # groups interleaved and out of order: the pair is found by prompt_index, not by position
    prompt_index = torch.tensor([2, 0, 2, 0, 1, 1, 2, 0])
    rewards = torch.tensor([0.5, -1.0, -2.0, 3.0, 0.1, -0.1, 1.5, 0.0])
    winners, losers, unpaired = preference_pairs(prompt_index, rewards)
    assert winners.tolist() == [3, 4, 6] and losers.tolist() == [1, 5, 2]
    assert unpaired == 0


def test_ties_take_the_first_sample_and_equal_groups_give_no_pair():
    prompt_index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 3, 3])
    rewards = torch.tensor([1.0, -1.0, 1.0, -1.0,  # ties at both ends: the first of each
                            0.0, 0.0, 0.0,  # a zero-std group
                            4.0,  # a group of one
                            2.0, 2.0])  # equal, not zero
    winners, losers, unpaired = preference_pairs(prompt_index, rewards)
    assert winners.tolist() == [0] and losers.tolist() == [1]
    assert unpaired == 3


def test_a_failed_reward_is_no_candidate():
    """A failed (NaN) reward is neither best nor worst; a group left with one scored sample has no pair."""
    prompt_index = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    rewards = torch.tensor([float("nan"), 0.1, 0.3, -float("inf"), 0.5, float("nan"), float("nan")])
    winners, losers, unpaired = preference_pairs(prompt_index, rewards)
    assert winners.tolist() == [2] and losers.tolist() == [1]
    assert unpaired == 1


def test_no_pairs_at_all_is_empty_not_an_error():
    winners, losers, unpaired = preference_pairs(torch.tensor([0, 0, 1, 1]), torch.zeros(4))
    assert winners.numel() == losers.numel() == 0 and unpaired == 2


def test_training_levels_are_logit_normal_over_the_grid():
    """The index int(1000 sigmoid(n)), n ~ N(mean, std^2): with mean 0 the median level is the grid's middle; a
    positive mean moves the levels towards the clean end (later indices, lower noise)."""
    grid = [1 - k / 1000 for k in range(1000)]
    g = torch.Generator().manual_seed(0)
    levels = torch.tensor([training_level(grid, g, 0.0, 1.0) for _ in range(4000)])
    assert float(levels.median()) == pytest.approx(0.5, abs=0.03)
    # P(sigmoid(n) < 0.25) = P(n < logit(0.25)) = Phi(-1.0986) = 0.136
    assert float((levels > 0.75).double().mean()) == pytest.approx(0.136, abs=0.02)
    shifted = [training_level(grid, g, 1.0, 1.0) for _ in range(4000)]
    assert float(torch.tensor(shifted).median()) == pytest.approx(1 - 1 / (1 + math.exp(-1.0)), abs=0.03)
    assert set(shifted) <= set(grid)


def test_the_section_has_the_published_defaults_and_is_selected_by_dpo():
    section = DPOConfig()
    assert (section.beta, section.logit_mean, section.logit_std) == (100.0, 0.0, 1.0)
    assert algorithm_class("dpo") is DPO
    with pytest.raises(ValueError, match="greater than 0"):
        DPOConfig(beta=0)
