"""Sampling the next token on the device, without a host read: temperature, top-k, top-p and min-p, then one draw.

Why: the fast decoders replay a step without the host (a CUDA graph, or a step whose only host read is the token
itself). ``torch.multinomial`` checks its input on the host (a sync), so a draw here is the exponential race
instead: with ``noise`` i.i.d. Exp(1), ``argmax(p / noise)`` is distributed as ``p``. The noise comes in as a tensor,
filled by the caller (``noise.exponential_(generator=...)``) before each step, so a captured step stays
deterministic and replays from static buffers, and a seeded generator repeats its draws.

Contract (the filters are transformers' logits processors', in ``generate``'s order: temperature, top-k, top-p,
min-p): ``logits`` (b, V) in any float dtype; the parameters are tensors (so a new value needs no new capture):
``temperature`` (1,) float > 0, ``top_k`` (1,) long (``V`` or more: off), ``top_p`` (1,) float (1.0: off),
``min_p`` (1,) float (0.0: off). ``sort=False`` skips top-k and top-p (their sort of the vocabulary) and must only
be passed when both are off. A token a filter removes is never drawn; ties at the k-th value are kept (as
``TopKLogitsWarper``); among tokens tied at top-p's boundary, which stay depends on the sort's order of ties, as
in ``TopPLogitsWarper``; each filter keeps at least one token.
"""

from __future__ import annotations

import torch

_TINY = torch.finfo(torch.float32).tiny


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, sort: bool = True) -> torch.Tensor:
    """The float32 scores after temperature, top-k, top-p and min-p: removed tokens at ``-inf``."""
    scores = logits.float() / temperature
    if sort:
        ranked, order = scores.sort(dim=-1)  # ascending, as TopPLogitsWarper sorts

        vocab = scores.shape[-1]
        kth = ranked.gather(-1, (vocab - top_k.clamp(1, vocab)).expand(scores.shape[0], 1))
        ranked = ranked.masked_fill(ranked < kth, float("-inf"))
        # top-p: the cumulative probability from the least likely token up; a token goes when the mass at and
        # below it is at most 1 - top_p; the most likely token always stays
        gone = ranked.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        gone[..., -1] = False
        ranked = ranked.masked_fill(gone, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ranked)
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def sample(logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, sort: bool = True) -> torch.Tensor:
    """One token a row (b,), drawn from the filtered softmax by the exponential race over ``noise`` (b, V)."""
    probs = filter_logits(logits, temperature, top_k, top_p, min_p, sort).softmax(dim=-1)
    return (probs / noise.clamp_min(_TINY)).argmax(dim=-1)
