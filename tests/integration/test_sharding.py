"""`train.sharding: fsdp` on 2 workers in one gloo process group (as Ray Train forms it), for the tiny twins
of every family: the frozen weights are sharded, the LoRA trained sharded equals the LoRA trained unsharded, and
a checkpoint written one way resumes the other way."""

import json
from pathlib import Path

import pytest
import torch
from metric_rows import without_timing
from process_group import run_in_process_group
from safetensors.torch import load_file
from sharded_training import FAMILIES, LAYOUT_FILE, compiled_sharded_run, plain_and_sharded_runs

from components.trainer import checkpoint as ckpt


def _lora(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / ckpt.LORA_FILE))


def _metrics(run: Path) -> list[dict]:
    return without_timing([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()])


def _same_rows(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-9)
                                                                 for k in x) for x, y in zip(a, b, strict=True))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharding")
    run_in_process_group(plain_and_sharded_runs, 2, str(root), list(FAMILIES))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAMILIES)
def test_fsdp_shards_the_frozen_weights_and_keeps_the_lora_whole(runs, kind):
    layout = json.loads((runs / kind / LAYOUT_FILE).read_text())
    assert layout["base_sharded"] and layout["lora_plain"]
    assert layout["base_local_fraction"] == pytest.approx(0.5, abs=0.02)  # rank 0 holds about half of the base
    assert layout["largest_local_fraction"] <= 1.0  # no parameter is held whole


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_lora_trained_sharded_equals_the_lora_trained_unsharded(runs, kind):
    plain, sharded = runs / kind / "plain", runs / kind / "fsdp"
    # after 2 epochs = 4 optimizer steps, with KL and EMA
    two = ckpt.checkpoint_name(2)
    assert _equal(_lora(sharded / "checkpoints" / two), _lora(plain / "checkpoints" / two))
    assert _equal(_lora(sharded / "lora"), _lora(plain / "checkpoints" / two))
    assert any(float(v.abs().max()) > 1e-4 for v in _lora(sharded / "lora").values())  # it did train
    state = ckpt.read_checkpoint(str(sharded / "checkpoints" / two))
    reference = ckpt.read_checkpoint(str(plain / "checkpoints" / two))
    assert state.optimizer_step == reference.optimizer_step == 4
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(state.lora, reference.lora, strict=True))
    assert (state.algorithm is None) == (reference.algorithm is None) == (kind != "tiny-sd3-nft")
    if reference.algorithm is not None:  # DiffusionNFT's old policy moved the same way
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(
            state.algorithm["old_policy"], reference.algorithm["old_policy"], strict=True))
    assert _same_rows(_metrics(sharded), _metrics(plain)[:2])


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_checkpoint_written_sharded_resumes_unsharded_and_the_reverse(runs, kind):
    reference = runs / kind / "plain"  # continued unsharded to epoch 3
    for resumed in ("plain-then-fsdp", "fsdp-then-plain"):
        run = runs / kind / resumed
        assert ckpt.latest_checkpoint(run) == str(run / "checkpoints" / ckpt.checkpoint_name(3))
        assert _equal(_lora(run / "lora"), _lora(reference / "lora")), resumed
        assert _same_rows(_metrics(run), _metrics(reference)), resumed


@pytest.mark.slow
def test_compiled_blocks_with_checkpointing_train_sharded_as_the_plain_eager_run(runs, tmp_path):
    run_in_process_group(compiled_sharded_run, 2, str(tmp_path), "tiny-sd3")
    plain_run = runs / "tiny-sd3" / "plain"  # continued to a third epoch: its first two are the reference
    compiled, plain = _metrics(tmp_path / "tiny-sd3" / "fsdp-compiled"), _metrics(plain_run)[:2]
    assert len(compiled) == len(plain) == 2
    for c, p in zip(compiled, plain, strict=True):  # inductor's float32 sums differ from eager's in the last bits
        assert c["reward/mean"] == pytest.approx(p["reward/mean"], rel=1e-4)
        assert c["policy_loss"] == pytest.approx(p["policy_loss"], rel=1e-2, abs=1e-7)
        assert c["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-2)
    trained = _lora(tmp_path / "tiny-sd3" / "fsdp-compiled" / "lora")
    reference = _lora(plain_run / "checkpoints" / ckpt.checkpoint_name(2))
    assert trained.keys() == reference.keys()
    assert all(torch.allclose(trained[k], reference[k], atol=1e-3) for k in trained)  # lr 3e-3 x 4 Adam steps
