"""torch.compile applied per transformer block, in place so parameter names do not
change. Blocks share code, so one compilation serves all of them.

With tensor parallelism the compiled regions are each block's attention and MLP,
with the norms and residual adds left eager: measured on torch 2.13, a compiled
whole block hands a plain-tensor gradient to the DTensor redistribution before
it ("'Tensor' object has no attribute '_local_tensor'", with inductor and with
aot_eager), while attention and MLP compiled on their own give exactly the
eager gradients, with and without sequence parallelism and under FSDP.

Also measured: with TP, a second run that reuses the on-disk compile caches (FX
graph and AOTAutograd) of a first computes wrong losses or crashes, so with TP
those caches are off and every run compiles afresh.
"""

from __future__ import annotations

import torch._functorch.config
import torch._inductor.config
from torch import nn


def apply_compile(model: nn.Module, tensor_parallel: bool) -> None:
    if tensor_parallel:
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        regions = (inner.attention, inner.feed_forward) if tensor_parallel else (block,)
        for region in regions:
            region.compile(fullgraph=True)
