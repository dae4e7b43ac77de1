"""The decoder's dense MLPs run over tiles of the sequence (``tiled_mlp``), for rows too long to train otherwise.

Why: with gradient checkpointing, the layer being recomputed holds its MLP's (tokens x intermediate) activations for
its backward; at long context they are the largest tensors of the step (Llama-3.1-8B: 14,336 wide, ~28 KiB a token
in bf16 each, three of them), and they, not the checkpointed layer inputs, decide how long a row fits.
``nbkit.ops.tiled_mlp`` computes the MLP tile by tile and recomputes each tile in backward, so only one tile's
activations exist at a time. The price is one more MLP forward per layer in backward.

How it hooks in: each decoder layer's dense MLP (a module with ``gate_proj``, ``up_proj`` and ``down_proj``, no
``experts``) gets an instance ``forward``, through the ledger, that calls the forward it found (transformers', or
fused_kernels' when that attached first) through ``tiled_mlp`` when the call has more tokens than one tile, and
directly otherwise: short rows pay one comparison. MoE blocks and other MLPs keep their forward.

``auto`` (the default): a call is tiled only when its untiled MLP would crowd the GPU, judged per call from the
allocator's counters (host-side, no sync): the MLP's working set, ~6 (tokens x intermediate) tensors, counts once it
is 1/16 of the GPU's memory (the per-process fraction applied), and the call is tiled when the memory in use plus
that working set would pass 90% of it. The decision is made once per input shape and kept: a checkpointed layer's
recompute must save what its forward saved (non-reentrant checkpointing checks), whatever the memory then. Rows
that fit run the plain MLP at full speed; off a CUDA GPU it does not attach.

Contract: the same math as the plain MLP (it is the same forward, called on slices of the tokens); gradients of the
MLP's trainable parameters (LoRA adapters, or the full weights) summed over tiles in fp32. Parity with the plain
path: tests/test_tiled_mlp_speedup.py.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

from ..memory import gpu_in_use, gpu_limit
from ..model_parts import unwrap_model
from ..ops.tiled_mlp import tiled_mlp
from .ledger import PatchLedger

logger = logging.getLogger(__name__)


def _is_dense_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")) and not hasattr(module, "experts")


WORKING_SET = 6  # (tokens x intermediate) tensors of one MLP call and its backward: gate, up, their product, grads
COUNTS_FROM = 1 / 16  # of the GPU's memory: below that, a call's MLP is not worth a look at the allocator
FILL = 0.9


def needs_tiles(tokens: int, intermediate: int, elem_bytes: int, limit: int, in_use: Callable[[], int]) -> bool:
    """'auto''s rule: whether the untiled MLP of a call would take the GPU past ``FILL`` of ``limit`` bytes.
    ``in_use`` (bytes held by tensors) is read only for calls whose MLP counts."""
    need = WORKING_SET * tokens * intermediate * elem_bytes
    return need >= COUNTS_FROM * limit and in_use() + need > FILL * limit


def _tiled_forward(forward: Callable[[torch.Tensor], torch.Tensor], module: nn.Module,
                   tile_tokens: int, auto_intermediate: Optional[int] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    decided: dict[tuple, bool] = {}  # auto: one decision per input shape, so a checkpoint's recompute repeats it

    def forward_in_tiles(x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-2] <= tile_tokens:
            return forward(x)
        if auto_intermediate is not None:
            key = (tuple(x.shape), x.dtype, x.device)
            if key not in decided:
                if len(decided) > 256:
                    decided.clear()
                limit = gpu_limit(x.device)
                tokens = x.numel() // x.shape[-1]
                # in use now, plus what backward adds beside the MLP (the hidden states' gradients, ~4 of x)
                decided[key] = limit is not None and needs_tiles(
                    tokens, auto_intermediate, x.element_size(), limit,
                    lambda: gpu_in_use(x.device) + 4 * x.numel() * x.element_size())
            if not decided[key]:
                return forward(x)
        # read at call time, not kept from attach: whatever the module holds now (cuda_graphs swaps in stand-ins)
        trainable = [p for p in module.parameters() if p.requires_grad]
        return tiled_mlp(forward, x, trainable, tile_tokens=tile_tokens)

    forward_in_tiles.nbkit_tiled = True
    return forward_in_tiles


class TiledMLP:
    """Speedup: the dense MLPs of one model run over tiles of ``tile_tokens`` tokens while attached.

    ``tile_tokens=None``: tiles of the model's hidden size in tokens, so one tile's (tokens x intermediate)
    activation is the size of one MLP weight. ``auto``: only calls that would crowd the GPU are tiled (``needs_tiles``).
    """

    name = "tiled_mlp"

    def __init__(self, tile_tokens: Optional[int] = None, auto: bool = False) -> None:
        if tile_tokens is not None and tile_tokens < 1:
            raise ValueError(f"tiled_mlp: tile_tokens must be at least 1, not {tile_tokens}")
        self.tile_tokens = tile_tokens
        self.auto = auto
        self._ledger = PatchLedger(self.name)
        self.count = 0

    def attach(self, model: nn.Module) -> bool:
        self.detach()
        base = unwrap_model(model)
        config = getattr(base, "config", None)
        text = config.get_text_config() if config is not None else None
        hidden = getattr(text, "hidden_size", None)
        tile = self.tile_tokens or hidden
        if not tile:
            logger.info("nbkit: tiled_mlp found no hidden_size in the config and no tile_tokens; plain MLPs kept")
            return False
        intermediate = None
        if self.auto:
            device = next((p.device for p in base.parameters()), torch.device("cpu"))
            if gpu_limit(device) is None:
                logger.info("nbkit: tiled_mlp='auto' stays off: the model is on %s, not a CUDA GPU", device.type)
                return False
            intermediate = getattr(text, "intermediate_size", None) or 4 * (hidden or tile)
        for module in base.modules():
            if _is_dense_mlp(module) and not getattr(module.forward, "nbkit_tiled", False):
                wrapped = _tiled_forward(module.forward, module, tile, intermediate)
                self._ledger.set(module, "forward", wrapped)
                self.count += 1
        if not self.count:
            logger.info("nbkit: tiled_mlp found no dense MLP (gate/up/down projections) in this model; plain kept")
        return self.count > 0

    def detach(self) -> None:
        self._ledger.undo()
        self.count = 0
