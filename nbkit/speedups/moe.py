"""Fast MoE routing: an experts forward for transformers' ``ExpertsInterface``, with LoRA on the experts.

Why: transformers' experts run either as a Python loop over experts (``eager``: one host sync per expert) or as
``grouped_mm`` with many full passes over the routed activations (gathers, bias gathers, sentinel masks, an
unfused gate). PEFT's ``target_parameters`` LoRA on the 3-D expert tensors adds, every step, ``W + BA`` for all
experts (twice: PEFT's parametrization is evaluated once more at registration) and a full weight gradient of that
sum. This module computes the same numbers with:

* one stable sort of the flattened (token, k) assignments by expert; per-expert end offsets by ``searchsorted``
  on the sorted ids (no host sync); only the contiguous-slice backend copies the offsets to the host, once;
* each expert on one contiguous slice (``loop`` backend: CPU, fp32/fp16, odd shapes), or all experts in one
  ``grouped_mm`` per projection (``grouped`` backend: CUDA, bf16, dims multiple of 8) with zero host syncs;
  experts with no tokens cost nothing;
* the gate (SwiGLU, or gpt-oss's interleaved clamped SwiGLU with ``alpha``/``limit``) and its bias fused in one
  pass (Triton on CUDA; a hand-written fp32 backward in torch elsewhere); any other ``_apply_gate``/``act_fn``
  runs as the model defines it;
* the weighted combine (and gpt-oss's down bias) as one gather-and-sum per token, accumulated in fp32; its
  backward is one pass per sorted row; base weight gradients are skipped when the weights are frozen;
* LoRA on expert weights as low-rank products on each expert's sorted slice, ``(x_e A_e^T) B_e^T * scaling``;
  ``W + BA`` is never formed. With the Triton kernels and a fused gate (``lora="auto"``), the low-rank products
  ride on passes the path makes anyway: ``x A^T`` inside the dispatch gather, ``u B^T`` inside the gate and
  ``h A^T`` from its output tile, the down projection's ``u B^T`` added in place; backward the mirror image (see
  ``_LoraUpAct``). Otherwise (``lora="unfused"``, CPU, other gates) each product is a separate grouped/loop matmul
  (rank padded to a multiple of 8 for ``grouped_mm``).

Contract (see ``nbkit.speedups.ledger``): ``FastMoERouting().attach(model)`` registers ``nbkit_experts_forward`` under
the name ``"nbkit"`` (idempotent), selects it through ``model.set_experts_implementation`` (or the experts'
config attribute for a bare module), plans a backend per experts module (kept on the module as
``_nbkit_moe_plan``), and, for PEFT ``ParamWrapper`` chains around experts, replaces the outermost wrapper's
``forward`` on that instance so that PEFT's parametrization is not registered and the LoRA factors reach the
experts forward as low-rank products. ``detach()`` undoes all of it. Unsupported models (no experts behind the
interface, tensor/expert parallel sharding, non-float expert weights) keep transformers' path with one log line.

Not supported (the model stays on transformers' path): expert-parallel sentinels (ids >= num_experts), quantized
expert tensors. PEFT states the bypass leaves to PEFT: merged or disabled adapters, ``adapter_names`` batches,
fp8 base weights; a wrapper whose ``forward`` is already replaced on the instance (e.g. by accelerate hooks).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nbkit.speedups.ledger import unwrap_model

try:  # optional: the fused CUDA kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

logger = logging.getLogger(__name__)

IMPL_NAME = "nbkit"
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN = 8  # grouped_mm (bf16): every row stride a multiple of 16 bytes


# --------------------------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------------------------
class _Route(NamedTuple):
    """The (token, k) assignments sorted by expert. S = tokens * top_k."""

    num_tokens: int
    top_k: int
    num_experts: int
    flat_e: torch.Tensor  # (S,) expert of each assignment, original order
    sorted_e: torch.Tensor  # (S,) expert of each sorted row
    perm: torch.Tensor  # (S,) sorted row -> assignment
    inv_perm: torch.Tensor  # (S,) assignment -> sorted row
    token_idx: torch.Tensor  # (S,) sorted row -> token
    offs: torch.Tensor  # (E,) int32 end offset of each expert's slice
    counts: Optional[list[int]]  # host copy of rows per expert (loop backend only)


def _route(top_k_index: torch.Tensor, num_experts: int, host_counts: bool) -> _Route:
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
    return _Route(num_tokens, top_k, num_experts, flat_e, sorted_e, perm, inv_perm, token_idx, offs, counts)


# --------------------------------------------------------------------------------------------------------------
# Expert matmuls: rows of x sorted by expert, times each expert's weight
# --------------------------------------------------------------------------------------------------------------
def _gmm(x: torch.Tensor, w: torch.Tensor, route: _Route, trans: bool) -> torch.Tensor:
    """Row block e of ``x`` times ``w[e]`` (``trans``: ``w[e].T``)."""
    if route.counts is None:
        return _GROUPED_MM(x, w.transpose(-2, -1) if trans else w, offs=route.offs)
    out = x.new_empty(x.shape[0], w.shape[-2] if trans else w.shape[-1])
    start = 0
    for e, n in enumerate(route.counts):
        if n:
            torch.mm(x[start : start + n], w[e].t() if trans else w[e], out=out[start : start + n])
        start += n
    return out


def _gmm_wgrad(x: torch.Tensor, g: torch.Tensor, route: _Route, trans: bool) -> torch.Tensor:
    """Weight gradient of ``_gmm``: ``x_e^T g_e`` (``trans``: ``g_e^T x_e``), zero for experts with no rows."""
    if route.counts is None:
        return _GROUPED_MM(g.t(), x, offs=route.offs) if trans else _GROUPED_MM(x.t(), g, offs=route.offs)
    a, b = (g, x) if trans else (x, g)
    out = x.new_empty(route.num_experts, a.shape[1], b.shape[1])
    start = 0
    for e, n in enumerate(route.counts):
        if n:
            torch.mm(a[start : start + n].t(), b[start : start + n], out=out[e])
        else:
            out[e].zero_()
        start += n
    return out


class _ExpertsLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e]`` (or ``w[e].T``); gradients only for inputs that need them."""

    @staticmethod
    def forward(ctx, x, w, route, trans):
        ctx.route, ctx.trans = route, trans
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(x if need_w else None, w if need_x else None)
        return _gmm(x, w, route, trans)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = _gmm(g, w, ctx.route, not ctx.trans) if ctx.needs_input_grad[0] else None
        dw = _gmm_wgrad(x, g, ctx.route, ctx.trans) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


