"""RMSNorm whose weight is frozen: the forward and an input-gradient-only backward, each one Triton kernel over
independent blocks of rows.

Why: in LoRA and QLoRA fine-tuning the norms' weights do not train, so their backward needs the input gradient
only. Liger's RMSNorm backward also sums the weight gradient, so it runs one program per SM, each looping over its
share of the rows in turn (and skips the sum when the weight is frozen, but keeps the loop): a fixed ~55-60 us a
call on an H200 whatever the rows (BENCHMARKS.md, run 15: 113 calls in a 2K-token Qwen3 step, per-head q/k norms
included). Without a weight gradient every block of rows is independent, so the grid is as wide as the rows, and
the kernel is bound by reading ``x`` and ``dy`` and writing ``dx``.

Math, transformers' two castings (Liger's "llama" and "gemma" modes), with ``r = rsqrt(mean(x^2) + eps)`` in fp32:
- llama: ``y = (w + offset) * round(x * r)``, the normalized row rounded to ``x``'s dtype before the weight;
- gemma: ``y = round(x * r * (w + offset))``, all in fp32, rounded once;
- backward (both): ``dx = r * (g - x * r^2 * mean(g * x))`` with ``g = dy * (w + offset)`` in fp32 (the rounding
  in llama's forward passes gradients straight through, as in Liger's kernel).
``y`` and ``dx`` have ``x``'s dtype; the weight may be bf16 or fp32.

Contract: ``rms_norm(x, weight, eps, offset, casting)`` over the last dimension of ``x``; no gradient reaches
``weight`` (a caller with a trainable weight uses another op: ``nbkit.speedups.fused_kernels`` dispatches by
``weight.requires_grad`` at each call). ``rms_norm_ref`` is the torch twin: what runs without Triton or off CUDA,
and what the kernels are checked against (tests/ops/test_rms_norm.py; bf16 on the GPU: tests/gpu/test_fused_gpu.py).
No host sync and no allocation outside torch's allocator: safe inside a CUDA-graph capture.
"""

from __future__ import annotations

import torch

try:  # optional: the kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

HAS_TRITON = triton is not None
CASTINGS = ("llama", "gemma")
_TILE = 4096  # elements a program holds per tensor: rows per program = _TILE // the row's power-of-two width
_MAX_ROWS = 64


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                 casting: str = "llama") -> torch.Tensor:
    """The torch twin (differentiable in ``x``): transformers' RMSNorm in the given casting, output in ``x``'s dtype."""
    if casting not in CASTINGS:
        raise ValueError(f"rms_norm: casting must be one of {CASTINGS}, not {casting!r}")
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.detach().float() + offset
    if casting == "llama":
        return (w * normed.to(x.dtype).float()).to(x.dtype)
    return (normed * w).to(x.dtype)


def _layout(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows of ``n`` elements."""
    block_n = triton.next_power_of_2(n)
    rows = max(1, min(_MAX_ROWS, _TILE // block_n))
    warps = max(4, min(16, rows * block_n // 1024))
    return block_n, rows, warps


if HAS_TRITON:

    @triton.jit
    def _forward_kernel(x_ptr, w_ptr, y_ptr, r_ptr, n_rows, n, eps, offset,
                        GEMMA: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        row_in = rows < n_rows
        keep = row_in[:, None] & (cols < n)[None, :]
        at = rows[:, None] * n + cols[None, :]
        x = tl.load(x_ptr + at, mask=keep, other=0.0)
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=1) / n + eps)
        w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32) + offset
        normed = xf * r[:, None]
        if GEMMA:
            y = normed * w[None, :]
        else:
            y = normed.to(x.dtype).to(tl.float32) * w[None, :]
        tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=keep)
        tl.store(r_ptr + rows, r, mask=row_in)

    @triton.jit
    def _backward_kernel(dy_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, n_rows, n, offset,
                         BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        row_in = rows < n_rows
        keep = row_in[:, None] & (cols < n)[None, :]
        at = rows[:, None] * n + cols[None, :]
        x = tl.load(x_ptr + at, mask=keep, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + at, mask=keep, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32) + offset
        r = tl.load(r_ptr + rows, mask=row_in, other=0.0)
        g = dy * w[None, :]
        mean_gx = tl.sum(g * x, axis=1) / n
        dx = r[:, None] * (g - x * (r * r * mean_gx)[:, None])
        tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=keep)


class _FrozenWeightRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma: bool) -> torch.Tensor:
        shape, n = x.shape, x.shape[-1]
        x2 = x.contiguous().view(-1, n)
        rows = x2.shape[0]
        y = torch.empty_like(x2)
        r = torch.empty(rows, dtype=torch.float32, device=x.device)
        block_n, per_program, warps = _layout(n)
        if rows:
            _forward_kernel[(triton.cdiv(rows, per_program),)](
                x2, weight, y, r, rows, n, eps, offset, GEMMA=gemma, BLOCK_N=block_n, ROWS=per_program,
                num_warps=warps)
        ctx.save_for_backward(x2, weight, r)
        ctx.offset, ctx.shape = offset, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, r = ctx.saved_tensors
        rows, n = x2.shape
        dy2 = dy.contiguous().view(-1, n)
        dx = torch.empty_like(x2)
        block_n, per_program, warps = _layout(n)
        if rows:
            _backward_kernel[(triton.cdiv(rows, per_program),)](
                dy2, x2, weight, r, dx, rows, n, ctx.offset, BLOCK_N=block_n, ROWS=per_program, num_warps=warps)
        return dx.view(ctx.shape), None, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             casting: str = "llama") -> torch.Tensor:
    """RMSNorm of ``x``'s last dimension by a frozen ``weight`` (no gradient reaches it): the Triton kernels on a
    GPU, ``rms_norm_ref`` without Triton or on a CPU (unless ``TRITON_INTERPRET=1`` runs the kernels there)."""
    if casting not in CASTINGS:
        raise ValueError(f"rms_norm: casting must be one of {CASTINGS}, not {casting!r}")
    if not HAS_TRITON or (x.device.type == "cpu" and not _interpreted()):
        return rms_norm_ref(x, weight, eps, offset, casting)
    return _FrozenWeightRMSNorm.apply(x, weight.detach(), float(eps), float(offset), casting == "gemma")


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
