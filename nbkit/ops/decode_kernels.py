"""The small ops of a one-token decode step, each one kernel: RMSNorm; q/k norm + rotary + the key/value write;
attention of one query a row over a key/value buffer; SiLU-gated product.

Why: at batch 1 a decoder layer's matmuls read ~100 MB of weights in a few tens of microseconds, so every other
kernel of the step costs about as much as its launch and drain. In torch the per-head norms, the rotary embedding and
the two cache writes are ~8 kernels a layer, and a general attention kernel spends ~10 us setting up one query.
Here each is one Triton kernel; attention splits the keys over programs (split-KV) when the buffer is long, and a
second kernel combines the splits.

Each op has its reference in torch (``use_triton=False``), which is also what runs without Triton or on a CPU.
Rounding follows transformers' modules: a norm's output is rounded to the compute dtype before its weight is
applied; the Triton kernels compute in float32 and round each op's result once, so they differ from the reference
by rounding only (tests: exact in float32 up to summation order, under ``TRITON_INTERPRET=1`` on a CPU and on GPU).

Contract: torch and optional Triton only. Layouts: ``qkv`` (b, (h + 2 kv) * d) as fused q|k|v projections;
key/value buffers (b, kv, capacity, d); ``mask`` (b, capacity) additive (0 where a key may be seen); ``slot`` a
one-element long tensor, the position written this step (shared by the rows); ``pos`` (b,) the rotary positions.
A kv head's ``h // kv`` query heads are consecutive (transformers' ``repeat_kv``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional: the fused kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

HAS_TRITON = triton is not None
PROGRAMS = 128  # attention splits a row's keys until (rows x kv heads x splits) reaches this many programs
MIN_SPLIT = 128  # ... but gives a program at least this many keys
_BLOCK_N = 64  # keys per iteration inside a program


# ----------------------------------------------------------------------------------------------------------------
# The references, in torch
# ----------------------------------------------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalized in float32, rounded to ``x``'s dtype, then times ``weight``."""
    y = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (cos/sin broadcast against ``x``)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def qk_rope_cache_ref(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                      slot: torch.Tensor, h: int, eps: float) -> torch.Tensor:
    b, kv, _, d = keys.shape
    q = qkv[:, : h * d].reshape(b, h, d)
    k = qkv[:, h * d : (h + kv) * d].reshape(b, kv, d)
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    c, s = cos.index_select(0, pos)[:, None], sin.index_select(0, pos)[:, None]
    q, k = rotate(q, c, s), rotate(k, c, s)
    keys.index_copy_(2, slot, k[:, :, None])
    values.index_copy_(2, slot, qkv[:, (h + kv) * d :].reshape(b, kv, 1, d))
    return q


def decode_attention_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         scaling: float) -> torch.Tensor:
    b, h, d = q.shape
    kv = keys.shape[1]
    q = q.reshape(b, kv, h // kv, d)  # a kv head's query heads as its query rows: one mask for all
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :], scale=scaling)
    return out.reshape(b, h, d)


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    half = gu.shape[-1] // 2
    return F.silu(gu[:, :half]) * gu[:, half:]


