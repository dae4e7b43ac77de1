"""Causal attention over the documents of one packed row: six kernels with one signature.

Each kernel takes q, k, v as (T, H, D) views of the flattened row (k/v may have fewer heads: grouped-query), the
forward's ``PackedRun`` (boundaries, chosen once per forward) and the layer's ``AttnCall``, and returns (T, Hq, D).
Kernels: ``flash_attn`` (flash-attn's varlen kernel), ``varlen`` (``torch.nn.attention.varlen.varlen_attn``; gpt-oss's
sinks through ``sink_attention`` on the same flash ops), ``flex`` (flex attention, one block mask per forward and
window), ``sdpa_loop`` (one exact ``doc_attention`` call per document over host offsets; never a T x T mask),
``sdpa_masked`` (one ``doc_attention`` call for the whole row with a T x T block-diagonal mask built once per forward
and window: fewer launches than the loop for rows of many short documents, O(T^2) memory), ``sdpa`` (auto's exact
path: ``sdpa_masked`` while the row's T x T mask and scores stay small (``dense_fits``), else ``sdpa_loop``).
Pure torch: nothing here imports transformers.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from .reference_attention import AttnCall, doc_attention
from .sink_attention import sink_attention

KERNELS = ("flash_attn", "varlen", "flex", "sdpa", "sdpa_loop", "sdpa_masked")
DENSE_MASK_MAX_TOKENS = 8192  # the (T, T) boolean mask: 64 MiB at most
DENSE_SCORES_MAX_BYTES = 1 << 30  # the exact path's fp32 scores, probabilities and their gradients, one layer


@dataclass
class PackedRun:
    """Everything the layers of one forward share. Built once per forward by the decoder pre-hook."""

    kernel: Callable[..., torch.Tensor]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    host_offsets: tuple[int, ...] | None
    training: bool
    flex_fn: Callable | None = None
    tokens: int | None = None  # the row's length where host_offsets is None (a graph's bucket): masks need no sync
    _flex_masks: dict = field(default_factory=dict)
    _dense_masks: dict = field(default_factory=dict)

    def _doc_ids(self, device: torch.device) -> torch.Tensor:
        """Each token's document index (host-known total, so no sync)."""
        total = self.host_offsets[-1] if self.host_offsets else self.tokens
        lengths = self.cu_q.diff()
        return torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths.to(device),
                                       output_size=total)

    def dense_mask(self, window: int | None, device: torch.device) -> torch.Tensor:
        """The (T, T) boolean mask of this forward's documents (causal, window applied), built once per window."""
        if window not in self._dense_masks:
            doc = self._doc_ids(device)
            i = torch.arange(doc.numel(), device=device)
            ok = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
            if window is not None:
                ok &= i[None, :] > i[:, None] - window
            self._dense_masks[window] = ok
        return self._dense_masks[window]

    def flex_block_mask(self, window: int | None, device: torch.device):
        """The flex block mask for this forward's documents, built once per (window) and reused by every layer."""
        key = window
        if key not in self._flex_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            doc = self._doc_ids(device)

            def mask_mod(b, h, qi, ki):
                ok = (doc[qi] == doc[ki]) & (ki <= qi)
                if window is not None:
                    ok = ok & (qi - ki < window)
                return ok

            self._flex_masks[key] = create_block_mask(mask_mod, None, None, doc.numel(), doc.numel(), device=device)
        return self._flex_masks[key]


def _flash_attn_kernel(q, k, v, run: PackedRun, call: AttnCall) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    kwargs = {"softmax_scale": call.scaling, "causal": True, "dropout_p": call.dropout}
    if call.window is not None:
        kwargs["window_size"] = (call.window - 1, 0)
    if call.softcap:
        kwargs["softcap"] = call.softcap
    return flash_attn_varlen_func(q, k, v, run.cu_q, run.cu_k, run.max_q, run.max_k, **kwargs)


_VARLEN_HAS_GQA: bool | None = None


@functools.cache
def _varlen_takes_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _varlen_kernel(q, k, v, run: PackedRun, call: AttnCall) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    if call.sinks is not None:  # gpt-oss: the same flash kernel, rows rescaled by the sink (ops.sink_attention)
        return sink_attention(q, k, v, call.sinks, run.cu_q, run.max_q, call.scaling, call.window)
    window = (call.window - 1, 0) if call.window is not None else (-1, 0)
    kwargs = {"scale": call.scaling, "window_size": window}
    if q.shape[1] != k.shape[1] and _varlen_takes_gqa():
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, run.cu_q, run.cu_k, run.max_q, run.max_k, **kwargs)


def _expand_kv(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v repeated to q's heads (grouped-query attention): ``doc_attention`` takes one head count."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return k, v


def _sdpa_loop_kernel(q, k, v, run: PackedRun, call: AttnCall) -> torch.Tensor:
    k, v = _expand_kv(q, k, v)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, T, D)
    out = torch.empty_like(qh)
    offsets = run.host_offsets
    for a, b in zip(offsets[:-1], offsets[1:]):
        if b > a:
            out[:, a:b] = doc_attention(qh[:, a:b], kh[:, a:b], vh[:, a:b], call, run.training)
    return out.transpose(0, 1)


def _sdpa_masked_kernel(q, k, v, run: PackedRun, call: AttnCall) -> torch.Tensor:
    k, v = _expand_kv(q, k, v)
    allowed = run.dense_mask(call.window, q.device)
    out = doc_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), call, run.training, allowed)
    return out.transpose(0, 1)


def dense_fits(tokens: int, heads: int, call: AttnCall) -> bool:
    """Whether one masked call over the whole row is cheap in memory: SDPA reads a (T, T) boolean mask; the exact
    path (soft-capping, sinks) also holds ~4 fp32 (H, T, T) tensors of one layer for its backward."""
    if tokens > DENSE_MASK_MAX_TOKENS:
        return False
    return (call.softcap is None and call.sinks is None) or 16 * heads * tokens * tokens <= DENSE_SCORES_MAX_BYTES


def _sdpa_kernel(q, k, v, run: PackedRun, call: AttnCall) -> torch.Tensor:
    # rows of many short documents: one masked call per layer instead of a few launches per document
    offsets = run.host_offsets
    if offsets is None or (len(offsets) > 3 and dense_fits(q.shape[0], q.shape[1], call)):
        return _sdpa_masked_kernel(q, k, v, run, call)
    return _sdpa_loop_kernel(q, k, v, run, call)


def _flex_kernel(q, k, v, run: PackedRun, call: AttnCall) -> torch.Tensor:

    block_mask = run.flex_block_mask(call.window, q.device)
    score_mod = None
    if call.softcap is not None:
        cap = call.softcap

        def score_mod(score, b, h, qi, ki):
            return torch.tanh(score / cap) * cap

    out = run.flex_fn(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block_mask,
        score_mod=score_mod,
        scale=call.scaling,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


KERNEL_FNS = {
    "flash_attn": _flash_attn_kernel,
    "varlen": _varlen_kernel,
    "flex": _flex_kernel,
    "sdpa": _sdpa_kernel,
    "sdpa_loop": _sdpa_loop_kernel,
    "sdpa_masked": _sdpa_masked_kernel,
}


def flash_attn_available() -> bool:
    try:
        importlib.import_module("flash_attn")  # a real import: an install built for another torch fails here
    except Exception:
        return False
    return True


def varlen_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("torch.nn.attention.varlen")
    except Exception:
        return False
    return torch.cuda.get_device_capability() >= (8, 0)  # the flash kernel behind it needs sm80+

