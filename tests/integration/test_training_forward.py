"""The training forward's arithmetic: CFG's unconditional branch with and without gradient
(`train.cfg_uncond_grad`), the LoRA computed in the model's dtype with float32 weights, and host reads
(device syncs on an accelerator) that do not grow with the number of steps."""

from collections import Counter

import pytest
import torch
from algorithm_runs import algorithm_on
from tiny_families import recipe, text_twins
from torch.utils._python_dispatch import TorchDispatchMode

from components.errors import ConfigError
from components.flow_rl.rollout import SamplerSettings, plan_steps, sample_rollout
from components.flow_rl.update import Optimization
from components.models.config import LoRAConfig, ModelConfig
from components.models.loading import load_model
from pipeline.config import CONFIG_DIR, load_config

SCALE = 4.5
RECIPES = {kind: recipe(kind) for kind in text_twins()}
# each family guided as its recipe guides it; at SCALE where the recipe samples unguided (tiny-cpu.yaml)
GUIDANCE = {kind: load_config(path).sampling.guidance_scale for kind, path in RECIPES.items()}


def _model(kind: str = "tiny-sd3", dtype: str = "float32"):
    config = load_config(RECIPES[kind], [f"model.dtype={dtype}"])
    model = load_model(config.model, 0)
    torch.manual_seed(0)
    params = model.add_lora(config.model.lora)
    with torch.no_grad():  # peft starts lora_B at zero; a trained LoRA has both factors non-zero
        for p in params:
            p.normal_(0, 0.05)
    return model, params


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal up to float32 reordering (a batched forward sums in another order than two separate ones)."""
    return all(float((x - y).abs().max()) <= 1e-4 * float(y.abs().max()) for x, y in zip(a, b, strict=True))


def _cfg_grads(model, params, uncond_grad: bool | None) -> list[torch.Tensor]:
    """Gradients of a fixed function of the CFG velocity: from ``predict_velocity`` (``uncond_grad`` given) or
    computed here from the two branches' own forwards (``None``: unconditional branch without gradient)."""
    torch.manual_seed(1)
    x = torch.randn(2, *model.latent_shape(32))
    cond = model.encode_prompts(["a cat", "a red apple"])
    weight = torch.randn(2, *model.latent_shape(32))
    if uncond_grad is None:
        cond_v = model._forward(x, 0.6, cond, SCALE).float()
        with torch.no_grad():
            uncond_v = model._forward(x, 0.6, model.negative_embeddings().expand_to(2), SCALE).float()
        v = uncond_v + SCALE * (cond_v - uncond_v)
    else:
        v = model.predict_velocity(x, 0.6, cond, SCALE, uncond_grad=uncond_grad)
    return list(torch.autograd.grad((v * weight).sum(), params))


def test_cfg_uncond_grad_false_is_the_gradient_through_the_conditional_branch_alone():
    model, params = _model()
    detached = _cfg_grads(model, params, uncond_grad=False)
    reference = _cfg_grads(model, params, uncond_grad=None)
    exact = _cfg_grads(model, params, uncond_grad=True)
    assert _close(detached, reference)
    # the exact gradient also carries (1 - scale) x the unconditional branch's: a different gradient
    diff = sum(float((a - b).norm()) for a, b in zip(exact, detached, strict=True))
    assert diff > 0.1 * sum(float(g.norm()) for g in exact)


def test_cfg_uncond_grad_true_is_the_gradient_of_both_branches():
    model, params = _model()
    x = torch.randn(2, *model.latent_shape(32))
    cond = model.encode_prompts(["a cat", "a red apple"])
    weight = torch.randn_like(x)
    cond_v = model._forward(x, 0.6, cond, SCALE).float()
    uncond_v = model._forward(x, 0.6, model.negative_embeddings().expand_to(2), SCALE).float()
    reference = torch.autograd.grad(((uncond_v + SCALE * (cond_v - uncond_v)) * weight).sum(), params)
    batched = torch.autograd.grad((model.predict_velocity(x, 0.6, cond, SCALE) * weight).sum(), params)
    assert _close(list(batched), list(reference))


def test_cfg_uncond_grad_false_without_train_cfg_is_refused():
    with pytest.raises(ConfigError, match=r"train\.cfg_uncond_grad is false but train\.train_cfg is false"):
        load_config(CONFIG_DIR / "tiny-cpu.yaml", ["train.cfg_uncond_grad=false"])


def test_the_lora_runs_in_the_model_dtype_and_trains_float32_weights():
    model = load_model(ModelConfig(dtype="bfloat16"), 0)
    model.add_lora(LoRAConfig(rank=4, alpha=8.0, target_modules=["attn.to_q"]))
    layer = model.transformer.transformer_blocks[0].attn.to_q
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        b.normal_(0, 0.1)
    assert a.dtype == b.dtype == torch.float32
    x = torch.randn(3, 5, a.shape[1], dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    # independently: the base layer plus the two LoRA matmuls on bf16 copies of the weights, all in bf16
    delta = torch.nn.functional.linear(torch.nn.functional.linear(x, a.to(torch.bfloat16)), b.to(torch.bfloat16))
    expected = layer.base_layer(x) + delta * layer.scaling["default"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().square().sum().backward()
    assert a.grad is not None and a.grad.dtype == torch.float32 and float(a.grad.abs().sum()) > 0


# Ops that read a device tensor on the host, or build one from host data: each waits for the accelerator
_SYNCING = {"_local_scalar_dense", "lift_fresh", "lift_fresh_copy", "nonzero", "equal", "is_nonzero", "item"}


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNCING:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _settings(steps: int, guidance: float) -> SamplerSettings:
    sde, train = plan_steps(steps, 0.99, None)
    return SamplerSettings(steps, guidance, 0.7, "sde", 32, sde, train)


@pytest.mark.parametrize("kind", RECIPES)
def test_host_reads_per_rollout_and_update_do_not_grow_with_the_steps(kind):
    """Sampling and training make no host read per step (on a GPU, each would stall the launch queue).

    Prompts of one length: with padded prompts diffusers' Qwen-Image transformer itself builds a tensor from the
    text length on every forward (``compute_text_seq_len_from_mask``), which is not ours to change."""
    model, params = _model(kind)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    prompts = ["a cat", "a dog"]
    embeds = model.encode_prompts(prompts)
    model.negative_embeddings()
    g = GUIDANCE[kind] if GUIDANCE[kind] > 1 else SCALE
    algorithm = algorithm_on(model, params, load_config(RECIPES[kind], []), g, batch_size_per_worker=4,
                             gradient_accumulation_steps=1, inner_epochs=1, clip_range=0.2, beta=0.04,
                             max_grad_norm=1.0, skip_zero_advantage=False, train_cfg=True)
    reads = {}
    for steps in (3, 3, 6):  # the first update also builds the optimizer's state
        settings = _settings(steps, g)
        with _HostReads() as sampling:
            rollout = sample_rollout(model, prompts, 2, 4, settings, torch.Generator().manual_seed(0), embeds=embeds)
        with _HostReads() as training:
            algorithm.update(rollout, torch.randn(4), torch.randn(4), settings, torch.Generator().manual_seed(0),
                             Optimization(optimizer, params, 1.0))
        reads[steps] = (sampling.ops, training.ops)
    assert reads[3] == reads[6], reads
    # what remains is per sampling batch (2 here: the VAE's constants, a mask read once) and per optimizer step
    # (AdamW's step counters, host tensors on CPU; fused AdamW keeps them on a GPU)
    assert sum(reads[6][0].values()) <= 3 * 2 and sum(reads[6][1].values()) <= len(params) + 1, reads
