"""Attention sinks (gpt-oss) on the varlen flash kernel: one kernel call per layer instead of a per-document loop.

Why: gpt-oss adds a learned per-head "sink" logit to every softmax row. No varlen kernel in torch takes it, so packed
gpt-oss training looped over documents in fp32 (``reference_attention.doc_attention``): ~25 copies and casts per document, and a
host-bound step (profiled on an H200: copies and casts 23% of GPU time, the GPU idle a third of the step).

The sink only rescales each row. With ``o`` and ``L`` the output and log-sum-exp of plain causal attention over the
keys, and ``s`` the head's sink logit, the sink softmax gives ``o' = w o`` with ``w = sigmoid(L - s)``. Its backward
is the flash backward itself, fed ``grad = w do'`` and the *corrected* output ``o'`` in place of ``o``: flash
computes ``D = rowsum(grad * out) = w^2 <do', o>``, which is exactly the row term of the sink softmax's gradient
(``dS = P (dP - w <w do', o>)``), and ``dV = P^T (w do')``. The sink's own gradient is ``-sum_t (1 - w) <do', o'>``.
So the result equals the exact fp32 reference up to the kernel's bf16 rounding; no scores are materialized.

Contract: ``sink_attention(q, k, v, sinks, cu_seqlens, max_len, scale, window)`` with q (T, Hq, D), k/v (T, Hkv, D)
(grouped-query heads as they are), ``sinks`` (Hq,), causal attention within each document of ``cu_seqlens``,
``window`` transformers' sliding window (a query sees the last ``window`` keys, itself included) or None. The kernel
behind it is a ``FlashCore``: ``aten_flash_core`` on CUDA (torch's own flash-attention ops, the ones
``torch.nn.attention.varlen.varlen_attn`` calls); tests pass a reference core with the same contract on the CPU.
``sink_kernel_works(device)`` runs a small probe against the exact loop once per device; callers use the loop when
it fails (an older torch without window arguments, an unexpected log-sum-exp layout).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Protocol

import torch

from .reference_attention import AttnCall, doc_attention

logger = logging.getLogger(__name__)


class FlashCore(Protocol):
    """Causal varlen attention without sinks: the forward returns (out (T,Hq,D), lse (T,Hq) fp32, state), the state a
    tuple of tensors the backward needs (saved with the inputs, so checkpointing recomputes it); the backward takes the
    gradient, the inputs, the output to use for the row term, and that state."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                scale: float, window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def backward(self, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 state: Any, cu: torch.Tensor, max_len: int, scale: float,
                 window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _window_args(window: Optional[int]) -> tuple[bool, int, int]:
    """(is_causal, left, right) as torch's varlen_attn passes them to the flash ops."""
    if window is None:
        return True, -1, 0
    return False, window - 1, 0


class _AtenFlashCore:
    """torch's flash-attention ops (CUDA, fp16/bf16), called the way ``varlen_attn`` calls them."""

    def forward(self, q, k, v, cu, max_len, scale, window):
        causal, left, right = _window_args(window)
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, causal, False, scale=scale,
            window_size_left=left, window_size_right=right)
        t, h = q.shape[0], q.shape[1]
        if tuple(lse.shape) == (h, t):
            lse_th = lse.t()
        elif tuple(lse.shape) == (t, h):
            lse_th = lse
        else:
            raise RuntimeError(f"unexpected flash log-sum-exp shape {tuple(lse.shape)} for {t} tokens, {h} heads")
        return out, lse_th, (lse, rng, unused)

    def backward(self, grad, q, k, v, out, state, cu, max_len, scale, window):
        lse, rng, unused = state
        causal, left, right = _window_args(window)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, causal, rng, unused, scale=scale,
            window_size_left=left, window_size_right=right)
        return dq, dk, dv


aten_flash_core = _AtenFlashCore()


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, cu: torch.Tensor,
                max_len: int, scale: float, window: Optional[int], core: FlashCore) -> torch.Tensor:
        out, lse, state = core.forward(q, k, v, cu, max_len, scale, window)
        w = torch.sigmoid(lse.float() - sinks.float()[None, :])  # (T, H): the share of each row off the sink
        out = (out.float() * w[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, w, cu, *state)
        ctx.args, ctx.core, ctx.sink_dtype = (max_len, scale, window), core, sinks.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, w, cu, *state = ctx.saved_tensors
        g = grad_out.float()
        grad_sinks = None
        if ctx.needs_input_grad[3]:
            grad_sinks = -((g * out.float()).sum(-1) * (1.0 - w)).sum(0).to(ctx.sink_dtype)
        g = (g * w[..., None]).to(q.dtype)
        dq, dk, dv = ctx.core.backward(g, q, k, v, out, tuple(state), cu, *ctx.args)
        return dq, dk, dv, grad_sinks, None, None, None, None, None


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, cu_seqlens: torch.Tensor,
                   max_len: int, scale: float, window: Optional[int] = None,
                   core: Optional[FlashCore] = None) -> torch.Tensor:
    """Causal attention with a per-head sink logit over the documents of ``cu_seqlens`` (see the module doc)."""
    return _SinkAttention.apply(q, k, v, sinks, cu_seqlens, int(max_len), float(scale), window,
                                core if core is not None else aten_flash_core)


@functools.cache
def _probe(device_index: int) -> Optional[str]:
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths, hq, hkv, d = (40, 24), 4, 2, 64
    t = sum(lengths)
    cu = torch.tensor([0, lengths[0], t], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(device, torch.bfloat16).requires_grad_()
               for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen).to(device).requires_grad_()
    try:
        with torch.enable_grad(), torch.autocast("cuda", enabled=False):  # attach may run under no_grad/autocast
            return _compare(q, k, v, sinks, cu, lengths, hq, hkv, d)
    except Exception as error:  # an older torch (no window arguments), a layout we do not know
        return f"{type(error).__name__}: {error}"[:200]


def _compare(q, k, v, sinks, cu, lengths, hq, hkv, d) -> Optional[str]:

    bounds = list(zip((0, lengths[0]), (lengths[0], sum(lengths))))
    for window in (None, 16):
        out = sink_attention(q, k, v, sinks, cu, max(lengths), d ** -0.5, window)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v, sinks))
        call = AttnCall(scaling=d ** -0.5, window=window, softcap=None, sinks=sinks, dropout=0.0)
        ref = []
        for a, b in bounds:
            qh, kh, vh = (x[a:b].float().transpose(0, 1) for x in (q, k, v))
            kh, vh = kh.repeat_interleave(hq // hkv, 0), vh.repeat_interleave(hq // hkv, 0)
            ref.append(doc_attention(qh, kh, vh, call, training=False).transpose(0, 1))
        ref_out = torch.cat(ref)
        ref_grads = torch.autograd.grad(ref_out.square().sum(), (q, k, v, sinks))
        for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref_out, *ref_grads)):
            err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
            if not err <= 5e-2:
                return f"probe mismatch in {name} (window={window}): {err:.2e} relative"
    return None


def sink_kernel_works(device: torch.device) -> tuple[bool, Optional[str]]:
    """Whether ``sink_attention`` on torch's flash ops matches the exact loop on this CUDA device (cached probe)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "not a CUDA device"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False, "the flash kernel needs sm80+"
    reason = _probe(device.index if device.index is not None else torch.cuda.current_device())
    if reason:
        logger.warning("nbkit: attention sinks on the varlen kernel failed its probe (%s); using the exact loop", reason)
    return reason is None, reason
