"""Fused LoRA linear: ``x W^T + s (x A^T) B^T`` as one autograd function, for PEFT LoRA on nn.Linear and 4-bit bases.

Why: PEFT computes a LoRA layer as separate ops (the base output, a defensive clone for 4-bit bases, input casts,
``lora_B(lora_A(x))``, a multiply by the scale, an add), so every layer writes and reads several tensors of the
output's size in the forward and again in the backward. Profiled on an H200 (Qwen3-1.7B QLoRA, 16K tokens), copies,
casts and elementwise ops took ~40% of the step. Here the LoRA product is accumulated into the base output by the
GEMM itself (``addmm_`` with ``alpha=s``), and the backward is three small GEMMs plus one accumulate into the input
gradient. The frozen 4-bit weight is dequantized in the forward and again in the backward, as bitsandbytes does, so
memory is unchanged; only ``x`` (already kept by the base) and the rank-r product ``x A^T`` are saved.

Contract: the same outputs and gradients as PEFT's forward up to rounding (the LoRA term is added in fp32 inside the
GEMM instead of after three bf16 roundings). A layer qualifies when it has one active vanilla LoRA adapter (no DoRA
or other variant, no LoRA bias, dropout 0), is not merged, its base is an ``nn.Linear`` or a bitsandbytes
``Linear4bit`` with a frozen weight, and it is not ``fan_in_fan_out``. At call time anything unusual (adapters
disabled, merged, ``adapter_names`` mixing) runs PEFT's own forward, so switching adapters keeps working.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _FusedLoRALinear(torch.autograd.Function):
    """y = x W^T (+ bias) + s (x A^T) B^T with W given by ``weight_fn(dtype)`` (frozen, never a gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, bias: Optional[torch.Tensor],
                scaling: float, weight_fn: Callable[[torch.dtype], torch.Tensor]) -> torch.Tensor:
        dtype = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        w = weight_fn(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = torch.addmm(bias.to(dtype), x2, w.t()) if bias is not None else torch.mm(x2, w.t())
            xa = torch.mm(x2, a.t())
            y.addmm_(xa, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, xa, a, b)
        ctx.scaling, ctx.weight_fn, ctx.x_shape, ctx.x_dtype = scaling, weight_fn, x.shape, x.dtype
        ctx.param_dtypes = (lora_a.dtype, lora_b.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x2, xa, a, b = ctx.saved_tensors
        s = ctx.scaling
        g = grad_y.reshape(-1, grad_y.shape[-1]).to(x2.dtype)
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_a = grad_b = None
        with torch.autocast(x2.device.type, enabled=False):
            gb = torch.mm(g, b) if (need_x or need_a) else None  # (T, r)
            if gb is not None:
                gb.mul_(s)
            if need_x:
                grad_x = torch.mm(g, ctx.weight_fn(x2.dtype))
                grad_x.addmm_(gb, a)
                grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
            if need_a:
                grad_a = torch.mm(gb.t(), x2).to(ctx.param_dtypes[0])
            if need_b:
                grad_b = torch.mm(g.t(), xa.mul(s)).to(ctx.param_dtypes[1])
        return grad_x, grad_a, grad_b, None, None, None


def _dense_weight(base: nn.Linear) -> Callable[[torch.dtype], torch.Tensor]:
    def weight(dtype: torch.dtype) -> torch.Tensor:
        return base.weight.to(dtype)

    return weight


def _nf4_weight(base: nn.Module) -> Callable[[torch.dtype], torch.Tensor]:
    import bitsandbytes.functional as bnbf

    def weight(dtype: torch.dtype) -> torch.Tensor:
        w = base.weight
        return bnbf.dequantize_4bit(w.data, w.quant_state).to(dtype)

    return weight


def _is_linear4bit(module: nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def _is_lora_linear(module: nn.Module) -> bool:
    """PEFT's LoRA wrapper of a Linear (dense or bitsandbytes), not Embedding/Conv/ParamWrapper."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return False
    if isinstance(module, LoraLinear):
        return True
    try:
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
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
        return _FusedLoRALinear.apply(x, module.lora_A[name].weight, module.lora_B[name].weight, base.bias,
                                      module.scaling[name], weight_fn)

    return forward


class FusedLoRA:
    """Speedup: PEFT LoRA Linear layers run ``_FusedLoRALinear`` while attached (instance ``forward``, reversible)."""

    name = "fused_lora"

    def __init__(self) -> None:
        self._modules: list[nn.Module] = []
        self.skipped: dict[str, int] = {}

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
            module.forward = _fused_forward(module, name, weight_fn)
            self._modules.append(module)
        for reason, n in self.skipped.items():
            logger.warning("nbkit: fused_lora skips %d LoRA layer(s): %s (they keep PEFT's forward)", n, reason)
        return bool(self._modules)

    def detach(self) -> None:
        for module in self._modules:
            module.__dict__.pop("forward", None)
        self._modules = []

    @property
    def fused_layers(self) -> int:
        return len(self._modules)
