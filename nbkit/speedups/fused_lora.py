"""Speedup ``fused_lora``: PEFT LoRA Linear layers (dense or 4-bit base) run ``ops.lora_linear.fused_lora_linear``.

Why and the numerics: ``nbkit.ops.lora_linear``. This module decides which layers qualify (one active vanilla
adapter, no DoRA/variant, no LoRA bias, dropout 0, not merged, a frozen ``nn.Linear`` or bitsandbytes ``Linear4bit``
base, not ``fan_in_fan_out``) and gives each an instance ``forward`` through the ledger. At call time anything
unusual (adapters disabled, merged, ``adapter_names`` mixing) runs PEFT's own forward. A 4-bit base's weight is
dequantized at each call, unless the layer plan keeps a dequantized copy of it (``nf4_weights``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..ops.lora_linear import fused_lora_linear
from .ledger import PatchLedger
from .nf4_weights import is_linear4bit, weight_of

logger = logging.getLogger(__name__)


def _dense_weight(base: nn.Linear) -> Callable[[torch.dtype], torch.Tensor]:
    def weight(dtype: torch.dtype) -> torch.Tensor:
        return base.weight.to(dtype)

    return weight


def _nf4_weight(base: nn.Module) -> Callable[[torch.dtype], torch.Tensor]:
    def weight(dtype: torch.dtype) -> torch.Tensor:
        return weight_of(base, dtype)  # the copy the layer plan kept, where it keeps one

    return weight


_is_linear4bit = is_linear4bit


def _is_lora_linear(module: nn.Module) -> bool:
    """PEFT's LoRA wrapper of a Linear (dense or bitsandbytes), not Embedding/Conv/ParamWrapper."""
    try:
        from ..trl_seam import LoraLinear
    except ImportError:
        return False
    if isinstance(module, LoraLinear):
        return True
    try:
        from ..trl_seam import LoraLinear4bit
    except ImportError:
        return False
    return isinstance(module, LoraLinear4bit)


def why_not_fusable(module: nn.Module) -> Optional[str]:
    """None when ``module`` can run the fused forward; else the reason (for the one message per reason)."""
    if not _is_lora_linear(module):
        return "not a PEFT LoRA Linear"
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1:
        return "more than one active adapter"
    name = active[0]
    base = module.get_base_layer()
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out (Conv1D) base"
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False):
        return "a LoRA variant (DoRA or similar)"
    if getattr(module, "lora_bias", {}).get(name, False) or module.lora_B[name].bias is not None:
        return "LoRA bias"
    dropout = module.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and not (isinstance(dropout, nn.Dropout) and dropout.p == 0):
        return "lora_dropout > 0"
    if not isinstance(module.lora_A[name], nn.Linear) or not isinstance(module.lora_B[name], nn.Linear):
        return "non-Linear LoRA factors"
    if _is_linear4bit(base):
        if getattr(base.weight, "quant_state", None) is None:
            return "4-bit weight without quant_state"
    elif type(base) is not nn.Linear:
        return f"base layer {type(base).__name__}"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "trainable base weight"
    return None


def _fused_forward(module: nn.Module, name: str, weight_fn: Callable) -> Callable[..., torch.Tensor]:
    cls_forward = type(module).forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if (args or kwargs or module.disable_adapters or module.merged
                or module.active_adapters != [name] or not x.is_floating_point()):
            return cls_forward(module, x, *args, **kwargs)  # PEFT's own path for anything unusual
        base = module.get_base_layer()
        return fused_lora_linear(x, module.lora_A[name].weight, module.lora_B[name].weight, base.bias,
                                 module.scaling[name], weight_fn)

    return forward


class FusedLoRA:
    """Speedup: PEFT LoRA Linear layers run ``fused_lora_linear`` while attached (instance ``forward``, reversible)."""

    name = "fused_lora"

    def __init__(self) -> None:
        self._modules: list[nn.Module] = []
        self.skipped: dict[str, int] = {}
        self._ledger = PatchLedger(self.name)

    def attach(self, model: nn.Module) -> bool:
        self.detach()
        for module in model.modules():
            if not _is_lora_linear(module):
                continue
            reason = why_not_fusable(module)
            if reason is not None:
                self.skipped[reason] = self.skipped.get(reason, 0) + 1
                continue
            name = next(a for a in module.active_adapters if a in module.lora_A)
            base = module.get_base_layer()
            weight_fn = _nf4_weight(base) if _is_linear4bit(base) else _dense_weight(base)
            self._ledger.set(module, "forward", _fused_forward(module, name, weight_fn))
            self._modules.append(module)
        for reason, n in self.skipped.items():
            logger.warning("nbkit: fused_lora skips %d LoRA layer(s): %s (they keep PEFT's forward)", n, reason)
        return bool(self._modules)

    def detach(self) -> None:
        self._ledger.undo()
        self._modules = []

    @property
    def fused_layers(self) -> int:
        return len(self._modules)
