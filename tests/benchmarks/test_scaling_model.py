"""scaling_model.py against closed forms worked out here, the trainer's own epoch split (describe_batches) and the
figures docs/PERFORMANCE.md measured."""

from __future__ import annotations

import dataclasses
import itertools
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scaling_model as sm

from components.trainer.config import describe_batches, epoch_split_problems
from pipeline.config import CONFIG_DIR, load_config

# A made-up SD3.5-Medium-like transformer: the tests below hold for any shape, so no real-shape build is needed
SD3_LIKE = sm.Shape(forward_flops=2.25e12, lora_params=18_776_064, weight_bytes=4_480_000_000, fsdp_units=25,
                    cfg=True, batched_cfg=True)


def recipe(name: str, *overrides: str):
    return load_config(CONFIG_DIR / f"{name}.yaml", list(overrides))


def shape_of(name: str) -> sm.Shape:
    """SD3_LIKE, guided as the recipe's family is (FLUX.1 embedded, klein none, Qwen-Image two calls per CFG)."""
    family = sm.RECIPES[name]
    return dataclasses.replace(SD3_LIKE, cfg=family not in ("flux1-dev", "flux2-klein"),
                               batched_cfg=family != "qwen-image")


@pytest.fixture(scope="module")
def calibration() -> sm.Calibration:
    return sm.calibrate(recipe(sm.REFERENCE_RECIPE), SD3_LIKE)


# --- the closed forms -------------------------------------------------------------------------------------------

def test_ring_all_reduce_is_two_n_minus_one_over_n_bytes_over_bandwidth_plus_two_n_minus_one_latencies():
    assert sm.ring_all_reduce_s(1e9, 2, 1e9, 0.0) == pytest.approx(1.0)  # 2 x 1/2 x 1 GB at 1 GB/s
    assert sm.ring_all_reduce_s(4e9, 4, 1e9, 1e-3) == pytest.approx(2 * 3 / 4 * 4 + 6e-3)
    for n in (2, 3, 8, 16, 64):
        assert sm.ring_all_reduce_s(75e6, n, 450e9, 10e-6) == pytest.approx(
            2 * (n - 1) / n * 75e6 / 450e9 + 2 * (n - 1) * 10e-6)
    assert sm.ring_all_reduce_s(75e6, 1, 450e9, 10e-6) == 0.0  # one worker: the trainer reduces nothing


def test_ring_all_gather_is_half_an_all_reduce():
    assert sm.ring_all_gather_s(4e9, 4, 1e9, 1e-3) == pytest.approx(3 + 3e-3)
    assert sm.ring_all_gather_s(4e9, 1, 1e9, 1e-3) == 0.0


def test_predict_epoch_s_is_the_split_compute_plus_the_communication_nothing_overlapped():
    # one worker: the measured epoch itself, whatever the link
    assert sm.predict_epoch_s(40.0, 80.0, 8.0, 1, 8e8, 16, 1e6, 1.0, 4e9, 100) == 128.0
    # four workers: 128 / 4 + 2 steps x (2 x 3/4 x 0.8 GB at 1 GB/s + 6 latencies) + 4 x 3 per-epoch latencies
    plain = 32 + 2 * (1.2 + 6e-4) + 12e-4
    assert sm.predict_epoch_s(40.0, 80.0, 8.0, 4, 8e8, 2, 1e9, 1e-4) == pytest.approx(plain)
    # FSDP: per step 3/4 of 4 GB gathered at 1 GB/s, and 100 all-gathers of 3 latencies each
    assert sm.predict_epoch_s(40.0, 80.0, 8.0, 4, 8e8, 2, 1e9, 1e-4, 4e9, 100) == pytest.approx(
        plain + 2 * (3 + 100 * 3e-4))


def test_a_ring_is_paced_by_nvlink_inside_a_node_and_by_the_link_between_nodes_beyond():
    assert sm.ring_link(8, sm.NET_100G) is sm.NVLINK
    assert sm.ring_link(9, sm.NET_100G) is sm.NET_100G
    assert sm.ring_link(16, None) is None
    assert (sm.NVLINK.bandwidth, sm.NET_100G.bandwidth, sm.NET_400G.bandwidth) == (450e9, 12.5e9, 50e9)


# --- the epoch split is the trainer's -------------------------------------------------------------------------

def _described(config, workers: int) -> tuple[int, int, int]:
    """(images per worker, sampling batches, optimizer steps) read back from the trainer's own start-up line."""
    m = re.search(r"each (\d+) images per epoch in (\d+) sampling batches of \d+; (\d+) optimizer step",
                  describe_batches(config, workers))
    return int(m[1]), int(m[2]), int(m[3])


