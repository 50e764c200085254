"""GRPO advantages (docs/ALGORITHM.md sections 4-5) against hand computations and an independent numpy version."""

import math

import numpy as np
import pytest
import torch

from components.flow_rl.advantages import compute_advantages, gdpo_advantages, group_statistics

EPS = 1e-4


def _numpy_advantages(r, g, std, clip=5.0):
    r, g = np.asarray(r, dtype=np.float64), np.asarray(g)
    out = np.zeros_like(r)
    valid = np.isfinite(r)
    gstd = np.std(r[valid])
    for gid in np.unique(g):
        m = (g == gid) & valid
        if m.sum() < 2:
            continue
        centred = r[m] - r[m].mean()
        out[m] = centred if std == "none" else centred / ((gstd if std == "global" else np.std(r[m])) + EPS)
    return np.clip(out, -clip, clip)


def test_single_sample_group_gets_zero():
    adv = compute_advantages(torch.tensor([1.0, 2.0, 3.0]), [0, 0, 1])
    assert adv[2].item() == 0.0
    assert adv[0].item() < 0 < adv[1].item()


def test_global_vs_group_std_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    g = [0, 0, 1, 1]
    glob = compute_advantages(r, g, std="global")
    grp = compute_advantages(r, g, std="group")
    pop_std = math.sqrt(1.25)  # population std of 1..4
    assert glob.tolist() == pytest.approx([-0.5 / (pop_std + EPS), 0.5 / (pop_std + EPS)] * 2, rel=1e-6)
    assert grp.tolist() == pytest.approx([-0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)] * 2, rel=1e-6)


def test_dr_grpo_keeps_the_centred_reward_undivided():
    """Dr.GRPO: r - mean of the group, whatever the spread; a 100x wider group gets 100x the advantage."""
    r = torch.tensor([0.0, 0.2, 0.4, 10.0, 20.0, 30.0], dtype=torch.float64)
    adv = compute_advantages(r, [0, 0, 0, 1, 1, 1], std="none", clip=100.0)
    assert adv.tolist() == pytest.approx([-0.2, 0.0, 0.2, -10.0, 0.0, 10.0], abs=1e-12)
    assert compute_advantages(r, [0, 0, 0, 1, 1, 1], std="none", clip=5.0).tolist()[3:] == [-5.0, 0.0, 5.0]
    with pytest.raises(ValueError, match="global, group, none"):
        compute_advantages(r, [0, 0, 0, 1, 1, 1], std="batch")


def test_population_std_not_sample_std():
    r = torch.tensor([0.0, 2.0])
    adv = compute_advantages(r, [0, 0], std="group")
    assert adv[1].item() == pytest.approx(1.0 / (1.0 + EPS), rel=1e-6)  # ddof=0 std is 1, ddof=1 would be 1.414


def test_nan_rewards_excluded_and_zeroed():
    r = torch.tensor([1.0, float("nan"), 3.0, 5.0])
    adv = compute_advantages(r, [0, 0, 0, 0])
    assert adv[1].item() == 0.0
    std = np.std([1.0, 3.0, 5.0])
    assert adv[[0, 2, 3]].tolist() == pytest.approx([-2 / (std + EPS), 0.0, 2 / (std + EPS)], rel=1e-6)
    assert torch.isfinite(adv).all()


def test_group_left_with_one_valid_reward_gets_zero():
    adv = compute_advantages(torch.tensor([float("nan"), 1.0, 0.0, 2.0]), [0, 0, 1, 1])
    assert adv[:2].tolist() == [0.0, 0.0]


def test_all_failed_gives_zeros():
    adv = compute_advantages(torch.full((4,), float("nan")), [0, 0, 1, 1])
    assert adv.tolist() == [0.0] * 4


def test_clipping():
    r = torch.zeros(50)
    r[0] = 1.0
    adv = compute_advantages(r, [0] * 50, std="group", clip=5.0)
    unclipped = (1 - 0.02) / (math.sqrt(0.02 * 0.98) + EPS)
    assert unclipped > 5
    assert adv[0].item() == pytest.approx(5.0)
    assert adv[1].item() == pytest.approx(-0.02 / (math.sqrt(0.02 * 0.98) + EPS), rel=1e-5)


@pytest.mark.parametrize("std", ["global", "group", "none"])
def test_matches_independent_numpy(std):
    rng = np.random.default_rng(0)
    r = rng.normal(size=96)
    r[[3, 40]] = np.nan
    g = np.repeat(rng.permutation(12), 8)
    adv = compute_advantages(torch.tensor(r, dtype=torch.float32), torch.tensor(g), std=std)
    np.testing.assert_allclose(adv.numpy(), _numpy_advantages(r.astype(np.float32), g, std), rtol=1e-5,
                               atol=1e-6)


