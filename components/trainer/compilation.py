"""``train.compile``: regional compilation of the transformer's repeated blocks.

Each block kind is compiled once and shared by every block of that kind. The forwards a run makes differ in
what dynamo guards on: sampling runs without autograd, training with it, the KL reference with the adapter
disabled, and a batch size seen a second time makes the batch dimension dynamic. Those variants all compile in
the first epoch; later epochs reuse them (tests count the graphs).
"""

from __future__ import annotations

from components.errors import ConfigError
from components.models.base import FlowMatchingModel

# dynamo's default of 8 compiled variants per code object is below (block kinds x forward kinds x shapes) for
# the families with two block kinds (SD3.5's dual-attention blocks, FLUX's single and double blocks); past the
# limit dynamo silently runs the block eagerly
RECOMPILE_LIMIT = 64


def compile_transformer(model: FlowMatchingModel) -> int:
    """Compile ``model``'s repeated transformer blocks in place; returns how many."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    blocks = model.compile_blocks()
    if not blocks:
        raise ConfigError(f"train.compile: {type(model.transformer).__name__} declares no repeated blocks "
                          "(_no_split_modules) to compile; set train.compile: false")
    return blocks
