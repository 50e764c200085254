"""The algorithm seam (components/algorithms/base.py): an algorithm is one module, found without being listed, whose
section is validated with every config, and whose top level imports no torch."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Written exactly as docs/DESIGN.md, "Adding an algorithm", says: nothing outside this module names it.
TOY = '''
"""A toy algorithm: ODE rollouts, then pushing the velocity at the clean samples along their advantages, scaled by
its section's `scale`. Its loss is all it writes: the update's loop, micro-batches and steps are the seam's."""

from __future__ import annotations

from pydantic import Field

from components.algorithms.base import Algorithm, AlgorithmConfig, register


class ToyConfig(AlgorithmConfig):
    scale: float = Field(default=1.0, gt=0, description="the loss's weight")


@register("toy")
class Toy(Algorithm):
    name = "Toy"
    Config = ToyConfig

    def loss(self, batch, term):
        v = self.model.predict_velocity(batch.x0, 0.5, batch.cond, 1.0)
        weights = batch.advantages.view(-1, *[1] * (v.ndim - 1))
        loss = -self.section.scale * (weights * v.float()).mean()
        return loss, {"toy/loss": loss.detach()}
'''

TRAIN = """
import json, sys
from pipeline.config import TINY_CONFIG, load_config
from components.errors import ConfigError
from components.trainer.training_run import train
from safetensors.torch import load_file

try:
    load_config(TINY_CONFIG, ["train.algorithm=toy", "train.toy.scale=0"])
except ConfigError as exc:
    refused = str(exc)
config = load_config(TINY_CONFIG, ["train.algorithm=toy", "train.toy.scale=2", "train.epochs=2",
                                   "tracking.sample_every=0", "train.batch_size_per_worker=16",
                                   "train.gradient_accumulation_steps=2"])
result = train(config, sys.argv[1], log=lambda _m: None)
lora = load_file(str(result.lora_dir / "pytorch_lora_weights.safetensors"))
print(json.dumps({"refused": refused, "history": result.history, "scale": config.train.toy.scale,
                  "lora_b_max": max(float(t.abs().max()) for k, t in lora.items() if "lora_B" in k)}))
"""

NO_TORCH = """
import json, sys
from components.algorithms.base import algorithms
from pipeline.config import TINY_CONFIG, load_config
keys = list(algorithms())
for key in keys:
    load_config(TINY_CONFIG, [f"train.algorithm={key}"])
print(json.dumps({"keys": keys, "torch": "torch" in sys.modules}))
"""


def _tree_with_toy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for package in ("components", "pipeline"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "components" / "algorithms" / "toy.py").write_text(textwrap.dedent(TOY))
    return root


def _run(code: str, cwd: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(cwd)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_toy_algorithm_added_as_its_loss_in_one_module_is_validated_selected_and_trained(tmp_path):
    root = _tree_with_toy(tmp_path)
    out = _run(TRAIN, root, str(tmp_path / "run"))
    assert "train.toy.scale" in out["refused"] and "greater than 0" in out["refused"]
    assert out["scale"] == 2.0
    history = out["history"]
    # 64 samples in micro-batches of 16, 2 accumulated per optimizer step: the shared loop's 2 steps an epoch
    assert [r["optimizer_step"] for r in history] == [2, 4]
    assert all(r["toy/loss"] != 0 and r["grad_norm"] > 0 and 0 < r["trained_fraction"] <= 1 for r in history)
    assert out["lora_b_max"] > 0  # peft starts lora_B at 0: the toy's steps moved it


def test_importing_every_algorithm_and_validating_a_config_for_each_imports_no_torch(tmp_path):
    """The light pipeline steps validate configs in an image without torch."""
    out = _run(NO_TORCH, _tree_with_toy(tmp_path))
    assert {"flow_grpo", "diffusion_nft", "toy"} <= set(out["keys"])
    assert out["torch"] is False


def test_two_modules_registering_one_key_are_refused():
    import pytest

    from components.algorithms.base import Algorithm, register
    from components.algorithms.flow_grpo import FlowGRPO

    assert register("flow_grpo")(FlowGRPO) is FlowGRPO  # registering the same class again is harmless
    with pytest.raises(ValueError, match="two algorithms are registered as 'flow_grpo'"):
        register("flow_grpo")(type("Other", (Algorithm,), {}))