def test_non_contiguous_group_ids():
    adv = compute_advantages(torch.tensor([1.0, 5.0, 2.0, 7.0]), [20, 10, 20, 10], std="group")
    assert adv.tolist() == pytest.approx([-0.5 / (0.5 + EPS), -1 / (1 + EPS), 0.5 / (0.5 + EPS), 1 / (1 + EPS)])


def test_gdpo_matches_independent_numpy():
    rng = np.random.default_rng(1)
    g = np.repeat(np.arange(4), 6)
    r1, r2 = rng.normal(size=24), rng.normal(size=24) * 10
    w = {"a": 1.0, "b": 0.5}
    got = gdpo_advantages({"a": torch.tensor(r1), "b": torch.tensor(r2)}, w, torch.tensor(g), reward_std="global")
    total = w["a"] * _numpy_advantages(r1, g, "global") + w["b"] * _numpy_advantages(r2, g, "global")
    expected = (total - total.mean()) / np.std(total)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
    assert got.mean().abs() < 1e-6 and got.std(unbiased=False).item() == pytest.approx(1.0)


def test_gdpo_failed_sample_gets_zero():
    r1 = torch.tensor([1.0, 2.0, 3.0, float("nan")])
    r2 = torch.tensor([1.0, 0.0, 3.0, 2.0])
    got = gdpo_advantages({"a": r1, "b": r2}, {"a": 1.0, "b": 1.0}, [0, 0, 0, 0])
    assert got[3].item() == 0.0 and torch.isfinite(got).all()


def test_group_statistics():
    r = torch.tensor([1.0, 1.0, 0.0, 2.0, float("nan"), 3.0])
    stats = group_statistics(r, [0, 0, 1, 1, 2, 2])
    assert stats["failed_fraction"] == pytest.approx(1 / 6)
    assert stats["zero_std_group_fraction"] == pytest.approx(2 / 3)  # group 0 all equal, group 2 one valid


def _flow_factory_gdpo(rewards: dict[str, np.ndarray], weights: dict[str, float], g: np.ndarray) -> np.ndarray:
    """GDPO as Flow-Factory defines it: each reward normalised within its group by its own group std, weighted,
    summed, then batch-normalised."""
    total = np.zeros(len(g))
    for key, r in rewards.items():
        adv = np.zeros(len(g))
        for gid in np.unique(g):
            m = g == gid
            adv[m] = (r[m] - r[m].mean()) / r[m].std()
        total += weights[key] * adv
    return (total - total.mean()) / total.std()


def test_gdpo_defaults_to_the_per_group_std_of_each_reward():
    from components.rewards.base import RewardOutput
    from components.trainer.loop import rollout_advantages
    from pipeline.config import TINY_CONFIG, load_config

    rng = np.random.default_rng(3)
    g = np.repeat(np.arange(4), 6)
    # the groups' spreads differ by 30x: a batch std and a group std disagree for every group
    scale = np.repeat([0.1, 1.0, 3.0, 0.3], 6)
    r1, r2 = rng.normal(size=24) * scale, rng.normal(size=24) * scale[::-1] * 10
    w = {"a": 1.0, "b": 0.5}
    expected = _flow_factory_gdpo({"a": r1, "b": r2}, w, g)
    two = ["reward_aggregation=gdpo", "rewards=[{name: brightness}, {name: jpeg_compressibility}]"]
    config = load_config(TINY_CONFIG, two)
    outputs = {"a": RewardOutput(r1, [None] * 24), "b": RewardOutput(r2, [None] * 24)}
    got = rollout_advantages(config, w, outputs, np.zeros(24), torch.tensor(g))
    np.testing.assert_allclose(got.numpy(), expected, rtol=2e-3, atol=2e-3)  # eps 1e-4 in the std, float32
    glob = load_config(TINY_CONFIG, [*two, "train.gdpo_reward_std=global"])
    other = rollout_advantages(glob, w, outputs, np.zeros(24), torch.tensor(g))
    total = w["a"] * _numpy_advantages(r1, g, "global") + w["b"] * _numpy_advantages(r2, g, "global")
    np.testing.assert_allclose(other.numpy(), (total - total.mean()) / total.std(), rtol=1e-5, atol=1e-5)
    assert float(np.abs(other.numpy() - expected).max()) > 0.5  # the two rules really differ here


def test_gdpo_keeps_a_group_no_reward_tells_apart_at_exactly_zero():
    """So that train.skip_zero_advantage leaves it out, as with `sum` (round-off would make it ~1e-8)."""
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    r1 = torch.tensor([0.3, 0.3, 0.3, 0.1, 0.9, 0.4, 0.2, 0.7, 0.5])
    r2 = torch.tensor([2.0, 2.0, 2.0, 1.0, 3.0, 0.5, 4.0, 1.0, 2.0])
    got = gdpo_advantages({"a": r1, "b": r2}, {"a": 1.0, "b": 0.5}, g)
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    assert bool((got[3:] != 0).all())