# ----------------------------------------------------------------------------------------------------------------
# The kernels
# ----------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        keep = offs < n
        x = tl.load(x_ptr + row * n + offs, mask=keep, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + offs, mask=keep, other=0.0)
        y = w.to(tl.float32) * y.to(w.dtype).to(tl.float32)
        tl.store(out_ptr + row * n + offs, y.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _qk_rope_cache_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                              H, KV, cap, eps, D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
        b = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, HALF)
        src = qkv_ptr + b * (H + 2 * KV) * D + head * D
        x1 = tl.load(src + offs)
        x2 = tl.load(src + HALF + offs)
        slot = tl.load(slot_ptr)
        if head >= H + KV:  # a value head: stored as it is
            dst = v_ptr + ((b * KV + head - H - KV) * cap + slot) * D
            tl.store(dst + offs, x1)
            tl.store(dst + HALF + offs, x2)
        else:
            dtype = x1.dtype
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            if NORM:
                r = tl.rsqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / D + eps)
                if head < H:
                    w1 = tl.load(qn_ptr + offs).to(tl.float32)
                    w2 = tl.load(qn_ptr + HALF + offs).to(tl.float32)
                else:
                    w1 = tl.load(kn_ptr + offs).to(tl.float32)
                    w2 = tl.load(kn_ptr + HALF + offs).to(tl.float32)
                f1 = (w1 * (f1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                f2 = (w2 * (f2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            row = tl.load(pos_ptr + b) * D
            c1 = tl.load(cos_ptr + row + offs).to(tl.float32)
            c2 = tl.load(cos_ptr + row + HALF + offs).to(tl.float32)
            s1 = tl.load(sin_ptr + row + offs).to(tl.float32)
            s2 = tl.load(sin_ptr + row + HALF + offs).to(tl.float32)
            y1 = f1 * c1 - f2 * s1
            y2 = f2 * c2 + f1 * s2
            if head < H:
                dst = q_ptr + (b * H + head) * D
            else:
                dst = k_ptr + ((b * KV + head - H) * cap + slot) * D
            tl.store(dst + offs, y1.to(dtype))
            tl.store(dst + HALF + offs, y2.to(dtype))

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, slot_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                                 KV, cap, scaling, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                                 SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, S: tl.constexpr,
                                 PRECISION: tl.constexpr):
        bk = tl.program_id(0)  # (row, kv head)
        split = tl.program_id(1)
        b = bk // KV
        rows = tl.arange(0, GP)
        dims = tl.arange(0, D)
        live = rows < G
        q = tl.load(q_ptr + (bk * G + rows[:, None]) * D + dims[None, :], mask=live[:, None], other=0.0)
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, tl.load(slot_ptr) + 1)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        base = bk * cap
        for j0 in range(start, end, BLOCK_N):  # every block holds at least one key: m_i is finite after the first
            j = j0 + tl.arange(0, BLOCK_N)
            inside = j < end
            k = tl.load(k_ptr + (base + j[:, None]) * D + dims[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
            s += tl.load(mask_ptr + b * cap + j, mask=inside, other=0.0).to(tl.float32)[None, :]
            s = tl.where(inside[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + (base + j[:, None]) * D + dims[None, :], mask=inside[:, None], other=0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if S == 1:
            out = acc / l_i[:, None]
            tl.store(out_ptr + (bk * G + rows[:, None]) * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=live[:, None])
        else:  # partials, combined by the next kernel; a split past the last key leaves m=-inf, l=0, acc=0
            part = (bk * S + split) * GP + rows
            tl.store(m_ptr + part, m_i)
            tl.store(l_ptr + part, l_i)
            tl.store(acc_ptr + part[:, None] * D + dims[None, :], acc)

    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        S: tl.constexpr, SP: tl.constexpr):
        bk = tl.program_id(0)
        g = tl.program_id(1)
        splits = tl.arange(0, SP)
        dims = tl.arange(0, D)
        part = (bk * S + splits) * GP + g
        m = tl.load(m_ptr + part, mask=splits < S, other=float("-inf"))
        l_s = tl.load(l_ptr + part, mask=splits < S, other=0.0)
        top = tl.max(m, 0)  # finite: the split holding the written slot has a key
        w = tl.exp(m - top)
        acc = tl.load(acc_ptr + part[:, None] * D + dims[None, :], mask=(splits < S)[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
        tl.store(out_ptr + (bk * G + g) * D + dims, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        g = tl.load(gu_ptr + b * 2 * n + offs, mask=keep, other=0.0)
        u = tl.load(gu_ptr + b * 2 * n + n + offs, mask=keep, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(out_ptr + b * n + offs, (a * u).to(g.dtype), mask=keep)


# ----------------------------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_triton: bool = False) -> torch.Tensor:
    """transformers' RMSNorm of each row of ``x`` (rows, n)."""
    if not use_triton:
        return rms_norm_ref(x, weight, eps)
    x = x.contiguous()  # the kernel steps rows by n
    rows, n = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(rows,)](x, weight, out, n, eps, BLOCK=triton.next_power_of_2(n))
    return out


def qk_rope_cache(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  slot: torch.Tensor, h: int, eps: float, use_triton: bool = False) -> torch.Tensor:
    """The queries (b, h, d), q-normed (where ``q_norm`` is given) and rotated at ``pos``; the keys, k-normed and
    rotated, and the values are written into the buffers at ``slot``. ``cos``/``sin``: (positions, d)."""
    if not use_triton:
        return qk_rope_cache_ref(qkv, keys, values, q_norm, k_norm, cos, sin, pos, slot, h, eps)
    b, kv, cap, d = keys.shape
    qkv = qkv.contiguous()
    q = torch.empty((b, h, d), dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    _qk_rope_cache_kernel[(b, h + 2 * kv)](
        qkv, q, keys, values, q_norm if norm else qkv, k_norm if norm else qkv, cos, sin, pos, slot, h, kv, cap,
        eps, D=d, HALF=d // 2, NORM=norm)
    return q


def supported(head_dim: int) -> bool:
    """Whether the kernels take heads of ``head_dim`` (a power of two from 16 to 256: their tiles)."""
    return HAS_TRITON and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def split_for(heads: int, capacity: int) -> int:
    """Keys per attention program for ``heads`` (rows x kv heads) over a buffer of ``capacity`` positions: the
    buffer split until there are ``PROGRAMS`` programs or a split would hold fewer than ``MIN_SPLIT`` keys, in
    multiples of the kernel's block. One split (no combine kernel) when the rows and heads fill the GPU."""
    splits = max(1, min(-(-PROGRAMS // heads), capacity // MIN_SPLIT))
    return -(-capacity // splits // _BLOCK_N) * _BLOCK_N


def splits_for(capacity: int, split: int) -> int:
    """How many programs share one row's keys, for a buffer of ``capacity`` positions, ``split`` keys each."""
    return -(-capacity // split)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     slot: torch.Tensor, scaling: float, use_triton: bool = False,
                     split: int | None = None) -> torch.Tensor:
    """Attention of each row's one query per head (b, h, d) over the buffers' positions up to ``slot``, under the
    additive ``mask`` (positions after ``slot`` must be masked too: the reference reads the whole buffer).
    ``split``: keys per program (default ``split_for``)."""
    if not use_triton:
        return decode_attention_ref(q, keys, values, mask, scaling)
    q = q.contiguous()
    b, h, d = q.shape
    kv, cap = keys.shape[1], keys.shape[2]
    g = h // kv
    gp = max(16, triton.next_power_of_2(g))  # tl.dot's smallest tile
    split = split or split_for(b * kv, cap)
    s = splits_for(cap, split)
    out = torch.empty_like(q)
    if s == 1:
        m = l_s = acc = out
    else:
        m = torch.empty((b * kv * s * gp,), dtype=torch.float32, device=q.device)
        l_s = torch.empty_like(m)
        acc = torch.empty((b * kv * s * gp, d), dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(b * kv, s)](q, keys, values, mask, slot, out, m, l_s, acc, kv, cap, scaling,
                                          G=g, GP=gp, D=d, SPLIT=split, BLOCK_N=_BLOCK_N, S=s,
                                          PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if s > 1:
        _combine_kernel[(b * kv, g)](m, l_s, acc, out, G=g, GP=gp, D=d, S=s, SP=triton.next_power_of_2(s))
    return out


def silu_mul(gu: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of the concatenated ``gu`` (rows, 2n), as transformers' MLP rounds it."""
    if not use_triton:
        return silu_mul_ref(gu)
    gu = gu.contiguous()
    rows, n2 = gu.shape
    n = n2 // 2
    out = torch.empty((rows, n), dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gu, out, n, BLOCK=block)
    return out
