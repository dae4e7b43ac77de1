"""Fused LoRA linear: ``x W^T + s (x A^T) B^T`` in two autograd functions, for PEFT LoRA on nn.Linear and 4-bit bases.

Why: PEFT computes a LoRA layer as separate ops (the base output, a defensive clone for 4-bit bases, input casts,
``lora_B(lora_A(x))``, a multiply by the scale, an add), so every layer writes and reads several tensors of the
output's size in the forward and again in the backward. Profiled on an H200 (Qwen3-1.7B QLoRA, 16K tokens), copies,
casts and elementwise ops took ~40% of the step. Here the base GEMM accumulates into the LoRA product (``addmm_``,
the scale applied in the GEMM's epilogue), and the backward is three small GEMMs plus one accumulate into the input
gradient. The frozen 4-bit weight is dequantized in the forward and again in the backward, as bitsandbytes does, so
memory is unchanged; only ``x`` (already kept by the base) and the rank-r product ``x A^T`` are saved, and they are
saved before the base GEMM runs, so a checkpointed layer's recompute skips its final projection's base GEMM
(see ``_LoRAProduct``).

Contract: the same outputs and gradients as PEFT's forward up to rounding (the LoRA term is added in fp32 inside the
GEMM instead of after three bf16 roundings). A layer qualifies when it has one active vanilla LoRA adapter (no DoRA
or other variant, no LoRA bias, dropout 0), is not merged, its base is an ``nn.Linear`` or a bitsandbytes
``Linear4bit`` with a frozen weight, and it is not ``fan_in_fan_out``. At call time anything unusual (adapters
disabled, merged, ``adapter_names`` mixing) runs PEFT's own forward, so switching adapters keeps working.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _scaled_mm(m1: torch.Tensor, m2: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * (m1 @ m2)`` in one GEMM: the scale applied in its fp32 epilogue (beta=0: the scalar is never read)."""
    return torch.addmm(m1.new_empty(()), m1, m2, beta=0, alpha=scale)


class _LoRAProduct(torch.autograd.Function):
    """First half of a fused LoRA linear: ``s (x A^T) B^T (+ bias)``, the tensor the base GEMM accumulates into.

    It saves everything the layer's backward needs (``x``, ``x A^T``, A, B) before the base GEMM runs, so when a
    checkpointed layer is recomputed and this is the last thing it saves (the layer's final projection),
    non-reentrant checkpoint's early stop ends the recompute here and the base GEMM, whose output backward never
    reads, is not run again (about 1/6 of a decoder layer's recompute FLOPs for ``down_proj``).
    """

    @staticmethod
    def forward(ctx, x2: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, bias: Optional[torch.Tensor],
                scaling: float, link: dict) -> torch.Tensor:
        a, b = lora_a.to(x2.dtype), lora_b.to(x2.dtype)
        xa = torch.mm(x2, a.t())
        # beta=0: the (uninitialized) scalar is never read; the scale is applied in the GEMM's fp32 epilogue
        start = bias.to(x2.dtype) if bias is not None else x2.new_empty(())
        y = torch.addmm(start, xa, b.t(), beta=1 if bias is not None else 0, alpha=scaling)
        ctx.save_for_backward(x2, xa, a, b)
        ctx.scaling, ctx.link, ctx.param_dtypes = scaling, link, (lora_a.dtype, lora_b.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x2, xa, a, b = ctx.saved_tensors
        s, need_a, need_b = ctx.scaling, ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        gb = ctx.link.pop("gb", None)  # s * grad_y B, left by _FrozenBaseAdd's backward when it ran
        grad_a = grad_b = None
        if need_a:
            if gb is None:
                gb = _scaled_mm(grad_y, b, s)
            grad_a = torch.mm(gb.t(), x2).to(ctx.param_dtypes[0])
        if need_b:
            grad_b = _scaled_mm(grad_y.t(), xa, s).to(ctx.param_dtypes[1])
        return None, grad_a, grad_b, None, None, None  # x's LoRA gradient is added by _FrozenBaseAdd


class _FrozenBaseAdd(torch.autograd.Function):
    """Second half: ``lora_out += x W^T`` in place (the GEMM's accumulate), W frozen from ``weight_fn(dtype)``.

    Saves no tensor (W is rebuilt from the module in backward, as bitsandbytes does), so it never extends a
    checkpoint's recompute. Its backward returns the whole input gradient ``g W + (s g B) A`` in one buffer and hands
    ``s g B`` to ``_LoRAProduct`` through ``link`` (its backward always runs after this one).
    """

    @staticmethod
    def forward(ctx, x2: torch.Tensor, lora_out: torch.Tensor, scaling: float,
                weight_fn: Callable[[torch.dtype], torch.Tensor], link: dict) -> torch.Tensor:
        lora_out.addmm_(x2, weight_fn(x2.dtype).t())
        ctx.mark_dirty(lora_out)
        ctx.scaling, ctx.weight_fn, ctx.link = scaling, weight_fn, link
        return lora_out

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        grad_x = None
        if ctx.needs_input_grad[0]:
            lora_a, lora_b = ctx.link["params"]
            a, b = lora_a.to(grad_y.dtype), lora_b.to(grad_y.dtype)
            gb = _scaled_mm(grad_y, b, ctx.scaling)
            grad_x = torch.mm(grad_y, ctx.weight_fn(grad_y.dtype))
            grad_x.addmm_(gb, a)
            if lora_a.requires_grad:
                ctx.link["gb"] = gb
        return grad_x, grad_y, None, None, None


def fused_lora_linear(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, bias: Optional[torch.Tensor],
                      scaling: float, weight_fn: Callable[[torch.dtype], torch.Tensor]) -> torch.Tensor:
    """``x W^T (+ bias) + s (x A^T) B^T`` with W frozen (``weight_fn(dtype)``), computed in the autocast dtype."""
    dtype = _compute_dtype(x)
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    link: dict = {"params": (lora_a, lora_b)}  # parameters, read by the base's backward (never a saved copy)
    with torch.autocast(x.device.type, enabled=False):
        y = _LoRAProduct.apply(x2, lora_a, lora_b, bias, scaling, link)
        y = _FrozenBaseAdd.apply(x2, y, scaling, weight_fn, link)
    return y.view(*x.shape[:-1], y.shape[-1])
