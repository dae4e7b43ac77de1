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

Contract: the same math as the plain MLP (it is the same forward, called on slices of the tokens); gradients of the
MLP's trainable parameters (LoRA adapters, or the full weights) summed over tiles in fp32. Parity with the plain
path: tests/test_tiled_mlp_speedup.py.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

from ..ops.tiled_mlp import tiled_mlp
from .ledger import PatchLedger, unwrap_model

logger = logging.getLogger(__name__)


def _is_dense_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")) and not hasattr(module, "experts")


def _tiled_forward(forward: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter],
                   tile_tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward_in_tiles(x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-2] <= tile_tokens:
            return forward(x)
        trainable = [p for p in params if p.requires_grad]
        return tiled_mlp(forward, x, trainable, tile_tokens=tile_tokens)

    forward_in_tiles.nbkit_tiled = True
    return forward_in_tiles


class TiledMLP:
    """Speedup: the dense MLPs of one model run over tiles of ``tile_tokens`` tokens while attached.

    ``tile_tokens=None``: tiles of the model's hidden size in tokens, so one tile's (tokens x intermediate)
    activation is the size of one MLP weight.
    """

    name = "tiled_mlp"

    def __init__(self, tile_tokens: Optional[int] = None) -> None:
        if tile_tokens is not None and tile_tokens < 1:
            raise ValueError(f"tiled_mlp: tile_tokens must be at least 1, not {tile_tokens}")
        self.tile_tokens = tile_tokens
        self._ledger = PatchLedger(self.name)
        self.count = 0

    def attach(self, model: nn.Module) -> bool:
        self.detach()
        base = unwrap_model(model)
        config = getattr(base, "config", None)
        hidden = getattr(config.get_text_config(), "hidden_size", None) if config is not None else None
        tile = self.tile_tokens or hidden
        if not tile:
            logger.info("nbkit: tiled_mlp found no hidden_size in the config and no tile_tokens; plain MLPs kept")
            return False
        for module in base.modules():
            if _is_dense_mlp(module) and not getattr(module.forward, "nbkit_tiled", False):
                self._ledger.set(module, "forward", _tiled_forward(module.forward, list(module.parameters()), tile))
                self.count += 1
        if not self.count:
            logger.info("nbkit: tiled_mlp found no dense MLP (gate/up/down projections) in this model; plain kept")
        return self.count > 0

    def detach(self) -> None:
        self._ledger.undo()
        self.count = 0
