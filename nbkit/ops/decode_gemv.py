"""One row times a weight matrix (``x @ W.T``, W (n, k) as ``nn.Linear`` keeps it), with what surrounds a decoder
layer's projections fused in: the RMSNorm of the input, the SiLU-gated product of a concatenated gate|up input,
the bias, and the residual added to the output.

Why: at batch 1 a projection is a matrix-vector product that only streams its weight, and the library matmul
(cuBLAS) picks tiles, split-K reductions and a launch per op for the general case. Streaming the weight in one
program per block of output rows reads it once, and every program recomputes the (small) input transform from the
one input row itself: the norm or the gate costs no kernel of its own, and the residual add none either.

``gemv_ref`` is the reference, written with transformers' rounding (norm output rounded before its weight, the
gate rounded before the product, ``F.linear`` then the residual add); the kernel computes in float32 and rounds the
input transform as the reference does, and the output once (addmm's rounding). Contract: torch and optional Triton
only; ``x`` is one row (1, k) or, with ``glu``, (1, 2k); ``W`` contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional: the fused kernel
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

HAS_TRITON = triton is not None
BLOCK_K = 256  # input elements a program reads per iteration (512 bytes of a bfloat16 weight row)
MIN_PROGRAMS = 256  # output-row blocks shrink until there are this many programs (about two per SM)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             norm: torch.Tensor | None = None, eps: float = 1e-6, glu: bool = False,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    if glu:
        half = x.shape[-1] // 2
        x = F.silu(x[:, :half]) * x[:, half:]
    if norm is not None:
        x = norm * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if residual is None:
        return F.linear(x, weight, bias)
    out = torch.addmm(residual, x, weight.t())
    return out if bias is None else out + bias


if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, norm_ptr, res_ptr, N, K, eps, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr, BIAS: tl.constexpr,
                     RESIDUAL: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < N
        dtype = w_ptr.dtype.element_ty
        r = 0.0
        if NORM:
            total = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                xv = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
                total += xv * xv
            r = tl.rsqrt(tl.sum(total, 0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            inside = ks < K
            if GLU:
                g = tl.load(x_ptr + ks, mask=inside, other=0.0).to(tl.float32)
                u = tl.load(x_ptr + K + ks, mask=inside, other=0.0).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
                xv = (a * u).to(dtype).to(tl.float32)
            else:
                xv = tl.load(x_ptr + ks, mask=inside, other=0.0).to(tl.float32)
            if NORM:
                nw = tl.load(norm_ptr + ks, mask=inside, other=0.0).to(tl.float32)
                xv = (nw * (xv * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=live[:, None] & inside[None, :], other=0.0)
            acc += w.to(tl.float32) * xv[None, :]
        out = tl.sum(acc, 1)
        if RESIDUAL:
            out += tl.load(res_ptr + rows, mask=live, other=0.0).to(tl.float32)
            if BIAS:
                out = out.to(dtype).to(tl.float32)
        if BIAS:
            out += tl.load(bias_ptr + rows, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, out.to(dtype), mask=live)


def block_n(n: int) -> int:
    """Output rows a program computes: the largest power of two up to 32 that leaves ``MIN_PROGRAMS`` programs."""
    size = 32
    while size > 1 and -(-n // size) < MIN_PROGRAMS:
        size //= 2
    return size


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, norm: torch.Tensor | None = None,
         eps: float = 1e-6, glu: bool = False, residual: torch.Tensor | None = None,
         use_triton: bool = False) -> torch.Tensor:
    """``[residual +] (transform(x) @ weight.T [+ bias])`` for one row ``x``, where the transform is the SiLU-gated
    product of ``x``'s halves (``glu``) and then the RMSNorm with weight ``norm`` (either or none). (1, n) out."""
    if not use_triton:
        return gemv_ref(x, weight, bias, norm, eps, glu, residual)
    n, k = weight.shape
    if glu and norm is not None:
        raise ValueError("gemv fuses the gate or the norm, not both")
    if x.shape[0] != 1 or x.shape[1] != (2 * k if glu else k):
        raise ValueError(f"gemv takes one row of {2 * k if glu else k} values, not {tuple(x.shape)}")
    out = torch.empty((1, n), dtype=weight.dtype, device=weight.device)
    size = block_n(n)
    _gemv_kernel[(triton.cdiv(n, size),)](
        x, weight, out, bias if bias is not None else out, norm if norm is not None else out,
        residual if residual is not None else out, n, k, eps, BLOCK_N=size, BLOCK_K=BLOCK_K, NORM=norm is not None,
        GLU=glu, BIAS=bias is not None, RESIDUAL=residual is not None)
    return out
