"""GGML's K-quant blocks (Q4_K, Q5_K, Q6_K) in numpy: the bytes llama.cpp's reference quantizers write.

Why: the ``gguf`` package reads K-quants but cannot write them, and Q4_K_M is the type llama.cpp and Ollama users
ask for first. These encoders make the exporter write them without a llama.cpp build.

Contract: ``quantize_q4_k``, ``quantize_q5_k`` and ``quantize_q6_k`` take float32 values whose last axis is a
multiple of 256 (any leading axes: rows, experts) and return uint8 of shape ``(..., n / 256 * block bytes)``, the
same bytes as ggml's ``quantize_row_q4_K_ref`` / ``_q5_K_ref`` / ``_q6_K_ref`` for finite input (what
``llama-quantize`` writes without an importance matrix). ggml is the reference as compiled without fused
multiply-add contraction (x86-64's baseline, the usual CPU build); a build that contracts may round some sums
differently.

The super-block of 256 values (``QK_K``) and what it stores:
- Q4_K, 144 bytes: fp16 ``d`` and ``dmin``; 12 bytes of eight 6-bit scales and eight 6-bit mins, one pair per
  32 values; 128 bytes of 4-bit values, sub-blocks 2k and 2k+1 in the low and high nibbles of the same 32 bytes.
  A value is ``d * scale * q - dmin * min``.
- Q5_K, 176 bytes: as Q4_K, with 32 bytes of fifth bits between the scales and the nibbles (bit k of byte i is
  the fifth bit of value i of sub-block k).
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, sixteen int8 scales (one per 16
  values) and fp16 ``d``. A value is ``d * scale * (q - 32)``.

How the bytes stay the same: every operation is float32 in the order of ggml's C loops. Sums are accumulated one
term after another (never numpy's pairwise sum); ``nearest_int`` is ggml's add-1.5*2^23 trick on float32 bits;
fp16 is IEEE round-to-nearest-even like ggml's converter; the searches (``make_qkx2_quants`` over 32-value
sub-blocks for Q4_K and Q5_K, ``make_qx_quants`` over 16-value ones for Q6_K) take the same candidates in the same
order and keep a later one only on the same strict comparison. Only the loop over blocks is vectorised: a batch
of super-blocks goes through each step at once, value index first so that a sum over a sub-block is a run of
contiguous row additions.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

QK_K = 256
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
_BATCH = 256  # super-blocks per vectorised pass: enough to amortise numpy's calls, few enough to stay in cache
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23
_GROUP_MAX_EPS = np.float32(1e-15)
_ROUND_SAFE = np.float32(4194303)  # within this magnitude nearest_int(f) == rint(f)
_F32 = np.float32


def _nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: float32 ``f + 1.5*2^23``, its low mantissa bits read back as an int (ties to even)."""
    bits = (f + _MAGIC).view(np.int32)
    bits &= 0x007FFFFF
    bits -= 0x00400000
    return bits


def _clipped(f: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``MAX(lo, MIN(hi, nearest_int(f)))`` as float32, for any ``f`` (NaN, infinities and huge values included)."""
    return np.clip(_nearest_int(f), lo, hi).astype(_F32)


def _levels(iscale: np.ndarray, values: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``MAX(lo, MIN(hi, nearest_int(iscale * values)))`` per column, as float32. When every product is within
    ``_ROUND_SAFE`` (the usual case), ``nearest_int`` is exactly ``rint``; otherwise the bit trick runs."""
    f = iscale * values
    if not (f.min() >= -_ROUND_SAFE and f.max() <= _ROUND_SAFE):
        return _clipped(f, lo, hi)
    np.rint(f, out=f)
    return np.clip(f, lo, hi, out=f)


def _sum(terms: np.ndarray) -> np.ndarray:
    """``float s = 0; for (i...) s += terms[i];`` over axis 0, in that order."""
    acc = _F32(0) + terms[0]
    for row in terms[1:]:
        acc += row
    return acc


def _fp16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bits, the float32 they read back as): ggml's ``GGML_FP32_TO_FP16`` and back."""
    half = values.astype(np.float16)
    return half.view(np.uint16), half.astype(_F32)


