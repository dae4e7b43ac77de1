"""Exact causal attention of one document, in fp32 where it matters: the reference every fast kernel is checked
against, and the path for what the fused kernels lack (soft-capping, attention sinks, dropout, CPUs, T4s).

Pure torch. ``doc_attention`` takes (H, n, D) q/k/v with k/v already expanded to q's heads and returns (H, n, D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnCall:
    """What one layer's attention needs besides q, k, v."""

    scaling: float
    window: int | None  # transformers' sliding_window: a query sees the last `window` keys, itself included
    softcap: float | None
    sinks: torch.Tensor | None
    dropout: float


def doc_attention(q, k, v, call: AttnCall, training: bool, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Exact causal attention of one document; q/k/v are (H, n, D) with k/v already expanded to q's heads.

    ``allowed``: an (n, n) boolean mask of the keys each query may see, for several documents of a packed row in one
    call (block-diagonal, causal, the sliding window applied); None: causal within one document, window applied here.
    """
    n = q.shape[1]
    plain = call.softcap is None and call.sinks is None
    dropout = call.dropout if training else 0.0
    # SDPA's fused kernels (flash, memory-efficient; CUDA and CPU) take 4-D inputs only: a 3-D call runs the math
    # kernel, which materializes the (n, n) scores. Hence the batch dimension of one.
    if plain and allowed is not None:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed, scale=call.scaling,
                                              dropout_p=dropout)[0]
    if plain and (call.window is None or call.window >= n):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=call.scaling,
                                              dropout_p=dropout)[0]
    q, k = q.float(), k.float()  # this path exists for exactness: scores and softmax in fp32
    scores = torch.matmul(q, k.transpose(-1, -2)) * call.scaling
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    if allowed is None:
        i = torch.arange(n, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if call.window is not None:
            allowed &= i[None, :] > i[:, None] - call.window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if call.sinks is not None:
        sink = call.sinks.float().reshape(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if training and call.dropout > 0:
        probs = F.dropout(probs, p=call.dropout)
    return torch.matmul(probs, v.float()).to(v.dtype)
