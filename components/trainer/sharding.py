"""``train.sharding: fsdp``: the frozen transformer weights sharded across the data-parallel workers.

PyTorch FSDP2 (``fully_shard``) wraps each repeated transformer block, then the transformer itself, over the
workers' process group (Ray Train's: NCCL on GPU, gloo on CPU). A block's weights are all-gathered just before
its forward (sampling, training, the KL reference, and again in the backward pass) and freed after it, so a
worker holds 1/N of the base weights plus one block at a time.

The LoRA parameters are left out of FSDP (``ignored_params``): they are small, stay float32 beside bf16 base
weights (FSDP2 wants one dtype per group), and stay plain tensors on every worker, so gradients are averaged,
clipped and stepped exactly as unsharded, and checkpoints, EMA and the saved LoRA are the same files either way.
"""

from __future__ import annotations

import warnings

import torch

from components.errors import ConfigError
from components.models.base import FlowMatchingModel


def shard_transformer(model: FlowMatchingModel, lora: list[torch.nn.Parameter], world_size: int) -> int:
    """Shard ``model``'s transformer over the default process group; returns the number of blocks sharded.

    The transformer may still be in host memory: FSDP moves each block to the device as it shards it, so the
    accelerator never holds the whole model.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise ConfigError("train.sharding is 'fsdp' but this process has no process group: FSDP shards across "
                          "Ray Train workers, so run with --ray-workers N (or on a cluster), or set "
                          "train.sharding: none")
    blocks = model.blocks()
    if not blocks:
        raise ConfigError(f"train.sharding: {type(model.transformer).__name__} declares no repeated blocks "
                          "(_no_split_modules) to shard")
    ignored = set(lora)
    with torch.no_grad():
        for p in lora:
            p.data = p.data.to(model.device)  # FSDP leaves ignored parameters where they are
    # Some diffusers blocks return their two streams as views of one tensor; FSDP warns in case a caller then
    # modifies them in place. The transformers never do (tests compare sharded gradients with unsharded ones).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(model.device.type, (world_size,))
    for block in blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(model.transformer, mesh=mesh, ignored_params=ignored)
    return len(blocks)