@pytest.mark.parametrize("name", sm.RECIPES)
def test_the_split_is_the_one_the_trainer_prints_and_refused_worker_counts_are_reported(name, calibration):
    config = recipe(name)
    refused = 0
    for n in sm.WORKERS:
        problems = epoch_split_problems(config, n)
        if problems:
            refused += 1
            with pytest.raises(sm.UnsplittableEpoch) as exc:
                sm.split_epoch(config, n)
            assert list(exc.value.problems) == problems
            prediction = sm.predict(config, shape_of(name), calibration, n, sm.NET_400G)
            assert prediction.epoch_s is None and prediction.efficiency is None
            assert list(prediction.problems) == problems  # reported, not rounded to a nearby split
            continue
        split = sm.split_epoch(config, n)
        assert (split.images, split.sampling_batches, split.optimizer_steps) == _described(config, n)
        assert split.micro_batches == split.images // config.train.batch_size_per_worker
    assert refused >= 2  # 32 and 64 GPUs cannot split any shipped recipe's epoch unchanged


def test_the_readme_split_of_sd35_medium_on_8_workers():
    split = sm.split_epoch(recipe("sd35-medium-ocr"), 8)
    assert (split.images, split.sampling_batches, split.micro_batches, split.optimizer_steps) == (144, 16, 16, 2)


# --- the work per image -----------------------------------------------------------------------------------------

def test_sd35_medium_costs_the_46_cfg_forwards_performance_md_counts():
    # docs/PERFORMANCE.md: 10 sampling forwards + 9 trained steps x (forward + backward + reference = 4), each
    # of 2 rows (CFG)
    config = recipe("sd35-medium-ocr")
    assert sm.sampling_rows_per_image(config, SD3_LIKE) == 10 * 2
    assert sm.training_rows_per_image(config, SD3_LIKE) == 9 * 4 * 2
    # without the gradient through the negative row: cond forward + backward (3 rows), negative (1), reference (2)
    assert sm.training_rows_per_image(recipe("sd35-medium-ocr", "train.cfg_uncond_grad=false"), SD3_LIKE) == 9 * 6


def test_the_other_recipes_work_per_image():
    nft = recipe("sd35-medium-nft-ocr")  # no CFG; per level: old policy, reference (KL weight), forward, backward
    assert (sm.sampling_rows_per_image(nft, SD3_LIKE), sm.training_rows_per_image(nft, SD3_LIKE)) == (10, 9 * 5)
    flux = recipe("flux1-dev-pickscore")  # embedded guidance: one row; 5 of 6 steps trained, no KL
    flux_shape = shape_of("flux1-dev-pickscore")
    assert (sm.sampling_rows_per_image(flux, flux_shape), sm.training_rows_per_image(flux, flux_shape)) == (6, 5 * 3)
    qwen = recipe("qwenimage-ocr")  # a 2-step SDE window, CFG in training, checkpointing recomputes the forward
    qwen_shape = shape_of("qwenimage-ocr")
    assert (sm.sampling_rows_per_image(qwen, qwen_shape), sm.training_rows_per_image(qwen, qwen_shape)) == (
        20, 2 * 2 * 4)


def test_fsdp_gathers_once_per_transformer_call_and_backward():
    sd35 = recipe("sd35-medium-ocr")  # 8 workers: 16 batches x 10 steps; 16 micro-batches x 9 x (fwd, bwd, ref)
    assert sm.transformer_calls(sd35, SD3_LIKE, sm.split_epoch(sd35, 8)) == 16 * 10 + 16 * 9 * 3
    qwen = recipe("qwenimage-ocr")  # Qwen-Image runs CFG's rows in two calls, each with its backward
    assert sm.transformer_calls(qwen, shape_of("qwenimage-ocr"), sm.split_epoch(qwen, 8)) == 16 * 10 * 2 + 16 * 2 * 4


# --- calibration and prediction ---------------------------------------------------------------------------------

def test_the_reference_recipe_on_one_gpu_takes_the_measured_time(calibration):
    images = 48 * 24
    assert sm.one_worker_epoch(recipe("sd35-medium-ocr"), SD3_LIKE, calibration) == pytest.approx(
        (images / 8.33, images / 3.11))
    assert sm.one_worker_epoch(recipe("sd35-medium-ocr", "train.compile=false"), SD3_LIKE, calibration) == (
        pytest.approx((images / 4.61, images / 1.69)))
    twice = dataclasses.replace(SD3_LIKE, forward_flops=2 * SD3_LIKE.forward_flops)
    assert sm.one_worker_epoch(recipe("sd35-medium-ocr"), twice, calibration) == pytest.approx(
        (2 * images / 8.33, 2 * images / 3.11))


