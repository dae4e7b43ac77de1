"""The decoder's dense MLPs run over tiles of the sequence (``tiled_mlp``), for rows too long to train otherwise.

Why: with gradient checkpointing, the layer being recomputed holds its MLP's (tokens x intermediate) activations for
its backward; at long context they are the largest tensors of the step (Llama-3.1-8B: 14,336 wide, three of them),
and they, not the checkpointed layer inputs, decide how long a row fits. ``nbkit.ops.tiled_mlp`` computes the MLP
tile by tile and recomputes each tile in backward, so only one tile's activations exist at a time. The price is one
more MLP forward per layer in backward.

How it runs: a mode of the layer runner (``layer_runner``), which owns each decoder layer's MLP ``forward`` and asks
``wants`` at each call of a dense MLP (``gate_proj``, ``up_proj``, ``down_proj``, no ``experts``) with more tokens
than one tile; short rows pay one comparison. MoE blocks and other MLPs are never tiled.

``auto`` (the default): a call is tiled only when its untiled MLP would crowd the GPU, judged per call by the run's
budget (``layer_budget.Budget.crowded``: the MLP's working set, ~6 (tokens x intermediate) tensors, beside what is in
use and what backward adds, past the budget's margin). The decision is made once per layer and input shape and kept:
a checkpointed layer's recompute must save what its forward saved (non-reentrant checkpointing checks), whatever the
memory then; and memory in use grows through a forward, so a later layer may need tiles where an earlier does not.
Off a CUDA GPU 'auto' takes no part.

Contract: the same math as the plain MLP (it is the same forward, called on slices of the tokens); gradients of the
MLP's trainable parameters (LoRA adapters, or the full weights) summed over tiles in fp32. Parity with the plain
path: tests/test_tiled_mlp_speedup.py.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..memory import gpu_limit
from ..ops.tiled_mlp import tiled_mlp

logger = logging.getLogger(__name__)


def _is_dense_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")) and not hasattr(module, "experts")


WORKING_SET = 6  # (tokens x intermediate) tensors of one MLP call and its backward: gate, up, their product, grads


class TiledMLP:
    """The tiled-MLP mode: the decoder's dense MLPs over tiles of ``tile_tokens`` tokens while the runner runs.

    ``tile_tokens=None``: tiles of the model's hidden size in tokens, so one tile's (tokens x intermediate)
    activation is the size of one MLP weight. ``auto``: only calls that would crowd the GPU are tiled. ``count``: the
    dense MLPs it may tile.
    """

    name = "tiled_mlp"

    def __init__(self, tile_tokens: Optional[int] = None, auto: bool = False) -> None:
        if tile_tokens is not None and tile_tokens < 1:
            raise ValueError(f"tiled_mlp: tile_tokens must be at least 1, not {tile_tokens}")
        self.tile_tokens = tile_tokens
        self.auto = auto
        self.count = 0
        self._tile = 0
        self._intermediate: Optional[int] = None
        self._decided: dict[int, dict[tuple, bool]] = {}  # auto: per layer, one decision per input shape
        self._runner: Any = None

    # ---------------------------------------------------------------------------------------------- the runner's
    def prepare(self, runner: Any, base: nn.Module) -> bool:
        """Whether this mode takes part for ``base`` (a tile size, dense MLPs, and for 'auto' a CUDA GPU)."""
        self._runner, self._decided, self.count = runner, {}, 0
        config = getattr(base, "config", None)
        text = config.get_text_config() if config is not None else None
        hidden = getattr(text, "hidden_size", None)
        self._tile = self.tile_tokens or hidden or 0
        if not self._tile:
            logger.info("nbkit: tiled_mlp found no hidden_size in the config and no tile_tokens; plain MLPs kept")
            return False
        if self.auto:
            if gpu_limit(runner.budget.device) is None:
                logger.info("nbkit: tiled_mlp='auto' stays off: the model is on %s, not a CUDA GPU",
                            runner.budget.device.type)
                return False
            self._intermediate = getattr(text, "intermediate_size", None) or 4 * (hidden or self._tile)
        from .layer_runner import ffn_of

        self.count = sum(1 for layer in runner.layers if (m := ffn_of(layer.module)) is not None and _is_dense_mlp(m))
        if not self.count:
            logger.info("nbkit: tiled_mlp found no dense MLP (gate/up/down projections) in this model; plain kept")
        return self.count > 0

    def wants(self, runner: Any, layer: Any, x: torch.Tensor) -> bool:
        """Whether this call of ``layer``'s MLP runs in tiles."""
        if x.dim() < 2 or x.shape[-2] <= self._tile or layer.mlp is None or not _is_dense_mlp(layer.mlp):
            return False
        if self._intermediate is None:
            return True
        # per layer: memory in use grows through a forward, so a later layer may be crowded where an earlier is not
        decided = self._decided.setdefault(layer.index, {})
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in decided:
            if len(decided) > 256:
                decided.clear()
            tokens = x.numel() // x.shape[-1]
            need = WORKING_SET * tokens * self._intermediate * x.element_size()
            # beside what is in use, what backward adds around the MLP (the hidden states' gradients, ~4 of x)
            decided[key] = runner.budget.crowded(need, extra=4 * x.numel() * x.element_size())
        return decided[key]

    def bind(self, layer: Any, forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward`` of ``layer``'s MLP, over tiles."""
        module, tile = layer.mlp, self._tile

        def forward_in_tiles(x: torch.Tensor) -> torch.Tensor:
            # read at call time: whatever the module holds now (graph captures swap in stand-ins)
            trainable = [p for p in module.parameters() if p.requires_grad]
            return tiled_mlp(forward, x, trainable, tile_tokens=tile)

        return forward_in_tiles

    # ----------------------------------------------------------------------------------------------- on its own
    def attach(self, model: nn.Module) -> bool:
        """Outside FastSFT: a layer runner with this mode alone."""
        from .layer_runner import standalone

        self.detach()
        self._runner = standalone(self, "tiled", model)
        return self._runner.tiled is self

    def detach(self) -> None:
        if self._runner is not None and self._runner.tiled is self:
            self._runner.detach()
        self._runner = None
