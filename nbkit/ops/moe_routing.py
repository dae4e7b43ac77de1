"""Routing for mixture-of-experts layers: rows sorted by expert, the expert matmuls, and the way back.

Why: an experts layer sends each token to ``top_k`` experts. Looping over experts in token order costs a host sync
per expert and autograd's zero-filled weight gradients; gathering weights per assignment costs memory. Here the
flattened (token, k) assignments are sorted by expert once, each expert's rows are one contiguous slice, and:

* ``route``: one stable sort; per-expert end offsets by ``searchsorted`` on the sorted ids (no host sync). Only the
  slice backend (``host_counts=True``) copies the per-expert counts to the host, once.
* ``experts_linear``: row slice ``e`` times ``w[e]`` (or ``w[e].T``), as one ``grouped_mm`` ("grouped" backend:
  CUDA, bf16, dims multiple of 8; zero host syncs) or one matmul per non-empty slice ("loop" backend: any device
  and dtype). Gradients only for inputs that need them; experts with no rows get an exactly zero weight gradient.
* ``add_lora``: LoRA on the expert weights as low-rank products on each expert's slice,
  ``y += (x A_e^T * scaling) B_e^T``; ``W + BA`` is never formed.
* ``dispatch`` / ``combine``: token order to expert order and back. The combine (weighted sum of each token's k
  rows, plus a per-expert output bias) and the dispatch's backward accumulate in fp32 without atomics; with
  ``use_triton`` they run as one Triton kernel each way (the torch code is the reference).

Contract: torch only (Triton optional), no transformers or PEFT. Expert ids must lie in ``[0, num_experts)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

try:  # optional: the combine kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

HAS_TRITON = triton is not None
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
ALIGN = 8  # grouped_mm (bf16): every row stride a multiple of 16 bytes
_BLOCK = 1024


class Route(NamedTuple):
    """The (token, k) assignments sorted by expert. S = tokens * top_k rows."""

    num_tokens: int
    top_k: int
    num_experts: int
    flat_e: torch.Tensor  # (S,) expert of each assignment, original order
    sorted_e: torch.Tensor  # (S,) expert of each sorted row
    perm: torch.Tensor  # (S,) sorted row -> assignment
    inv_perm: torch.Tensor  # (S,) assignment -> sorted row
    token_idx: torch.Tensor  # (S,) sorted row -> token
    offs: torch.Tensor  # (E,) int32 end offset of each expert's slice
    counts: Optional[list[int]]  # host copy of rows per expert: the "loop" backend; None: "grouped"


def route(top_k_index: torch.Tensor, num_experts: int, host_counts: bool) -> Route:
    """Sort the assignments of ``top_k_index`` (tokens, top_k) by expert. ``host_counts``: the loop backend."""
    num_tokens, top_k = top_k_index.shape
    flat_e = top_k_index.reshape(-1)
    sorted_e, perm = torch.sort(flat_e, stable=True)
    bounds = torch.arange(1, num_experts + 1, device=flat_e.device, dtype=sorted_e.dtype)
    offs = torch.searchsorted(sorted_e, bounds, out_int32=True)  # no host sync, deterministic
    rows = torch.arange(perm.numel(), device=perm.device)
    inv_perm = torch.empty_like(perm).scatter_(0, perm, rows)
    token_idx = torch.div(perm, top_k, rounding_mode="floor")
    counts = None
    if host_counts:  # the single device-to-host transfer of the slice backend
        ends = offs.tolist()
        counts = [end - start for start, end in zip([0] + ends[:-1], ends)]
    return Route(num_tokens, top_k, num_experts, flat_e, sorted_e, perm, inv_perm, token_idx, offs, counts)


def grouped_mm_fits(device: torch.device, dtype: torch.dtype, dims: Sequence[int]) -> bool:
    """Whether the grouped backend applies: CUDA sm_80+, bf16, torch's grouped_mm, every dim a multiple of 8."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and GROUPED_MM is not None
            and torch.cuda.get_device_capability(device) >= (8, 0) and all(d % ALIGN == 0 for d in dims))


# ----------------------------------------------------------------------------------------------------------------
# Expert matmuls: rows of x sorted by expert, times each expert's weight
# ----------------------------------------------------------------------------------------------------------------
def _gmm(x: torch.Tensor, w: torch.Tensor, r: Route, trans: bool) -> torch.Tensor:
    """Row block e of ``x`` times ``w[e]`` (``trans``: ``w[e].T``)."""
    if r.counts is None:
        return GROUPED_MM(x, w.transpose(-2, -1) if trans else w, offs=r.offs)
    out = x.new_empty(x.shape[0], w.shape[-2] if trans else w.shape[-1])
    start = 0
    for e, n in enumerate(r.counts):
        if n:
            torch.mm(x[start : start + n], w[e].t() if trans else w[e], out=out[start : start + n])
        start += n
    return out