def test_a_prediction_is_the_closed_form(calibration):
    config, n, link = recipe("sd35-medium-ocr"), 16, sm.NET_100G
    compute = (1152 / 8.33 + 1152 / 3.11) / n
    grads = 2 * (n - 1) / n * 4 * SD3_LIKE.lora_params / 12.5e9 + 2 * (n - 1) * 50e-6  # one optimizer step at 16
    small = 4 * (n - 1) * 50e-6
    plain = sm.predict(config, SD3_LIKE, calibration, n, link)
    assert plain.epoch_s == pytest.approx(compute + grads + small)
    assert plain.efficiency == pytest.approx(compute / (compute + grads + small))
    calls = 8 * 10 + 8 * 9 * 3  # per worker at 16: 8 sampling batches, 8 micro-batches
    gathers = calls * ((n - 1) / n * SD3_LIKE.weight_bytes / 12.5e9 + 25 * (n - 1) * 50e-6)
    sharded = sm.predict(config, SD3_LIKE, calibration, n, link, fsdp=True)
    assert sharded.epoch_s == pytest.approx(compute + grads + small + gathers)
    assert sharded.fsdp_s == pytest.approx(gathers) and plain.fsdp_s == 0.0
    # the bound with every gather under compute: here the gathers outlast the compute, so they set the epoch
    assert gathers > compute
    assert sharded.hidden_gathers_efficiency == pytest.approx(compute / (gathers + grads + small))
    # on 8 NVLink GPUs the gathers fit under the compute: only the gradients' all-reduces (2 steps) remain
    compute8 = (1152 / 8.33 + 1152 / 3.11) / 8
    grads8 = 2 * (2 * 7 / 8 * 4 * SD3_LIKE.lora_params / 450e9 + 14 * 10e-6) + 4 * 7 * 10e-6
    nvlink = sm.predict(config, SD3_LIKE, calibration, 8, None, fsdp=True)
    assert nvlink.fsdp_s < compute8
    assert nvlink.hidden_gathers_efficiency == pytest.approx(compute8 / (compute8 + grads8))


@pytest.mark.parametrize("name", sm.RECIPES)
def test_efficiency_is_one_on_one_gpu_and_falls_with_more_gpus_and_slower_links(name, calibration):
    config, shape = recipe(name), shape_of(name)
    for fsdp in (False, True):
        one = sm.predict(config, shape, calibration, 1, None, fsdp)
        assert one.efficiency == 1.0 and one.all_reduce_s == 0.0 and one.fsdp_s == 0.0
        for between in sm.BETWEEN_NODES:
            runs = [p for n in sm.WORKERS if (p := sm.predict(config, shape, calibration, n, between, fsdp)).epoch_s]
            assert [p.workers for p in runs][:4] == [1, 2, 4, 8]
            for fewer, more in itertools.pairwise(runs):
                assert more.efficiency <= fewer.efficiency
                # sharded, the epoch may grow where the ring leaves NVLink: the weights' gathers outweigh the compute
                if not fsdp or more.link == fewer.link:
                    assert more.epoch_s < fewer.epoch_s
    slow, fast = (sm.predict(config, shape, calibration, 16, link) for link in sm.BETWEEN_NODES)
    slow_fsdp, fast_fsdp = (sm.predict(config, shape, calibration, 16, link, True) for link in sm.BETWEEN_NODES)
    assert slow.efficiency < fast.efficiency and slow_fsdp.efficiency < fast_fsdp.efficiency
    assert fast_fsdp.efficiency < fast.efficiency


def test_nvlink_alone_reaches_one_node():
    config = recipe("sd35-medium-ocr")
    prediction = sm.predict(config, SD3_LIKE, sm.calibrate(config, SD3_LIKE), 16, None)
    assert prediction.epoch_s is None and "NVLink" in prediction.problems[0]


# --- the real shape: the product's adapter, counted --------------------------------------------------------------

def test_the_real_sd35_medium_shape_matches_the_h100_flop_count_and_the_lora_by_hand():
    shape = sm.real_shape(recipe("sd35-medium-ocr"), "sd35-medium")
    # docs/PERFORMANCE.md: F = 4.49 TFLOP per CFG forward (two rows), counted on the H100 by FlopCounterMode
    assert 2 * shape.forward_flops == pytest.approx(4.49e12, rel=0.005)
    # r32 on 8 square 1536-wide projections in each of 24 blocks, less the last block's to_add_out (context_pre_only)
    assert shape.lora_params == 32 * (1536 + 1536) * (24 * 8 - 1)
    assert shape.cfg and shape.batched_cfg and shape.fsdp_units == 24 + 1
    assert shape.weight_bytes == pytest.approx(2 * shape.transformer_params, rel=0.001)  # bf16, LoRA excluded
