"""The dense decoder's step and prompt pass: the arithmetic a captured dense step replays.

Contract: ``decode_step`` makes one token a row (greedy: the argmax; sampling: a draw through ``Draws``) with
in-place writes to a ``_State``'s tensors only, no host read, so it can be captured as it is; ``prefill`` runs the
left-padded prompts at once, writing the key/value buffers and giving the first token. Positions and masks are
``generate``'s (a padded query sees itself only; no one sees a padded key).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import decode_kernels as kernels
from .dense_weights import DenseWeights, _Layer
from .sampler import Draws

_STOPS = 8  # room for this many stop ids in a captured step


class _State:
    """The static tensors one captured step reads and writes, for a batch of ``batch`` rows and ``capacity``
    positions: token ids, rotary positions, the slot being written, the mask, key/value buffers, the tokens made."""

    def __init__(self, weights: DenseWeights, batch: int, capacity: int, device: torch.device) -> None:
        dtype, kv, d = weights.dtype, weights.kv_heads, weights.head_dim
        self.batch, self.capacity = batch, capacity
        self.split = kernels.split_for(batch * weights.kv_heads, capacity)  # keys per attention program
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.stops = torch.full((_STOPS,), -1, dtype=torch.long, device=device)
        self.pad = torch.zeros((), dtype=torch.long, device=device)
        self.mask = torch.zeros((batch, capacity), dtype=dtype, device=device)
        self.tokens = torch.zeros((batch, capacity), dtype=torch.long, device=device)
        self.logits = torch.zeros((batch, weights.lm_head.shape[0]), dtype=dtype, device=device)  # the last step's
        shape = (batch, kv, capacity, d)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in weights.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in weights.layers]
        positions = torch.arange(capacity, device=device)[None]
        probe = torch.zeros((1, 1, d), dtype=dtype, device=device)
        with torch.no_grad():
            cos, sin = weights.rotary(probe, positions)
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)  # (capacity, head_dim)
        self.draws: Draws | None = None  # sampling's static inputs, made by the first sampling call

    def sampling_draws(self) -> Draws:
        """The state's ``Draws`` (made once: a captured sampling step reads them where they are)."""
        if self.draws is None:
            self.draws = Draws(self.batch, self.logits.shape[-1], self.ids.device)
        return self.draws


def _next(logits: torch.Tensor, draws: Draws | None, sort: bool) -> torch.Tensor:
    """Greedy: the argmax of the logits; sampling: a draw from ``draws``' noise (refilled by the caller)."""
    return logits.argmax(dim=-1) if draws is None else draws.choose(logits, sort)


def decode_step(w: DenseWeights, s: _State, use_triton: bool = False, draws: Draws | None = None,
                sort: bool = False) -> None:
    """One step for every row: attend at ``s.slot``, write the next token, advance. Only in-place writes to
    ``s``'s tensors; no host sync and no value read on the host, so it can be captured and replayed as it is.
    ``use_triton``: the step's small ops as ``nbkit.ops.decode_kernels``' Triton kernels (else their torch
    references). ``draws``: sample (``sort``: with top-k/top-p) instead of the argmax."""
    x = F.embedding(s.ids, w.embed)  # (b, hidden)
    s.mask.index_fill_(1, s.slot, 0.0)
    for layer, keys, values in zip(w.layers, s.keys, s.values):
        x = layer_step(x, layer, keys, values, s, w, use_triton)
    logits = F.linear(kernels.rms_norm(x, w.final_norm, w.eps, use_triton), w.lm_head)
    s.logits.copy_(logits)
    nxt = torch.where(s.unfinished, _next(logits, draws, sort), s.pad)
    s.tokens.index_copy_(1, s.slot, nxt[:, None])
    s.unfinished &= ~(nxt[:, None] == s.stops[None, :]).any(dim=-1)
    s.ids.copy_(nxt)
    s.slot += 1
    s.pos += 1


