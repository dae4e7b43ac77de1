"""Dequantized weights kept: the frozen 4-bit base weights of fused LoRA layers, dequantized once, while memory allows.

Why: QLoRA dequantizes every frozen 4-bit weight twice a step, for the forward GEMM and again for the input gradient
in backward (``nbkit.ops.lora_linear``, as bitsandbytes does), so that memory holds the 4-bit weights only. On a GPU
with memory to spare (a 1.7B model on a 141 GB card uses a few GB of it) the step pays the dequantization kernels and
their launches for memory nobody uses. This mode lets the layer plan (``layer_plan``) spend that memory, layer by
layer: a layer's base weights dequantized once, in the step's compute dtype, kept beside each ``Linear4bit``
(``nf4_weights``), and ``fused_lora``'s weight function returns them instead of dequantizing. The tensor is what
bitsandbytes' dequantization returns, so every output and gradient is bit for bit the same.

When: at the plan's first look (after step 1) and its second, from the same budget as the activations and after
them: keeping a layer's activations saves its whole forward recompute, a kept weight only its dequantization.

Which weights: the frozen NF4/FP4 bases of the LoRA layers ``fused_lora`` runs (``fused_lora.why_not_fusable``); only
the fused path reads the kept copy (PEFT's own forward dequantizes as before). The dtype is the trainer's compute
dtype (fp16 or bf16 mixed precision; else the weight's own ``quant_state`` dtype).

Modes: "auto" (on CUDA, sized by the budget), True (every qualifying weight, wherever: for tests), False.
Contract: the same outputs and gradients, bit for bit; detaching drops every kept copy (its memory is free again).
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional, Union

import torch

from ..say_once import SayOnce
from ..settings import check_value
from .fused_lora import _is_lora_linear, why_not_fusable
from .nf4_weights import DEQUANTIZED, dequantized_bytes, is_linear4bit, keep, kept_bytes

__all__ = ["DEQUANTIZED", "DequantCache", "compute_dtype", "kept_bytes"]

logger = logging.getLogger(__name__)

Mode = Union[bool, Literal["auto"]]


def _bases(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The 4-bit bases of the LoRA layers fused_lora runs inside ``module``, in module order."""
    found = []
    for m in module.modules():
        if _is_lora_linear(m) and why_not_fusable(m) is None:
            base = m.get_base_layer()
            if is_linear4bit(base):
                found.append(base)
    return found


class DequantCache:
    """The dequantized-weights mode of the layer plan. ``dtype``: the compute dtype of the trainer's steps (None:
    each weight's ``quant_state`` dtype). ``kept_bytes``: what the copies take now (0: none kept)."""

    name = "dequant_cache"

    def __init__(self, mode: Mode = "auto", dtype: Optional[torch.dtype] = None) -> None:
        check_value("dequant_cache", mode)
        self.mode, self.dtype = mode, dtype
        self._say = SayOnce(logger, "nbkit dequant_cache")
        self._runner: Any = None
        self.kept_bytes = 0

    @property
    def engaged(self) -> bool:
        """Whether copies are kept now."""
        return self.kept_bytes > 0

    # ---------------------------------------------------------------------------------------------- the runner's
    def take(self, runner: Any) -> bool:
        """Find each layer's 4-bit bases (``Layer.bases``); whether there are any (and for 'auto', memory counters)."""
        self._runner, self.kept_bytes = runner, 0
        if self.mode is False:
            return False
        for layer in runner.layers:
            layer.bases = _bases(layer.module)
        if not any(layer.bases for layer in runner.layers):
            self._say("none", "no 4-bit base weight under a fused LoRA layer; nothing to keep", logging.INFO)
            return False
        if self.mode == "auto" and not runner.budget.measured:
            self._say("auto", f"off (model on {runner.budget.device.type}; 'auto' sizes by CUDA memory)", logging.INFO)
            return False
        return True

    def _dtype(self, base: torch.nn.Module) -> torch.dtype:
        return self.dtype or getattr(base.weight.quant_state, "dtype", None) or torch.bfloat16

    def bytes_of(self, layer: Any) -> int:
        """What ``layer``'s bases take dequantized."""
        return sum(dequantized_bytes(b, self._dtype(b)) for b in layer.bases)

    def keep_layer(self, ledger: Any, layer: Any) -> None:
        """Keep ``layer``'s bases dequantized (through the runner's ledger: detaching drops them)."""
        self.kept_bytes += sum(keep(ledger, b, self._dtype(b)) for b in layer.bases)

    def release(self) -> None:
        self.kept_bytes = 0

    # ----------------------------------------------------------------------------------------------- on its own
    def attach(self, model: torch.nn.Module) -> bool:
        """Outside FastSFT: a layer runner with this mode alone (it decides at the first layer call of the second
        training forward)."""
        from .layer_runner import standalone

        self.detach()
        self._runner = standalone(self, "dequant", model)
        return self._runner.dequant is self

    @property
    def runner(self) -> Any:
        """The layer runner that drives this mode (None before ``attach`` or a runner's ``begin_training``)."""
        return self._runner

    def detach(self) -> None:
        if self._runner is not None and self._runner.dequant is self:
            self._runner.detach()
        self._runner = None
        self.kept_bytes = 0


def compute_dtype(args: Any) -> Optional[torch.dtype]:
    """The dtype a trainer's mixed precision computes in (None: no mixed precision, the weights' own)."""
    if getattr(args, "fp16", False):
        return torch.float16
    if getattr(args, "bf16", False):
        return torch.bfloat16
    return None