def test_gdpo_clips_the_batch_normalised_advantage():
    """Flow-Factory clamps every advantage to its clip range in the loss, GDPO's batch-normalised ones included: one
    informative pair among 96 samples is 6.9 batch stds out, and is clipped to adv_clip_max."""
    g = torch.arange(96) // 8
    r1 = torch.zeros(96, dtype=torch.float64)
    r1[[0, 1]] = torch.tensor([1.0, -1.0], dtype=torch.float64)  # one group with a spread: +-2 group stds
    r2 = r1.clone()
    clip = 5.0
    got = gdpo_advantages({"a": r1, "b": r2}, {"a": 1.0, "b": 1.0}, g, clip=clip)
    total = 2 * _numpy_advantages(r1.numpy(), g.numpy(), "group")
    unclipped = (total - total.mean()) / total.std()
    assert abs(unclipped[0]) > clip  # the case this test is about
    np.testing.assert_allclose(got.numpy()[:2], np.clip(unclipped[:2], -clip, clip), rtol=1e-6)
    assert got.numpy()[2:].tolist() == [0.0] * 94


@pytest.mark.parametrize("std", ["global", "group", "none"])
def test_the_trainer_reads_train_advantage_std(std):
    from components.trainer.loop import rollout_advantages
    from pipeline.config import TINY_CONFIG, load_config

    rng = np.random.default_rng(4)
    g = np.repeat(np.arange(4), 6)
    combined = rng.normal(size=24) * np.repeat([0.01, 0.1, 1.0, 0.05], 6)
    config = load_config(TINY_CONFIG, [f"train.advantage_std={std}"])
    got = rollout_advantages(config, {"brightness": 1.0}, {}, combined, torch.tensor(g))
    np.testing.assert_allclose(got.numpy(), _numpy_advantages(combined.astype(np.float32), g, std), rtol=1e-5,
                               atol=1e-7)


def _groups(size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Groups of ``size`` rewards: random spreads from 1e-3 to 1e3, near-constant ones (spreads of 1e-9 and
    1e-5, below Flow-Factory's 1e-6 floor and our 1e-4 eps; one differing from the rest by one ulp) and one
    sample away from the others, where the bound is attained."""
    ulp = np.full(size, 0.3)
    ulp[0] = np.nextafter(0.3, 1.0)
    return [
        *(rng.normal(size=size) * 10 ** rng.uniform(-3, 3) for _ in range(20)),
        0.3 + rng.normal(size=size) * 1e-9,
        0.3 + rng.normal(size=size) * 1e-5,
        ulp,
        np.where(np.arange(size) == size // 2, 2.0, -1.0),
    ]


@pytest.mark.parametrize("size", [2, 3, 5, 8, 16, 26, 27, 64])
def test_a_group_normalised_advantage_is_at_most_sqrt_of_group_size_minus_one(size):
    """Each group divided by its own (population) std: |r_i - mean| <= sqrt(G - 1) std (Samuelson), so every
    advantage is at most sqrt(G - 1) whatever the std, near-constant groups included; with our eps 1e-4
    (strictly below) as with Flow-Factory's 1e-6 floor. A sample away from the rest attains it."""
    bound = math.sqrt(size - 1)
    for r in _groups(size, np.random.default_rng(size)):
        ours = compute_advantages(torch.tensor(r), torch.zeros(size), std="group", clip=math.inf).abs().max().item()
        flow_factory = float(np.abs((r - r.mean()) / max(r.std(), 1e-6)).max())  # compute_advantages_gdpo, b9e47bcc
        assert ours < bound
        assert flow_factory <= bound * (1 + 1e-12)
    outlier = torch.tensor(_groups(size, np.random.default_rng(0))[-1])
    assert compute_advantages(outlier, torch.zeros(size), std="group", clip=math.inf).abs().max().item() == (
        pytest.approx(bound, rel=1e-3))


@pytest.mark.parametrize("size", [2, 8, 26, 27])
def test_gdpo_per_reward_clip_binds_only_beyond_groups_of_26(size):
    """With train.gdpo_reward_std group, adv_clip_max 5 on each reward's advantage never binds for groups of 26 or
    fewer (sqrt(25) = 5): GDPO then equals its unclipped-per-reward form; at 27 one sample away from its group
    is clipped."""
    rng = np.random.default_rng(size)
    g = np.repeat(np.arange(3), size)
    rewards = {k: np.concatenate([rng.normal(size=size), rng.normal(size=size) * 1e-5,
                                  np.where(np.arange(size) == 0, 3.0, 0.0)]) for k in ("a", "b")}
    w = {"a": 1.0, "b": 0.5}
    total = sum(w[k] * _numpy_advantages(r, g, "group", clip=math.inf) for k, r in rewards.items())
    expected = np.clip((total - total.mean()) / total.std(), -5.0, 5.0)
    got = gdpo_advantages({k: torch.tensor(r) for k, r in rewards.items()}, w, torch.tensor(g), clip=5.0).numpy()
    if size <= 26:
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    else:
        assert np.abs(got - expected).max() > 1e-3