def _first_max(values: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key, value) at the first largest ``key`` over axis 0, starting from 0 and replacing on ``>`` as ggml does."""
    best_key = np.zeros(key.shape[1:], _F32)
    best = np.zeros(values.shape[1:], _F32)
    for k, v in zip(key, values):
        better = k > best_key
        best_key = np.where(better, k, best_key)
        best = np.where(better, v, best)
    return best_key, best


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                      nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``make_qkx2_quants`` (use_mad false) for each column of ``x`` (values along axis 0), weights ``w``.

    Fits ``x ~ scale * L - min`` with L in [0, nmax]: a first guess from the range, then ``nstep + 1`` trial
    inverse scales over ``max - min``, each refined by weighted least squares and kept when its weighted squared
    error is lower; a kept trial's min is the one later trials start from, as in ggml. The kept trial's levels are
    recomputed at the end from its inverse scale and starting min (the same rounding of the same products).
    Returns (scale, min as subtracted, L as float32)."""
    lo = x[0].copy()
    hi = x[0].copy()
    for row in x[1:]:
        lo = np.where(row < lo, row, lo)
        hi = np.where(row > hi, row, hi)
    sum_w = w[0].copy()
    sum_x = sum_w * x[0]
    for wi, xi in zip(w[1:], x[1:]):
        sum_w += wi
        sum_x += wi * xi
    lo = np.where(lo > 0, _F32(0), lo)
    flat = hi == lo  # ggml returns early for these: their inverse scales are set to 0 here, and the results below
    kept_iscale = np.where(flat, _F32(0), _F32(nmax) / (hi - lo))
    kept_lo = lo
    scale = _F32(1) / kept_iscale
    diff = _levels(kept_iscale, x - lo, 0, nmax)
    diff *= scale
    diff += lo
    diff -= x
    diff *= diff
    diff *= w
    best = _sum(diff)
    for step in range(nstep + 1):
        trial = _F32(_F32(_F32(rmin) + _F32(rdelta) * _F32(step)) + _F32(nmax)) / (hi - lo)
        trial[flat] = 0
        cand = _levels(trial, x - lo, 0, nmax)
        wl = w * cand
        sum_l = _sum(wl)
        sum_xl = _sum(np.multiply(wl, x, out=diff))
        sum_l2 = _sum(np.multiply(wl, cand, out=wl))
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clamp = this_min > 0
        this_min = np.where(clamp, _F32(0), this_min)
        this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
        np.multiply(cand, this_scale, out=diff)
        diff += this_min
        diff -= x
        diff *= diff
        diff *= w
        err = _sum(diff)
        take = (det > 0) & (err < best)
        kept_iscale = np.where(take, trial, kept_iscale)
        kept_lo = np.where(take, lo, kept_lo)
        best = np.where(take, err, best)
        scale = np.where(take, this_scale, scale)
        lo = np.where(take, this_min, lo)
    levels = _levels(kept_iscale, x - kept_lo, 0, nmax)
    levels[:, flat] = 0
    scale = np.where(flat, _F32(0), scale)
    return scale, -lo, levels