def layer_step(x: torch.Tensor, layer: _Layer, keys: torch.Tensor, values: torch.Tensor, s: _State,
               w: DenseWeights, use_triton: bool = False) -> torch.Tensor:
    """One decoder layer on one token a row: ``x`` (b, hidden) in, the next residual stream out; writes the row's
    key and value at ``s.slot``."""
    b = x.shape[0]
    n = kernels.rms_norm(x, layer.ln1, w.eps, use_triton)
    qkv = F.linear(n, layer.wqkv, layer.bqkv)
    q = kernels.qk_rope_cache(qkv, keys, values, layer.q_norm, layer.k_norm, s.cos, s.sin, s.pos, s.slot, w.heads,
                              w.eps, use_triton)
    a = kernels.decode_attention(q, keys, values, s.mask, s.slot, w.scaling, use_triton, s.split)
    x = x.addmm_(a.reshape(b, -1), layer.wo.t())  # in place: the residual stream is this step's own tensor
    if layer.bo is not None:
        x = x + layer.bo
    n = kernels.rms_norm(x, layer.ln2, w.eps, use_triton)
    x = x.addmm_(kernels.silu_mul(F.linear(n, layer.wgu, layer.bgu), use_triton), layer.wd.t())
    if layer.bd is not None:
        x = x + layer.bd
    return x


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_triton: bool) -> torch.Tensor:
    return kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, use_triton).reshape(x.shape)


def prefill(w: DenseWeights, s: _State, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            use_triton: bool = False, draws: Draws | None = None, sort: bool = False) -> torch.Tensor:
    """Run the left-padded prompts (B, P) through the dense copy at once: their keys and values are written to
    slots 0..P-1, the last position's logits to ``s.logits``; returns the first token of each row (greedy, or
    drawn through ``draws``). Positions
    and masking as ``generate``'s (a padded query sees itself only; no one sees a padded key)."""
    b, p = input_ids.shape
    h, kv, d = w.heads, w.kv_heads, w.head_dim
    keep = attention_mask.bool()
    pos = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    cos, sin = s.cos[pos][:, :, None], s.sin[pos][:, :, None]  # (b, p, 1, d)
    causal = torch.ones((p, p), dtype=torch.bool, device=input_ids.device).tril()
    diagonal = torch.eye(p, dtype=torch.bool, device=input_ids.device)
    seen = ((causal[None] & keep[:, None, :]) | diagonal[None])[:, None]  # (b, 1, p, p)
    x = F.embedding(input_ids, w.embed)
    for layer, keys, values in zip(w.layers, s.keys, s.values):
        qkv = F.linear(_norm(x, layer.ln1, w.eps, use_triton), layer.wqkv, layer.bqkv)
        q = qkv[..., : h * d].reshape(b, p, h, d)
        k = qkv[..., h * d : (h + kv) * d].reshape(b, p, kv, d)
        if layer.q_norm is not None:
            q, k = _norm(q, layer.q_norm, w.eps, use_triton), _norm(k, layer.k_norm, w.eps, use_triton)
        q = kernels.rotate(q, cos, sin).transpose(1, 2)
        k = kernels.rotate(k, cos, sin).transpose(1, 2)
        v = qkv[..., (h + kv) * d :].reshape(b, p, kv, d).transpose(1, 2)
        keys[:, :, :p].copy_(k)
        values[:, :, :p].copy_(v)
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1),
                                           attn_mask=seen, scale=w.scaling)
        x = x + F.linear(a.transpose(1, 2).reshape(b, p, h * d), layer.wo, layer.bo)
        gu = F.linear(_norm(x, layer.ln2, w.eps, use_triton), layer.wgu, layer.bgu).reshape(b * p, -1)
        x = x + F.linear(kernels.silu_mul(gu, use_triton).reshape(b, p, -1), layer.wd, layer.bd)
    logits = F.linear(kernels.rms_norm(x[:, -1], w.final_norm, w.eps, use_triton), w.lm_head)
    s.logits.copy_(logits)
    return _next(logits, draws, sort)