# --------------------------------------------------------------------------------------------------------------
# Triton kernels (CUDA). Built on first use; TRITON_INTERPRET=1 (set before triton is imported) runs them on CPU.
# --------------------------------------------------------------------------------------------------------------
@functools.cache
def _kernels() -> Any:
    """The fused kernels, or None when triton is missing."""
    if triton is None:
        return None

    @triton.jit
    def act_fwd(gu_ptr, bias_ptr, eid_ptr, h_ptr, n_cols, alpha, limit,
                GPTOSS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        if GPTOSS:  # interleaved [g0, u0, g1, u1, ...]
            gcol = 2 * cols
            ucol = 2 * cols + 1
        else:  # concatenated [gate | up]
            gcol = cols
            ucol = cols + n_cols
        src = gu_ptr + row * (2 * n_cols)
        gate = tl.load(src + gcol, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + ucol, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = bias_ptr + tl.load(eid_ptr + row).to(tl.int64) * (2 * n_cols)
            gate += tl.load(b + gcol, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(b + ucol, mask=mask, other=0.0).to(tl.float32)
        if GPTOSS:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            h = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
        else:
            h = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + row * n_cols + cols, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def act_bwd(gu_ptr, bias_ptr, eid_ptr, gh_ptr, dgu_ptr, n_cols, alpha, limit,
                GPTOSS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        if GPTOSS:
            gcol = 2 * cols
            ucol = 2 * cols + 1
        else:
            gcol = cols
            ucol = cols + n_cols
        src = gu_ptr + row * (2 * n_cols)
        gate = tl.load(src + gcol, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + ucol, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = bias_ptr + tl.load(eid_ptr + row).to(tl.int64) * (2 * n_cols)
            gate += tl.load(b + gcol, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(b + ucol, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gh_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if GPTOSS:
            gate_c = tl.minimum(gate, limit)
            up_c = tl.minimum(tl.maximum(up, -limit), limit)
            s = tl.sigmoid(gate_c * alpha)
            d_up = tl.where((up >= -limit) & (up <= limit), g * gate_c * s, 0.0)
            d_gate = g * (up_c + 1.0) * (s + alpha * gate_c * s * (1.0 - s))
            d_gate = tl.where(gate <= limit, d_gate, 0.0)
        else:
            s = tl.sigmoid(gate)
            d_up = g * gate * s
            d_gate = g * up * s * (1.0 + gate * (1.0 - s))
        dst = dgu_ptr + row * (2 * n_cols)
        tl.store(dst + gcol, d_gate.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + ucol, d_up.to(dgu_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def unsort_sum(y_ptr, inv_ptr, w_ptr, bias_ptr, eid_ptr, out_ptr, n_cols,
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
    def combine_bwd(g_ptr, y_ptr, tok_ptr, ws_ptr, bias_ptr, eid_ptr, gy_ptr, gw_ptr, n_cols: tl.constexpr,
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

    class _K:
        pass

    k = _K()
    k.act_fwd, k.act_bwd, k.unsort_sum, k.combine_bwd, k.cdiv = act_fwd, act_bwd, unsort_sum, combine_bwd, triton.cdiv
    return k


# The kernels of the fused LoRA-on-experts path (``_LoraUpAct``, ``_LoraDown``), at module level so that they
# can call one another (Triton resolves helper kernels among the globals).
if triton is not None:

    @triton.jit
    def _lk_mma(a, b, acc, IEEE: tl.constexpr):
        if IEEE:  # fp32 models: no tf32 rounding
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _lk_row_tile(e_ptr, S, BM: tl.constexpr):
        # this program's rows; rows are sorted by expert, so the tile's experts are e_lo..e_hi. Kernels loop over
        # them with ``while`` (dynamic bounds: Triton's interpreter cannot run a ``range`` over tensor bounds), and
        # over columns with ``range(PER)``, PER constexpr (a real loop on the GPU, runnable by the interpreter).
        m0 = tl.program_id(0) * BM
        rows = m0 + tl.arange(0, BM)
        rmask = rows < S
        eid = tl.load(e_ptr + rows, mask=rmask, other=-1)
        e_lo = tl.load(e_ptr + m0)
        e_hi = tl.load(e_ptr + tl.minimum(m0 + BM, S) - 1)
        return rows.to(tl.int64), rmask, eid, e_lo, e_hi

    @triton.jit
    def _lk_shrink(x_ptr, idx_ptr, xs_ptr, w_ptr, e_ptr, part_ptr, S, N, R, stride_x, sw_e, sw_r, sw_n, scale,
                   GATHER: tl.constexpr, STORE_X: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BR: tl.constexpr, PER: tl.constexpr):
        # part[split, j, :R] = scale * sum_{n in split} x[src_j, n] * w[e_j, :, n]; src_j = idx[j] when GATHER
        # (then xs[j] = x[src_j] is written too when STORE_X: the dispatch, fused)
        rows, rmask, eid, e_lo, e_hi = _lk_row_tile(e_ptr, S, BM)
        split = tl.program_id(1)
        src = rows
        if GATHER:
            src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        rr = tl.arange(0, BR)
        rmask_r = rr < R
        acc = tl.zeros([BM, BR], dtype=tl.float32)
        for c in range(PER):
            cols = (split * PER + c) * BN + tl.arange(0, BN)
            cmask = cols < N
            m2 = rmask[:, None] & cmask[None, :]
            xt = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=m2, other=0.0)
            if STORE_X:
                tl.store(xs_ptr + rows[:, None] * N + cols[None, :], xt, mask=m2)
            e = e_lo
            while e <= e_hi:  # each expert of the tile
                wt = tl.load(w_ptr + e * sw_e + rr[None, :] * sw_r + cols[:, None] * sw_n,
                             mask=cmask[:, None] & rmask_r[None, :], other=0.0)
                acc = _lk_mma(tl.where((eid == e)[:, None], xt, tl.zeros_like(xt)), wt, acc, IEEE)
                e += 1
        dst = part_ptr + split.to(tl.int64) * S * R + rows[:, None] * R + rr[None, :]
        tl.store(dst, acc * scale, mask=rmask[:, None] & rmask_r[None, :])

    @triton.jit
    def _lk_expand(y_ptr, u_ptr, w_ptr, e_ptr, S, N, R, stride_y, stride_u, sw_e, sw_n, sw_r, scale,
                   IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
        # in place: y[j, n] += scale * sum_k u[j, k] * w[e_j, n, k]
        rows, rmask, eid, e_lo, e_hi = _lk_row_tile(e_ptr, S, BM)
        rr = tl.arange(0, BR)
        rmask_r = rr < R
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < N
        ut = tl.load(u_ptr + rows[:, None] * stride_u + rr[None, :], mask=rmask[:, None] & rmask_r[None, :], other=0.0)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        e = e_lo
        while e <= e_hi:  # each expert of the tile
            wt = tl.load(w_ptr + e * sw_e + rr[:, None] * sw_r + cols[None, :] * sw_n,
                         mask=rmask_r[:, None] & cmask[None, :], other=0.0)
            acc = _lk_mma(tl.where((eid == e)[:, None], ut, tl.zeros_like(ut)), wt, acc, IEEE)
            e += 1
        m2 = rmask[:, None] & cmask[None, :]
        yp = y_ptr + rows[:, None] * stride_y + cols[None, :]
        y = tl.load(yp, mask=m2, other=0.0).to(tl.float32)
        tl.store(yp, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _lk_pre_act(gu_ptr, ut, bu_ptr, bias_ptr, rows, eid, e_lo, e_hi, cols, cmask, m2, I, RU, scale_up,
                    GPTOSS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_UP: tl.constexpr, IEEE: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BRU: tl.constexpr):
        # gate and up pre-activations of a (BM, BN) tile: gu + scale_up * u B[e]^T + bias[e], fp32
        if GPTOSS:  # interleaved [g0, u0, g1, u1, ...]
            gcol = 2 * cols
            ucol = 2 * cols + 1
        else:  # concatenated [gate | up]
            gcol = cols
            ucol = cols + I
        src = gu_ptr + rows[:, None] * (2 * I)
        gate = tl.load(src + gcol[None, :], mask=m2, other=0.0).to(tl.float32)
        up = tl.load(src + ucol[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_UP:
            ru = tl.arange(0, BRU)
            bmask = (ru < RU)[:, None] & cmask[None, :]
            cg = tl.zeros([BM, BN], dtype=tl.float32)
            cu = tl.zeros([BM, BN], dtype=tl.float32)
            e = e_lo
            while e <= e_hi:  # each expert of the tile
                ue = tl.where((eid == e)[:, None], ut, tl.zeros_like(ut))
                base = bu_ptr + e * (2 * I * RU)
                cg = _lk_mma(ue, tl.load(base + gcol[None, :] * RU + ru[:, None], mask=bmask, other=0.0), cg, IEEE)
                cu = _lk_mma(ue, tl.load(base + ucol[None, :] * RU + ru[:, None], mask=bmask, other=0.0), cu, IEEE)
                e += 1
            gate += scale_up * cg
            up += scale_up * cu
        if HAS_BIAS:
            b = bias_ptr + tl.maximum(eid, 0).to(tl.int64)[:, None] * (2 * I)
            gate += tl.load(b + gcol[None, :], mask=m2, other=0.0).to(tl.float32)
            up += tl.load(b + ucol[None, :], mask=m2, other=0.0).to(tl.float32)
        return gate, up, gcol, ucol

    @triton.jit
    def _lk_act_fwd(gu_ptr, uu_ptr, bu_ptr, bias_ptr, e_ptr, ad_ptr, h_ptr, part_ptr, S, I, RU, RD, scale_up, alpha,
                    limit, GPTOSS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_UP: tl.constexpr,
                    HAS_DOWN: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BRU: tl.constexpr,
                    BRD: tl.constexpr, PER: tl.constexpr):
        # h = gate(gu + scale_up * u_up B_up[e]^T + bias[e]); part[split, j] = sum_{n in split} h[j, n] A_down[e, :, n]
        rows, rmask, eid, e_lo, e_hi = _lk_row_tile(e_ptr, S, BM)
        split = tl.program_id(1)
        ru = tl.arange(0, BRU)
        rd = tl.arange(0, BRD)
        ut = tl.load(uu_ptr + rows[:, None] * RU + ru[None, :], mask=rmask[:, None] & (ru < RU)[None, :], other=0.0)
        acc_d = tl.zeros([BM, BRD], dtype=tl.float32)
        for c in range(PER):
            cols = (split * PER + c) * BN + tl.arange(0, BN)
            cmask = cols < I
            m2 = rmask[:, None] & cmask[None, :]
            gate, up, gcol, ucol = _lk_pre_act(gu_ptr, ut, bu_ptr, bias_ptr, rows, eid, e_lo, e_hi, cols, cmask, m2,
                                               I, RU, scale_up, GPTOSS, HAS_BIAS, HAS_UP, IEEE, BM, BN, BRU)
            if GPTOSS:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                h = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
            else:
                h = gate * tl.sigmoid(gate) * up
            hq = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + rows[:, None] * I + cols[None, :], hq, mask=m2)
            if HAS_DOWN:
                amask = cmask[:, None] & (rd < RD)[None, :]
                e = e_lo
                while e <= e_hi:  # each expert of the tile
                    at = tl.load(ad_ptr + e * (RD * I) + rd[None, :] * I + cols[:, None], mask=amask, other=0.0)
                    acc_d = _lk_mma(tl.where((eid == e)[:, None], hq, tl.zeros_like(hq)), at, acc_d, IEEE)
                    e += 1
        if HAS_DOWN:
            dst = part_ptr + split.to(tl.int64) * S * RD + rows[:, None] * RD + rd[None, :]
            tl.store(dst, acc_d, mask=rmask[:, None] & (rd < RD)[None, :])

    @triton.jit
    def _lk_act_bwd(gu_ptr, uu_ptr, bu_ptr, bias_ptr, e_ptr, gh_ptr, dud_ptr, ad_ptr, dgu_ptr, part_ptr, S, I, RU, RD,
                    scale_up, alpha, limit, GPTOSS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_UP: tl.constexpr, HAS_DOWN: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BRU: tl.constexpr, BRD: tl.constexpr, PER: tl.constexpr):
        # dh = gh + du_down A_down[e] (the down LoRA's input gradient, fused); dgu = gate'(pre-activations) * dh;
        # part[split, j] = scale_up * sum_{n in split} dgu[j, n] B_up[e, n, :]
        rows, rmask, eid, e_lo, e_hi = _lk_row_tile(e_ptr, S, BM)
        split = tl.program_id(1)
        ru = tl.arange(0, BRU)
        rd = tl.arange(0, BRD)
        ut = tl.load(uu_ptr + rows[:, None] * RU + ru[None, :], mask=rmask[:, None] & (ru < RU)[None, :], other=0.0)
        dut = tl.load(dud_ptr + rows[:, None] * RD + rd[None, :], mask=rmask[:, None] & (rd < RD)[None, :], other=0.0)
        acc_u = tl.zeros([BM, BRU], dtype=tl.float32)
        for c in range(PER):
            cols = (split * PER + c) * BN + tl.arange(0, BN)
            cmask = cols < I
            m2 = rmask[:, None] & cmask[None, :]
            gate, up, gcol, ucol = _lk_pre_act(gu_ptr, ut, bu_ptr, bias_ptr, rows, eid, e_lo, e_hi, cols, cmask, m2,
                                               I, RU, scale_up, GPTOSS, HAS_BIAS, HAS_UP, IEEE, BM, BN, BRU)
            g = tl.load(gh_ptr + rows[:, None] * I + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            if HAS_DOWN:
                amask = (rd < RD)[:, None] & cmask[None, :]
                e = e_lo
                while e <= e_hi:  # each expert of the tile
                    at = tl.load(ad_ptr + e * (RD * I) + rd[:, None] * I + cols[None, :], mask=amask, other=0.0)
                    g = _lk_mma(tl.where((eid == e)[:, None], dut, tl.zeros_like(dut)), at, g, IEEE)
                    e += 1
            if GPTOSS:
                gate_c = tl.minimum(gate, limit)
                up_c = tl.minimum(tl.maximum(up, -limit), limit)
                s = tl.sigmoid(gate_c * alpha)
                d_up = tl.where((up >= -limit) & (up <= limit), g * gate_c * s, 0.0)
                d_gate = g * (up_c + 1.0) * (s + alpha * gate_c * s * (1.0 - s))
                d_gate = tl.where(gate <= limit, d_gate, 0.0)
            else:
                s = tl.sigmoid(gate)
                d_up = g * gate * s
                d_gate = g * up * s * (1.0 + gate * (1.0 - s))
            dgq = d_gate.to(dgu_ptr.dtype.element_ty)
            duq = d_up.to(dgu_ptr.dtype.element_ty)
            dst = dgu_ptr + rows[:, None] * (2 * I)
            tl.store(dst + gcol[None, :], dgq, mask=m2)
            tl.store(dst + ucol[None, :], duq, mask=m2)
            if HAS_UP:
                bmask = cmask[:, None] & (ru < RU)[None, :]
                e = e_lo
                while e <= e_hi:  # each expert of the tile
                    sel = (eid == e)[:, None]
                    base = bu_ptr + e * (2 * I * RU)
                    bg = tl.load(base + gcol[:, None] * RU + ru[None, :], mask=bmask, other=0.0)
                    bu = tl.load(base + ucol[:, None] * RU + ru[None, :], mask=bmask, other=0.0)
                    acc_u = _lk_mma(tl.where(sel, dgq, tl.zeros_like(dgq)), bg, acc_u, IEEE)
                    acc_u = _lk_mma(tl.where(sel, duq, tl.zeros_like(duq)), bu, acc_u, IEEE)
                    e += 1
        if HAS_UP:
            dst = part_ptr + split.to(tl.int64) * S * RU + rows[:, None] * RU + ru[None, :]
            tl.store(dst, acc_u * scale_up, mask=rmask[:, None] & (ru < RU)[None, :])


def _lora_kernels() -> Any:
    """Tiled kernels of the fused LoRA-on-experts path (``_LoraUpAct``, ``_LoraDown``), or None without triton.

    A program owns a tile of BM rows sorted by expert: one expert, or a few where slices meet. It loops over the
    experts ``sorted_e[first row] .. sorted_e[last row]`` and masks the other rows out of each low-rank product, so
    no tile table is built and nothing syncs with the host. The rank is padded to BR >= 16 by masks (``tl.dot``
    on tensor cores); every sum is fp32; partial sums over column splits go to separate rows (no atomics).
    """
    if triton is None:
        return None
    from types import SimpleNamespace

    return SimpleNamespace(shrink=_lk_shrink, expand=_lk_expand, act_fwd=_lk_act_fwd, act_bwd=_lk_act_bwd)


_BLOCK = 1024


def _unsort_sum(kern, y, route: _Route, w=None, bias=None) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * (y[row of (t,k)] + bias[e])``: fp32 accumulation, output in ``y.dtype``."""
    T, K, n = route.num_tokens, route.top_k, y.shape[1]
    if kern is not None:
        out = y.new_empty(T, n)
        y = y.contiguous()
        dummy = route.inv_perm
        kern.unsort_sum[(T, kern.cdiv(n, _BLOCK))](
            y, route.inv_perm, w.contiguous() if w is not None else dummy, bias if bias is not None else dummy,
            route.flat_e, out, n, K=K, HAS_W=w is not None, HAS_BIAS=bias is not None, BLOCK=_BLOCK)
        return out
    y_tok = y.index_select(0, route.inv_perm).view(T, K, n)
    if w is None:
        out = y_tok.sum(1)  # fp32 accumulation inside the reduction
    else:
        out = torch.bmm(w.view(T, 1, K).to(y.dtype), y_tok).view(T, n)  # fp32 accumulation inside the GEMM
    if bias is not None:
        out = out.addmm_(_routing_matrix(route, w, y.dtype), bias)
    return out


def _routing_matrix(route: _Route, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense (T, E) routing weights: the combine's bias term is ``R @ bias``, its gradient ``R^T @ g``."""
    T, K = route.num_tokens, route.top_k
    experts = torch.arange(route.num_experts, device=w.device)
    one_hot = (route.flat_e.view(T, K, 1) == experts).to(dtype)  # no host sync (F.one_hot checks bounds on host)
    return torch.bmm(w.view(T, 1, K).to(dtype), one_hot).view(T, route.num_experts)  # deterministic


class _Dispatch(torch.autograd.Function):
    """Rows of ``x`` in expert order; backward sums each token's k rows in fp32 (no atomics)."""

    @staticmethod
    def forward(ctx, x, route, kern):
        ctx.route, ctx.kern = route, kern
        return x.index_select(0, route.token_idx)

    @staticmethod
    def backward(ctx, g):
        return _unsort_sum(ctx.kern, g.contiguous(), ctx.route), None, None


class _Combine(torch.autograd.Function):
    """``out[t] = sum_k w[t,k] (y[row of (t,k)] + bias[e])`` back in token order, accumulated in fp32."""

    @staticmethod
    def forward(ctx, y, w_flat, bias, route, kern):
        ctx.route, ctx.kern = route, kern
        ctx.save_for_backward(y, w_flat, bias)
        return _unsort_sum(kern, y, route, w_flat, bias)

    @staticmethod
    def backward(ctx, g):
        y, w_flat, bias = ctx.saved_tensors
        route, kern = ctx.route, ctx.kern
        g = g.contiguous()
        need_w = ctx.needs_input_grad[1]
        w_sorted = w_flat.index_select(0, route.perm)
        if kern is not None:
            gy = torch.empty_like(y)
            gw_sorted = torch.empty(y.shape[0], device=y.device, dtype=torch.float32) if need_w else gy
            kern.combine_bwd[(y.shape[0],)](
                g, y, route.token_idx, w_sorted, bias if bias is not None else g, route.sorted_e, gy, gw_sorted,
                y.shape[1], HAS_BIAS=bias is not None, NEED_GW=need_w, BLOCK=_BLOCK)
        else:
            g_rows = g.index_select(0, route.token_idx)
            if need_w:
                yb = y if bias is None else y + bias.index_select(0, route.sorted_e)
                gw_sorted = torch.bmm(g_rows.unsqueeze(1), yb.unsqueeze(2)).view(-1)
            gy = g_rows.mul_(w_sorted.to(g_rows.dtype).unsqueeze(1))
        gw = gw_sorted.index_select(0, route.inv_perm).to(w_flat.dtype) if need_w else None
        gb = None
        if bias is not None and ctx.needs_input_grad[2]:
            gb = _routing_matrix(route, w_flat, g.dtype).t().mm(g).to(bias.dtype)
        return gy, gw, gb, None, None


# --------------------------------------------------------------------------------------------------------------
# Gate: SwiGLU (concatenated) or gpt-oss's interleaved clamped SwiGLU, with the expert bias, fused
# --------------------------------------------------------------------------------------------------------------
def _act_torch(z: torch.Tensor, gptoss: bool, alpha: float, limit: float) -> torch.Tensor:
    gate, up = (z[:, 0::2], z[:, 1::2]) if gptoss else z.chunk(2, dim=-1)
    if gptoss:
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)
    return F.silu(gate) * up


def _act_grad_torch(z: torch.Tensor, g: torch.Tensor, gptoss: bool, alpha: float, limit: float) -> torch.Tensor:
    gate, up = (z[:, 0::2], z[:, 1::2]) if gptoss else z.chunk(2, dim=-1)
    if gptoss:
        gate_c, up_c = gate.clamp(max=limit), up.clamp(-limit, limit)
        s = torch.sigmoid(gate_c * alpha)
        d_up = torch.where((up >= -limit) & (up <= limit), g * gate_c * s, 0.0)
        d_gate = torch.where(gate <= limit, g * (up_c + 1) * (s + alpha * gate_c * s * (1 - s)), 0.0)
        return torch.stack([d_gate, d_up], dim=-1).view_as(z)
    s = torch.sigmoid(gate)
    return torch.cat([g * up * s * (1 + gate * (1 - s)), g * gate * s], dim=-1)


class _Activation(torch.autograd.Function):
    """``h = gate(gu + bias[e])`` in fp32, one pass each way; saves only ``gu``."""

    @staticmethod
    def forward(ctx, gu, bias, route, gptoss, alpha, limit, kern):
        ctx.route, ctx.kern, ctx.args = route, kern, (gptoss, alpha, limit)
        ctx.save_for_backward(gu, bias)
        n = gu.shape[1] // 2
        if kern is not None:
            h = gu.new_empty(gu.shape[0], n)
            kern.act_fwd[(gu.shape[0], kern.cdiv(n, _BLOCK))](
                gu, bias if bias is not None else gu, route.sorted_e, h, n, alpha, limit,
                GPTOSS=gptoss, HAS_BIAS=bias is not None, BLOCK=_BLOCK)
            return h
        return _act_torch(_biased(gu, bias, route), gptoss, alpha, limit).to(gu.dtype)

    @staticmethod
    def backward(ctx, gh):
        gu, bias = ctx.saved_tensors
        route, kern, (gptoss, alpha, limit) = ctx.route, ctx.kern, ctx.args
        gh = gh.contiguous()
        if kern is not None:
            dgu = torch.empty_like(gu)
            n = gu.shape[1] // 2
            kern.act_bwd[(gu.shape[0], kern.cdiv(n, _BLOCK))](
                gu, bias if bias is not None else gu, route.sorted_e, gh, dgu, n, alpha, limit,
                GPTOSS=gptoss, HAS_BIAS=bias is not None, BLOCK=_BLOCK)
        else:
            dgu = _act_grad_torch(_biased(gu, bias, route), gh.float(), gptoss, alpha, limit).to(gu.dtype)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:  # per-expert row sums as one small GEMM, no atomics
            experts = torch.arange(route.num_experts, device=gu.device).unsqueeze(1)
            dbias = (route.sorted_e.unsqueeze(0) == experts).to(dgu.dtype).mm(dgu).to(bias.dtype)
        return dgu if ctx.needs_input_grad[0] else None, dbias, None, None, None, None, None


def _biased(gu: torch.Tensor, bias: Optional[torch.Tensor], route: _Route) -> torch.Tensor:
    z = gu.float()
    return z if bias is None else z + bias.float().index_select(0, route.sorted_e)


# --------------------------------------------------------------------------------------------------------------
# LoRA on experts, fused (CUDA/Triton): the low-rank products ride on passes the experts path makes anyway
# --------------------------------------------------------------------------------------------------------------
# Per projection with LoRA, the unfused composition (``_with_lora``) costs a skinny grouped_mm for x A^T, one for
# u B^T writing a full (S, out) tensor, and an add reading two of them; backward the same again plus autograd's
# sums. Here, with u = x A^T (rank r) kept per sorted row:
#   forward   x A_up^T: fused with the dispatch gather (one pass over x, which is written anyway);
#             s_up u_up B_up^T: added to the gate's pre-activations inside the gate kernel (never stored);
#             h A_down^T: taken from the gate kernel's h tile before it leaves registers;
#             s_down u_down B_down^T: added in place to the down projection's output (read + write, no temporary).
#   backward  du_down = s_down gy B_down: one pass over gy; du_down A_down: added to dh inside the gate's backward,
#             which also forms du_up = s_up dgu B_up from its dgu tile; du_up A_up: added in place to dx;
#             the factor gradients are four skinny grouped_mm weight gradients (deterministic, no atomics).
# The gate's backward recomputes the LoRA term of the pre-activations from u_up (cheap, tensor cores) instead of
# keeping a second (S, 2I) tensor.
# (rows, columns, warps) per program of each kernel: spill-free on sm_90 by ptxas -v (act_fwd ~245 registers at 8
# warps, act_bwd ~246, shrink ~124, expand ~156 at 4); change here to A/B other tilings.
_LORA_TILES = {"shrink": (64, 32, 8), "expand": (64, 64, 4), "act_fwd": (64, 64, 8), "act_bwd": (64, 32, 8)}


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(m_tiles: int, n_chunks: int, device: torch.device) -> tuple[int, int]:
    """(column splits, chunks per split): split the column loop when the row tiles alone give fewer than ~8
    programs per SM (small batches), so that the row-reducing kernels still fill the GPU. Splits are powers of two
    and chunks per split a compile-time constant: a few kernel variants per model, whatever the token count."""
    want = min(n_chunks, -(-8 * _sm_count(device) // max(1, m_tiles)))
    splits = 1
    while splits < want:
        splits *= 2
    per = -(-n_chunks // splits)
    return -(-n_chunks // per), per


def _rank_block(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _shrink(lk, x: torch.Tensor, w: torch.Tensor, route: _Route, scale: float, out_dtype: torch.dtype,
            gather: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``u[j] = scale * w[e_j] @ x[j]`` for ``w`` viewed (E, r, N): (S, r) in ``out_dtype``. With ``gather``, ``x``
    is in token order and row j reads ``x[token_idx[j]]``; the gathered rows are returned too (the dispatch)."""
    S, (_, R, N) = route.perm.numel(), w.shape
    bm, bn, warps = _LORA_TILES["shrink"]
    m_tiles, n_chunks = triton.cdiv(S, bm), triton.cdiv(N, bn)
    splits, per = _splits(m_tiles, n_chunks, x.device)
    part = torch.empty(splits, S, R, device=x.device, dtype=torch.float32)
    xs = x.new_empty(S, N) if gather else None
    lk.shrink[(m_tiles, splits)](
        x, route.token_idx, xs if gather else x, w, route.sorted_e, part, S, N, R, x.stride(0), *w.stride(),
        float(scale), GATHER=gather, STORE_X=gather, IEEE=x.dtype == torch.float32, BM=bm, BN=bn, BR=_rank_block(R),
        PER=per, num_warps=warps)
    u = part[0] if splits == 1 else part.sum(0)
    return u.to(out_dtype), xs


def _expand_(lk, y: torch.Tensor, u: torch.Tensor, w: torch.Tensor, route: _Route, scale: float) -> torch.Tensor:
    """In place: ``y[j] += scale * w[e_j] @ u[j]`` for ``w`` viewed (E, N, r)."""
    S, (_, N, R) = route.perm.numel(), w.shape
    bm, bn, warps = _LORA_TILES["expand"]
    lk.expand[(triton.cdiv(S, bm), triton.cdiv(N, bn))](
        y, u, w, route.sorted_e, S, N, R, y.stride(0), u.stride(0), *w.stride(), float(scale),
        IEEE=y.dtype == torch.float32, BM=bm, BN=bn, BR=_rank_block(R), num_warps=warps)
    return y


class _LoraUpAct(torch.autograd.Function):
    """Dispatch, up projection with its LoRA, gate, and the down LoRA's first factor: ``(h, u_down)`` per sorted row.

    ``u_down = h A_down[e]^T`` (unscaled; an (S, 0) tensor without a down LoRA). Saves the dispatched ``x``, the
    base ``gu`` (before LoRA and bias), ``u_up`` and ``h`` (for ``A_down``'s gradient only).
    """

    @staticmethod
    def forward(ctx, hidden, w_up, bias, a_up, b_up, a_down, route, plan, s_up, alpha, limit):
        lk = plan.lora_kern
        ctx.set_materialize_grads(False)
        dtype = w_up.dtype
        has_up, has_down = a_up is not None, a_down is not None
        hidden = hidden.contiguous()
        if has_up:
            u_up, x = _shrink(lk, hidden, a_up, route, 1.0, dtype, gather=True)
        else:
            x, u_up = hidden.index_select(0, route.token_idx), None
        gu = _gmm(x, w_up, route, plan.trans)
        S, I = gu.shape[0], gu.shape[1] // 2
        h = gu.new_empty(S, I)
        bm, bn, warps = _LORA_TILES["act_fwd"]
        m_tiles, n_chunks = triton.cdiv(S, bm), triton.cdiv(I, bn)
        splits, per = _splits(m_tiles, n_chunks, gu.device)
        rd = a_down.shape[1] if has_down else 0
        part = torch.empty(splits, S, rd, device=gu.device, dtype=torch.float32)
        ru = a_up.shape[1] if has_up else 0
        lk.act_fwd[(m_tiles, splits)](
            gu, u_up if has_up else gu, b_up if has_up else gu, bias if bias is not None else gu, route.sorted_e,
            a_down if has_down else gu, h, part, S, I, ru, rd, float(s_up), alpha, limit,
            GPTOSS=plan.act == "gptoss", HAS_BIAS=bias is not None, HAS_UP=has_up, HAS_DOWN=has_down,
            IEEE=dtype == torch.float32, BM=bm, BN=bn, BRU=_rank_block(ru), BRD=_rank_block(rd), PER=per,
            num_warps=warps)
        u_down = (part[0] if splits == 1 else part.sum(0)).to(dtype)
        ctx.route, ctx.plan, ctx.args = route, plan, (float(s_up), alpha, limit)
        ctx.save_for_backward(x, gu, u_up, h if has_down else None, w_up, bias, a_up, b_up, a_down)
        return h, u_down

    @staticmethod
    def backward(ctx, gh, gu_down):
        x, gu, u_up, h, w_up, bias, a_up, b_up, a_down = ctx.saved_tensors
        route, plan, (s_up, alpha, limit) = ctx.route, ctx.plan, ctx.args
        lk = plan.lora_kern
        need = ctx.needs_input_grad
        has_up, has_down = a_up is not None, a_down is not None and gu_down is not None
        S, I = gu.shape[0], gu.shape[1] // 2
        gh = gh.contiguous() if gh is not None else gu.new_zeros(S, I)
        gu_down = gu_down.contiguous() if has_down else None
        dgu = torch.empty_like(gu)
        bm, bn, warps = _LORA_TILES["act_bwd"]
        m_tiles, n_chunks = triton.cdiv(S, bm), triton.cdiv(I, bn)
        splits, per = _splits(m_tiles, n_chunks, gh.device)
        ru, rd = (a_up.shape[1] if has_up else 0), (a_down.shape[1] if has_down else 0)
        part = torch.empty(splits, S, ru, device=gh.device, dtype=torch.float32)
        lk.act_bwd[(m_tiles, splits)](
            gu, u_up if has_up else gu, b_up if has_up else gu, bias if bias is not None else gu, route.sorted_e, gh,
            gu_down if has_down else gu, a_down if has_down else gu, dgu, part, S, I, ru, rd, s_up, alpha, limit,
            GPTOSS=plan.act == "gptoss", HAS_BIAS=bias is not None, HAS_UP=has_up, HAS_DOWN=has_down,
            IEEE=gu.dtype == torch.float32, BM=bm, BN=bn, BRU=_rank_block(ru), BRD=_rank_block(rd), PER=per,
            num_warps=warps)
        du_up = (part[0] if splits == 1 else part.sum(0)).to(gu.dtype) if has_up else None
        d_hidden = None
        if need[0]:
            dx = _gmm(dgu, w_up, route, not plan.trans)
            if has_up:
                _expand_(lk, dx, du_up, a_up.transpose(1, 2), route, 1.0)
            d_hidden = _unsort_sum(plan.kern, dx, route)
        d_w = _gmm_wgrad(x, dgu, route, plan.trans) if need[1] else None
        d_bias = _expert_row_sums(dgu, route).to(bias.dtype) if bias is not None and need[2] else None
        d_a_up = _gmm_wgrad(x, du_up, route, True) if has_up and need[3] else None
        d_b_up = _gmm_wgrad(u_up, dgu, route, True).mul_(s_up) if has_up and need[4] else None
        d_a_down = _gmm_wgrad(h, gu_down, route, True) if has_down and need[5] else None
        return d_hidden, d_w, d_bias, d_a_up, d_b_up, d_a_down, None, None, None, None, None


class _LoraDown(torch.autograd.Function):
    """Down projection plus ``s * u_down B_down[e]^T`` added in place: ``y`` per sorted row."""

    @staticmethod
    def forward(ctx, h, u_down, w_down, b_down, route, plan, s_down):
        y = _gmm(h, w_down, route, plan.trans)
        if b_down is not None:
            _expand_(plan.lora_kern, y, u_down, b_down, route, s_down)
        ctx.route, ctx.plan, ctx.s = route, plan, float(s_down)
        need_w = ctx.needs_input_grad[2]
        ctx.save_for_backward(h if need_w else None, u_down if b_down is not None else None, w_down, b_down)
        return y

    @staticmethod
    def backward(ctx, gy):
        h, u_down, w_down, b_down = ctx.saved_tensors
        route, plan, s = ctx.route, ctx.plan, ctx.s
        need = ctx.needs_input_grad
        gy = gy.contiguous()
        gh = _gmm(gy, w_down, route, not plan.trans) if need[0] else None
        du = db = None
        if b_down is not None:
            if need[1]:
                du, _ = _shrink(plan.lora_kern, gy, b_down.transpose(1, 2), route, s, gy.dtype)
            if need[3]:
                db = _gmm_wgrad(u_down, gy, route, True).mul_(s)
        dw = _gmm_wgrad(h, gy, route, plan.trans) if need[2] else None
        return gh, du, dw, db, None, None, None


def _expert_row_sums(g: torch.Tensor, route: _Route) -> torch.Tensor:
    """Per-expert sums of sorted rows as one small GEMM (no atomics): a bias gradient."""
    experts = torch.arange(route.num_experts, device=g.device).unsqueeze(1)
    return (route.sorted_e.unsqueeze(0) == experts).to(g.dtype).mm(g)


def _fused_lora_experts(module: nn.Module, plan: "_Plan", hidden: torch.Tensor, route: _Route, lora: dict,
                        dtype: torch.dtype, pad: bool) -> torch.Tensor:
    """The experts forward with LoRA through ``_LoraUpAct`` and ``_LoraDown``: sorted rows ``y`` before the combine."""
    up = lora.get(plan.up_name, ())
    down = lora.get("down_proj", ())
    a_up = b_up = a_down = b_down = None
    s_up = s_down = 0.0
    if up:
        (A, B, s_up), = up
        a_up, b_up = _lora_factors(A, B, route.num_experts, dtype, pad)
    if down:
        (A, B, s_down), = down
        a_down, b_down = _lora_factors(A, B, route.num_experts, dtype, pad)
    w_up = getattr(module, plan.up_name).to(dtype)
    bias = getattr(module, plan.up_name + "_bias").to(dtype) if plan.has_bias else None
    h, u_down = _LoraUpAct.apply(hidden, w_up, bias, a_up, b_up, a_down, route, plan, s_up,
                                 float(getattr(module, "alpha", 0.0)), float(getattr(module, "limit", 0.0)))
    return _LoraDown.apply(h, u_down, module.down_proj.to(dtype), b_down, route, plan, s_down)


# --------------------------------------------------------------------------------------------------------------
# Per-module plan (chosen in attach) and the experts forward registered with transformers
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    up_name: str  # "gate_up_proj" (gated) or "up_proj"
    trans: bool  # weights stored (E, out, in): y = x @ W[e].T
    has_bias: bool
    act: str  # "silu" | "gptoss" | "generic" (the model's own _apply_gate / act_fn)
    device: torch.device
    dtype: torch.dtype
    backend: str  # "grouped" | "loop"
    kern: Any  # triton kernels or None
    lora_kern: Any = None  # the fused LoRA kernels (``_lora_kernels``), or None: LoRA as separate products


def _act_kind(module: nn.Module) -> str:
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    gate_fn = getattr(type(module), "_apply_gate", None)
    if not module.has_gate:
        return "generic"
    if gate_fn is _default_apply_gate and isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU)):
        return "silu"
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:  # pragma: no cover
        return "generic"
    if gate_fn is GptOssExperts._apply_gate and hasattr(module, "alpha") and hasattr(module, "limit"):
        return "gptoss"
    return "generic"


def _make_plan(module: nn.Module, device: torch.device, dtype: torch.dtype, backend: str = "auto",
               kernels: str = "auto", lora: str = "auto") -> _Plan:
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    trans = not module.is_transposed
    w_up, w_down = getattr(module, up_name), module.down_proj
    dims = {w_up.shape[1], w_up.shape[2], w_down.shape[1], w_down.shape[2]}
    if backend == "auto":
        grouped = (device.type == "cuda" and dtype == torch.bfloat16 and _GROUPED_MM is not None
                   and torch.cuda.get_device_capability(device) >= (8, 0) and all(d % _ALIGN == 0 for d in dims))
        backend = "grouped" if grouped else "loop"
    act = _act_kind(module)
    kern = None  # dispatch/combine kernels for every family; the fused gate only for "silu" and "gptoss"
    if kernels == "triton" or (kernels == "auto" and device.type == "cuda"):
        kern = _kernels()
        if kern is None and kernels == "triton":
            raise RuntimeError("nbkit fast_moe_routing: kernels='triton' but triton is not installed")
    lora_kern = None  # fused LoRA: needs the fused gate, so "silu" and "gptoss" only
    # "auto" = unfused: measured on the H200 (16K tokens, r=16) the fused kernels were slower on gpt-oss (22.6 vs
    # 16.5 ms) and even on Qwen3-30B-A3B (9.2 vs 9.3 ms); they stay available as lora="fused"
    if act != "generic" and lora == "fused":
        lora_kern = _lora_kernels()
        if lora_kern is None and lora == "fused":
            raise RuntimeError("nbkit fast_moe_routing: lora='fused' but triton is not installed")
    return _Plan(up_name, trans, bool(module.has_bias), act, device, dtype, backend, kern, lora_kern)


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    dev = weight.device.type
    if torch.is_autocast_enabled(dev) and weight.dtype == torch.float32:
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def _lora_factors(A: torch.Tensor, B: torch.Tensor, num_experts: int, dtype: torch.dtype, pad: bool):
    """PEFT ParamWrapper factors as (E, r, in) and (E, out, r), optionally zero-padded to a rank multiple of 8."""
    r = A.shape[0] // num_experts
    A3 = A.view(num_experts, r, A.shape[1]).to(dtype)
    B3 = B.view(B.shape[0], r, num_experts).permute(2, 0, 1).to(dtype)
    if pad and r % _ALIGN:
        extra = _ALIGN - r % _ALIGN
        return F.pad(A3, (0, 0, 0, extra)), F.pad(B3, (0, extra))
    return A3, B3.contiguous()


def _with_lora(y: torch.Tensor, x: torch.Tensor, factors, route: _Route, dtype, pad: bool) -> torch.Tensor:
    for A, B, scaling in factors:
        A3, B3 = _lora_factors(A, B, route.num_experts, dtype, pad)
        u = _ExpertsLinear.apply(x, A3, route, True) * scaling
        y = y.add_(_ExpertsLinear.apply(u, B3, route, True))  # y is a fresh matmul output nothing saved
    return y


def nbkit_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    nbkit_lora: Optional[dict] = None,
) -> torch.Tensor:
    """Experts forward for ``ExpertsInterface``: same inputs and outputs as the model's own experts forward.

    ``nbkit_lora`` (passed only by the PEFT bypass) maps a weight name to ``[(lora_A, lora_B, scaling), ...]`` in
    PEFT ``ParamWrapper`` layout; those deltas are added as low-rank products on each expert's rows.
    """
    num_tokens = hidden_states.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    plan = getattr(self, "_nbkit_moe_plan", None)
    w_up0 = getattr(self, "gate_up_proj" if self.has_gate else "up_proj")
    dtype = _compute_dtype(w_up0)
    if plan is None or plan.device != w_up0.device or plan.dtype != dtype:
        plan = _make_plan(self, w_up0.device, dtype)
    lora = nbkit_lora or {}
    pad = plan.backend == "grouped"
    with torch.autocast(plan.device.type, enabled=False):
        w_up, w_down = w_up0.to(dtype), self.down_proj.to(dtype)
        route = _route(top_k_index, self.num_experts, host_counts=plan.backend == "loop")
        down_bias = self.down_proj_bias.to(dtype) if plan.has_bias else None
        if plan.lora_kern is not None and any(lora.values()) and all(len(f) <= 1 for f in lora.values()):
            y = _fused_lora_experts(self, plan, hidden_states.to(dtype), route, lora, dtype, pad)
            out = _Combine.apply(y, top_k_weights.reshape(-1), down_bias, route, plan.kern)
            return out.to(hidden_states.dtype)
        x = _Dispatch.apply(hidden_states.to(dtype), route, plan.kern)
        gu = _ExpertsLinear.apply(x, w_up, route, plan.trans)
        gu = _with_lora(gu, x, lora.get(plan.up_name, ()), route, dtype, pad)
        up_bias = getattr(self, plan.up_name + "_bias") if plan.has_bias else None
        if plan.act == "generic":
            if up_bias is not None:
                gu = gu + up_bias.to(dtype).index_select(0, route.sorted_e)
            h = self._apply_gate(gu) if self.has_gate else self.act_fn(gu)
        else:
            h = _Activation.apply(gu, up_bias, route, plan.act == "gptoss", float(getattr(self, "alpha", 0.0)),
                                  float(getattr(self, "limit", 0.0)), plan.kern)
        y = _ExpertsLinear.apply(h, w_down, route, plan.trans)
        y = _with_lora(y, h, lora.get("down_proj", ()), route, dtype, pad)
        out = _Combine.apply(y, top_k_weights.reshape(-1), down_bias, route, plan.kern)
    return out.to(hidden_states.dtype)


def register() -> None:
    """Register ``nbkit_experts_forward`` as ``"nbkit"`` with transformers' ``ExpertsInterface`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if ALL_EXPERTS_FUNCTIONS.get(IMPL_NAME) is not nbkit_experts_forward:
        ExpertsInterface.register(IMPL_NAME, nbkit_experts_forward)


# --------------------------------------------------------------------------------------------------------------
# PEFT: LoRA on expert tensors without the parametrization
# --------------------------------------------------------------------------------------------------------------
class _LoraBypass:
    """Instance ``forward`` of the outermost PEFT ``ParamWrapper`` around an experts module.

    PEFT registers a parametrization computing ``W + scaling * B A`` for all experts (evaluated on registration
    and on use). Here the active LoRA factors go to the experts forward instead; any state this does not cover is
    handed to PEFT's own forward unchanged.
    """

    def __init__(self, outer: nn.Module, chain: list, experts: nn.Module):
        self.outer, self.chain, self.experts = outer, chain, experts

    def original(self, *args, **kwargs):
        return type(self.outer).forward(self.outer, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if kwargs.get("adapter_names") is not None or self.experts.config._experts_implementation != IMPL_NAME:
            return self.original(*args, **kwargs)
        lora = {}
        for wrapper in self.chain:
            if wrapper.merged or wrapper.disable_adapters:
                return self.original(*args, **kwargs)
            if wrapper.get_param().dtype not in _FLOAT_DTYPES:
                return self.original(*args, **kwargs)
            names = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
            if names:
                lora[wrapper.parameter_name] = [
                    (wrapper.lora_A[a].weight, wrapper.lora_B[a].weight, wrapper.scaling[a]) for a in names
                ]
        kwargs.pop("adapter_names", None)
        return self.experts(*args, nbkit_lora=lora, **kwargs)


def _param_wrapper_cls():
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return None
    return ParamWrapper


# --------------------------------------------------------------------------------------------------------------
# The speedup object
# --------------------------------------------------------------------------------------------------------------
def _is_interface_experts(module: nn.Module) -> bool:
    """An experts module whose class went through transformers' ``use_experts_implementation``."""
    return (
        all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "config", "num_experts"))
        and hasattr(type(module), "_apply_gate")
        and hasattr(type(module).forward, "__wrapped__")
    )


def _unsupported_reason(base: nn.Module, experts: list) -> Optional[str]:
    dist = getattr(getattr(base, "config", None), "distributed_config", None)
    if getattr(base, "_tp_size", None) or getattr(dist, "tp_size", None) or getattr(dist, "enable_expert_parallel", 0):
        return "tensor/expert-parallel sharding (expert-parallel sentinel ids) is not supported"
    for m in experts:
        names = ("gate_up_proj" if m.has_gate else "up_proj", "down_proj")
        for name in names:
            p = getattr(m, name, None)
            if not isinstance(p, torch.Tensor) or p.dim() != 3 or p.shape[0] != m.num_experts:
                return f"{type(m).__name__}.{name} is not a ({m.num_experts}, ., .) expert tensor"
            if p.dtype not in _FLOAT_DTYPES:
                return f"{type(m).__name__}.{name} has dtype {p.dtype} (quantized experts are not supported)"
    return None


class FastMoERouting:
    """nbkit's MoE experts path (see the module docstring). ``attach(model) -> bool``, ``detach()``.

    ``backend``: "auto" (grouped_mm on CUDA bf16 with aligned dims, else contiguous slices), "grouped" or "loop".
    ``kernels``: "auto" (Triton on CUDA when installed), "triton" or "torch".
    ``lora``: how LoRA on experts runs: "auto" (= "unfused": separate low-rank products on the sorted slices, the
    faster one on the H200), "fused" (folded into the dispatch, gate and down projection by Triton kernels; slower
    as measured, kept for GPUs where it may pay) or "unfused".
    """

    name = "fast_moe_routing"

    def __init__(self, backend: str = "auto", kernels: str = "auto", lora: str = "auto") -> None:
        if (backend not in ("auto", "grouped", "loop") or kernels not in ("auto", "triton", "torch")
                or lora not in ("auto", "fused", "unfused")):
            raise ValueError(f"backend={backend!r}, kernels={kernels!r}, lora={lora!r}")
        self.backend, self.kernels, self.lora = backend, kernels, lora
        self._base: Optional[nn.Module] = None
        self._prev_impl: Optional[dict] = None
        self._config_prev: list = []  # (config, previous internal value) set directly
        self._planned: list = []  # experts modules carrying _nbkit_moe_plan
        self._bypassed: list = []  # outer PEFT ParamWrappers whose instance forward we set

    def attach(self, model: nn.Module) -> bool:
        self.detach()
        base = unwrap_model(model)
        experts = [m for m in base.modules() if _is_interface_experts(m)]
        if not experts:
            # a dense model: nothing to route, so nothing to warn about
            logger.info("nbkit fast_moe_routing: off for %s: no experts module goes through transformers' "
                        "ExpertsInterface", type(base).__name__)
            return False
        reason = _unsupported_reason(base, experts)
        if reason:
            impl = experts[0].config._experts_implementation
            logger.warning("nbkit fast_moe_routing: off for %s: %s; experts stay on transformers' %r",
                           type(base).__name__, reason, impl)
            return False
        register()
        try:
            self._select(base, experts)
        except (RuntimeError, ValueError) as err:  # e.g. a load-time-only implementation (deepgemm_megamoe)
            self._restore_impl()
            logger.warning("nbkit fast_moe_routing: off for %s: cannot switch the experts implementation (%s)",
                           type(base).__name__, err)
            return False
        for m in experts:
            w = getattr(m, "gate_up_proj" if m.has_gate else "up_proj")
            m._nbkit_moe_plan = _make_plan(m, w.device, _compute_dtype(w), self.backend, self.kernels,
                                            self.lora)
            self._planned.append(m)
        self._bypass_peft(base)
        plan = experts[0]._nbkit_moe_plan
        logger.info("nbkit fast_moe_routing: on for %d experts modules of %s (backend=%s, gate=%s, kernels=%s, "
                    "LoRA bypass on %d, %s)", len(experts), type(base).__name__, plan.backend, plan.act,
                    "triton" if plan.kern is not None else "torch", len(self._bypassed),
                    "fused" if plan.lora_kern is not None else "unfused")
        return True

    def detach(self) -> None:
        for outer in reversed(self._bypassed):
            outer.__dict__.pop("forward", None)  # back to the class's forward
        self._bypassed = []
        for m in self._planned:
            m.__dict__.pop("_nbkit_moe_plan", None)
        self._planned = []
        self._restore_impl()

    # -- helpers --------------------------------------------------------------------------------------------
    def _select(self, base: nn.Module, experts: list) -> None:
        self._base = base
        if hasattr(base, "set_experts_implementation") and hasattr(base, "get_experts_implementation"):
            self._prev_impl = base.get_experts_implementation()
            base.set_experts_implementation(IMPL_NAME)
        for m in experts:  # bare modules, or configs the model-level setter does not reach
            cfg = m.config
            if cfg._experts_implementation != IMPL_NAME:
                self._config_prev.append((cfg, cfg._experts_implementation_internal))
                cfg._experts_implementation_internal = IMPL_NAME

    def _restore_impl(self) -> None:
        for cfg, prev in reversed(self._config_prev):
            cfg._experts_implementation_internal = prev
        self._config_prev = []
        if self._base is not None and self._prev_impl is not None:
            self._base.set_experts_implementation(self._prev_impl)
        self._base, self._prev_impl = None, None

    def _bypass_peft(self, base: nn.Module) -> None:
        pw_cls = _param_wrapper_cls()
        if pw_cls is None:
            return
        wrappers = [m for m in base.modules() if isinstance(m, pw_cls)]
        inner = {id(w.base_layer) for w in wrappers}
        kept: dict = {}  # reason -> number of experts modules left on PEFT's path
        for outer in (w for w in wrappers if id(w) not in inner):
            chain, cur = [], outer
            while isinstance(cur, pw_cls):
                chain.append(cur)
                cur = cur.base_layer
            if not _is_interface_experts(cur):
                continue
            plan = cur._nbkit_moe_plan
            why = None
            if "forward" in outer.__dict__:
                why = "its forward is already replaced on the instance (hooks)"
            for w in chain:
                if w.parameter_name not in (plan.up_name, "down_proj") or w.num_experts != cur.num_experts:
                    why = f"LoRA on {w.parameter_name!r} is not an expert weight nbkit computes"
            if why:
                kept[why] = kept.get(why, 0) + 1
                continue
            outer.forward = _LoraBypass(outer, chain, cur)  # scoped, instance-level; detach removes it
            self._bypassed.append(outer)
        for why, count in kept.items():
            logger.warning("nbkit fast_moe_routing: LoRA on %d experts modules stays on PEFT's parametrization "
                           "(W + BA formed each step): %s", count, why)