def _make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qx_quants`` with ``rmse_type`` 1 and no importance weights (weights ``x * x``) per column.

    Fits ``x ~ scale * (L - nmax)`` with L in [0, 2 nmax): the inverse scale ``-nmax / max`` (max: the value of
    largest magnitude) and 18 trials around it, each refined by weighted least squares, the one with the largest
    ``sumlx^2 / suml2`` kept (its levels recomputed at the end). Returns (scale, L as float32; all zero for a
    column below ggml's epsilon)."""
    amax, signed_max = _first_max(x, np.abs(x))
    zero = amax < _GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        iscale[zero] = 0  # ggml returns early for these: the results below
        cand = _levels(iscale, x, -nmax, nmax - 1)
        sumlx = _sum(wx * cand)
        cand *= w * cand
        return sumlx, _sum(cand)

    kept = _F32(-nmax) / signed_max
    sumlx, suml2 = trial(kept)
    scale = np.where(suml2 != 0, sumlx / suml2, _F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(_F32(nmax) + _F32(0.1) * _F32(step)) / signed_max
        sumlx, suml2 = trial(iscale)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        kept = np.where(take, iscale, kept)
        scale = np.where(take, sumlx / suml2, scale)
        best = np.where(take, scale * sumlx, best)
    levels = _levels(kept, x, -nmax, nmax - 1)
    levels += _F32(nmax)
    levels[:, zero] = 0
    scale = np.where(zero, _F32(0), scale)
    return scale, levels


def _scale_min_blocks(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """The part Q4_K and Q5_K share, for a batch of super-blocks ``x`` (B, 256): (header bytes (B, 16): d, dmin
    and the 12 packed scale bytes; levels (B, 256) in [0, nmax])."""
    n_blocks = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n_blocks * 8, 32).T)  # value index first
    av_x = np.sqrt(_sum(sub * sub) / _F32(32))
    weights = av_x + np.abs(sub)
    scales, mins, levels = _make_qkx2_quants(sub, weights, nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(n_blocks, 8), mins.reshape(n_blocks, 8)
    levels = levels.T.reshape(n_blocks, 8, 32)
    max_scale = np.where(scales > 0, scales, _F32(0)).max(axis=1)
    max_min = np.where(mins > 0, mins, _F32(0)).max(axis=1)
    inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
    inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d_bits, d = _fp16(max_scale / _F32(63))
    dmin_bits, dmin = _fp16(max_min / _F32(63))
    header = np.empty((n_blocks, 16), np.uint8)
    header[:, 0:2] = d_bits.view(np.uint8).reshape(n_blocks, 2)
    header[:, 2:4] = dmin_bits.view(np.uint8).reshape(n_blocks, 2)
    header[:, 4:8] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    header[:, 8:12] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    header[:, 12:16] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    step = d[:, None] * ls.astype(_F32)
    offset = dmin[:, None] * lm.astype(_F32)
    with_step = step != 0  # a sub-block whose step rounds to zero keeps the search's levels
    requant = _clipped((x.reshape(n_blocks, 8, 32) + offset[..., None]) / step[..., None], 0, nmax)
    levels = np.where(with_step[..., None], requant, levels)
    return header, levels.astype(np.uint8).reshape(n_blocks, QK_K)


def _q4_k_batch(x: np.ndarray) -> np.ndarray:
    header, levels = _scale_min_blocks(x, 15, -1.0, 20)
    pairs = levels.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([header, qs], axis=1)


def _q5_k_batch(x: np.ndarray) -> np.ndarray:
    header, levels = _scale_min_blocks(x, 31, -0.5, 15)
    subs = levels.reshape(-1, 8, 32)
    qh = np.zeros((subs.shape[0], 32), np.uint8)
    for k in range(8):
        qh |= (subs[:, k] >> 4) << k
    low = (subs & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([header, qh, qs], axis=1)


def _q6_k_batch(x: np.ndarray) -> np.ndarray:
    n_blocks = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n_blocks * 16, 16).T)
    scales, levels = _make_qx_quants(sub, 32)
    scales = scales.reshape(n_blocks, 16)
    levels = levels.T.reshape(n_blocks, 16, 16)
    max_abs, max_scale = _first_max(scales.T, np.abs(scales.T))
    zero = max_abs < _GROUP_MAX_EPS
    iscale = _F32(-128) / max_scale
    d_bits, d = _fp16(_F32(1) / iscale)
    q_scales = (np.minimum(_nearest_int(iscale[:, None] * scales), 127) & 0xFF).astype(np.uint8)
    step = d[:, None] * q_scales.view(np.int8).astype(_F32)
    requant = _clipped(x.reshape(n_blocks, 16, 16) / step[..., None], -32, 31) + _F32(32)
    levels = np.where((step != 0)[..., None], requant, levels).astype(np.uint8).reshape(n_blocks, 2, 4, 32)
    ql = np.stack([levels[:, :, 0] & 0xF | (levels[:, :, 2] & 0xF) << 4,
                   levels[:, :, 1] & 0xF | (levels[:, :, 3] & 0xF) << 4], axis=2).reshape(n_blocks, 128)
    qh = (levels[:, :, 0] >> 4 | (levels[:, :, 1] >> 4) << 2 | (levels[:, :, 2] >> 4) << 4
          | (levels[:, :, 3] >> 4) << 6).reshape(n_blocks, 64)
    out = np.concatenate([ql, qh, q_scales, d_bits.view(np.uint8).reshape(n_blocks, 2)], axis=1)
    out[zero] = 0
    return out


def _encode(data: np.ndarray, kind: str, batch: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    values = np.asarray(data, dtype=_F32)
    if values.ndim == 0 or values.shape[-1] % QK_K:
        raise ValueError(f"{kind}: the last axis ({values.shape[-1:] or 'scalar'}) is not a multiple of {QK_K}")
    if not np.isfinite(values).all():  # llama-quantize refuses such tensors too
        raise ValueError(f"{kind}: the values are not all finite")
    blocks = values.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], BLOCK_BYTES[kind]), np.uint8)
    with np.errstate(all="ignore"):  # all-zero and constant blocks divide by zero, then are overwritten as ggml does
        for start in range(0, blocks.shape[0], _BATCH):
            out[start:start + _BATCH] = batch(blocks[start:start + _BATCH])
    return out.reshape(*values.shape[:-1], values.shape[-1] // QK_K * BLOCK_BYTES[kind])


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K blocks of ``data`` (float32, last axis a multiple of 256), as ggml's ``quantize_row_q4_K_ref``."""
    return _encode(data, "q4_k", _q4_k_batch)


def quantize_q5_k(data: np.ndarray) -> np.ndarray:
    """Q5_K blocks of ``data`` (float32, last axis a multiple of 256), as ggml's ``quantize_row_q5_K_ref``."""
    return _encode(data, "q5_k", _q5_k_batch)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``data`` (float32, last axis a multiple of 256), as ggml's ``quantize_row_q6_K_ref``."""
    return _encode(data, "q6_k", _q6_k_batch)


ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