def _gmm_wgrad(x: torch.Tensor, g: torch.Tensor, r: Route, trans: bool) -> torch.Tensor:
    """Weight gradient of ``_gmm``: ``x_e^T g_e`` (``trans``: ``g_e^T x_e``), zero for experts with no rows."""
    if r.counts is None:
        return GROUPED_MM(g.t(), x, offs=r.offs) if trans else GROUPED_MM(x.t(), g, offs=r.offs)
    a, b = (g, x) if trans else (x, g)
    out = x.new_empty(r.num_experts, a.shape[1], b.shape[1])
    start = 0
    for e, n in enumerate(r.counts):
        if n:
            torch.mm(a[start : start + n].t(), b[start : start + n], out=out[e])
        else:
            out[e].zero_()
        start += n
    return out


class _ExpertsLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, r, trans):
        ctx.route, ctx.trans = r, trans
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(x if need_w else None, w if need_x else None)
        return _gmm(x, w, r, trans)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = _gmm(g, w, ctx.route, not ctx.trans) if ctx.needs_input_grad[0] else None
        dw = _gmm_wgrad(x, g, ctx.route, ctx.trans) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def experts_linear(x: torch.Tensor, w: torch.Tensor, r: Route, trans: bool) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e]`` (``trans``: ``@ w[e].T``) for ``x`` sorted by ``r``, ``w`` (E, ., .).

    Saves only what the needed gradients read (no ``x`` when ``w`` is frozen). The output is a fresh tensor that
    autograd does not keep, so callers may add to it in place (``add_lora``).
    """
    return _ExpertsLinear.apply(x, w, r, trans)


def add_lora(y: torch.Tensor, x: torch.Tensor, factors: Sequence[tuple[torch.Tensor, torch.Tensor, float]],
             r: Route) -> torch.Tensor:
    """``y += (x A_e^T * scaling) B_e^T`` on each expert's rows, for each ``(A (E, rank, in), B (E, out, rank),
    scaling)``; ``y`` must be a fresh output nothing saved (``experts_linear``'s). On the grouped backend the rank
    is zero-padded to a multiple of 8 (same numbers)."""
    for A, B, scaling in factors:
        rank = A.shape[1]
        if r.counts is None and rank % ALIGN:
            extra = ALIGN - rank % ALIGN
            A, B = F.pad(A, (0, 0, 0, extra)), F.pad(B, (0, extra))
        u = _ExpertsLinear.apply(x, A, r, True) * scaling
        y = y.add_(_ExpertsLinear.apply(u, B.contiguous(), r, True))
    return y


# ----------------------------------------------------------------------------------------------------------------
# Dispatch and combine. Triton kernels: TRITON_INTERPRET=1 (set before triton is imported) runs them on CPU.
# ----------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def unsort_sum_kernel(y_ptr, inv_ptr, w_ptr, bias_ptr, eid_ptr, out_ptr, n_cols,
                          K: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # out[t] = sum_k w[t, k] * (y[sorted row of (t, k)] + bias[expert of (t, k)]), in fp32
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for kk in tl.static_range(K):
            a = t * K + kk
            row = tl.load(inv_ptr + a).to(tl.int64)
            v = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                e = tl.load(eid_ptr + a).to(tl.int64)
                v += tl.load(bias_ptr + e * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + a).to(tl.float32)
            acc += v
        tl.store(out_ptr + t * n_cols + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def combine_bwd_kernel(g_ptr, y_ptr, tok_ptr, ws_ptr, bias_ptr, eid_ptr, gy_ptr, gw_ptr, n_cols: tl.constexpr,
                           HAS_BIAS: tl.constexpr, NEED_GW: tl.constexpr, BLOCK: tl.constexpr):
        # n_cols is constexpr (one build per hidden size): a static column loop, also under the interpreter
        # per sorted row j: gy[j] = w_j * g[token_j]; gw[j] = <g[token_j], y[j] + bias[e_j]>
        j = tl.program_id(0).to(tl.int64)
        t = tl.load(tok_ptr + j).to(tl.int64)
        w = tl.load(ws_ptr + j).to(tl.float32)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in tl.static_range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_cols
            g = tl.load(g_ptr + t * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(gy_ptr + j * n_cols + cols, (g * w).to(gy_ptr.dtype.element_ty), mask=mask)
            if NEED_GW:
                y = tl.load(y_ptr + j * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    e = tl.load(eid_ptr + j).to(tl.int64)
                    y += tl.load(bias_ptr + e * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                dot += g * y
        if NEED_GW:
            tl.store(gw_ptr + j, tl.sum(dot, axis=0))


def _unsort_sum(y: torch.Tensor, r: Route, w: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                use_triton: bool) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * (y[row of (t,k)] + bias[e])``: fp32 accumulation, output in ``y.dtype``."""
    T, K, n = r.num_tokens, r.top_k, y.shape[1]
    if use_triton:
        out = y.new_empty(T, n)
        y = y.contiguous()
        dummy = r.inv_perm
        unsort_sum_kernel[(T, triton.cdiv(n, _BLOCK))](
            y, r.inv_perm, w.contiguous() if w is not None else dummy, bias if bias is not None else dummy,
            r.flat_e, out, n, K=K, HAS_W=w is not None, HAS_BIAS=bias is not None, BLOCK=_BLOCK)
        return out
    y_tok = y.index_select(0, r.inv_perm).view(T, K, n)
    if w is None:
        out = y_tok.sum(1)  # fp32 accumulation inside the reduction
    else:
        out = torch.bmm(w.view(T, 1, K).to(y.dtype), y_tok).view(T, n)  # fp32 accumulation inside the GEMM
    if bias is not None:
        out = out.addmm_(_routing_matrix(r, w, y.dtype), bias)
    return out


def _routing_matrix(r: Route, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense (T, E) routing weights: the combine's bias term is ``R @ bias``, its gradient ``R^T @ g``."""
    T, K = r.num_tokens, r.top_k
    experts = torch.arange(r.num_experts, device=w.device)
    one_hot = (r.flat_e.view(T, K, 1) == experts).to(dtype)  # no host sync (F.one_hot checks bounds on host)
    return torch.bmm(w.view(T, 1, K).to(dtype), one_hot).view(T, r.num_experts)  # deterministic


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r, use_triton):
        ctx.route, ctx.use_triton = r, use_triton
        return x.index_select(0, r.token_idx)

    @staticmethod
    def backward(ctx, g):
        return _unsort_sum(g.contiguous(), ctx.route, None, None, ctx.use_triton), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w_flat, bias, r, use_triton):
        ctx.route, ctx.use_triton = r, use_triton
        ctx.save_for_backward(y, w_flat, bias)
        return _unsort_sum(y, r, w_flat, bias, use_triton)

    @staticmethod
    def backward(ctx, g):
        y, w_flat, bias = ctx.saved_tensors
        r = ctx.route
        g = g.contiguous()
        need_w = ctx.needs_input_grad[1]
        w_sorted = w_flat.index_select(0, r.perm)
        if ctx.use_triton:
            gy = torch.empty_like(y)
            gw_sorted = torch.empty(y.shape[0], device=y.device, dtype=torch.float32) if need_w else gy
            combine_bwd_kernel[(y.shape[0],)](
                g, y, r.token_idx, w_sorted, bias if bias is not None else g, r.sorted_e, gy, gw_sorted,
                y.shape[1], HAS_BIAS=bias is not None, NEED_GW=need_w, BLOCK=_BLOCK)
        else:
            g_rows = g.index_select(0, r.token_idx)
            if need_w:
                yb = y if bias is None else y + bias.index_select(0, r.sorted_e)
                gw_sorted = torch.bmm(g_rows.unsqueeze(1), yb.unsqueeze(2)).view(-1)
            gy = g_rows.mul_(w_sorted.to(g_rows.dtype).unsqueeze(1))
        gw = gw_sorted.index_select(0, r.inv_perm).to(w_flat.dtype) if need_w else None
        gb = None
        if bias is not None and ctx.needs_input_grad[2]:
            gb = _routing_matrix(r, w_flat, g.dtype).t().mm(g).to(bias.dtype)
        return gy, gw, gb, None, None


def dispatch(x: torch.Tensor, r: Route, use_triton: bool = False) -> torch.Tensor:
    """Rows of ``x`` (tokens, n) in expert order, (S, n); the backward sums each token's k rows in fp32."""
    return _Dispatch.apply(x, r, use_triton)


def combine(y: torch.Tensor, weights: torch.Tensor, bias: Optional[torch.Tensor], r: Route,
            use_triton: bool = False) -> torch.Tensor:
    """``out[t] = sum_k weights[t*K + k] * (y[row of (t, k)] + bias[e])`` back in token order, (tokens, n).

    ``y``: (S, n) sorted rows; ``weights``: (S,) routing weights in assignment order; ``bias``: (E, n) or None.
    Accumulated in fp32, output in ``y.dtype``; the backward is one pass per sorted row (no atomics).
    """
    return _Combine.apply(y, weights, bias, r, use_triton)
