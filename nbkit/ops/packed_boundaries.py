"""Document boundaries of a packed row, built on the host: ``cu_seqlens`` (int32), max length, position ids.

Pure torch: the collator calls ``metadata_from_lengths`` / TRL's collator output once per batch, so no layer, kernel
or hook ever rebuilds them and no GPU-to-CPU sync happens in the forward. ``metadata_from_position_ids`` is the
fallback for a forward that arrives without them (one sync when the ids live on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch


def metadata_from_lengths(lengths: list[int] | tuple[int, ...]) -> dict[str, Any]:
    """Boundaries of documents of the given lengths laid end to end in one row (host tensors + ints)."""
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) <= 0:
        raise ValueError(f"document lengths must be positive, got {lengths[:8]}")
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return {
        "position_ids": position_ids,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "nbkit_cu_seqlens_host": tuple(offsets),
    }


def metadata_from_position_ids(position_ids: torch.Tensor) -> dict[str, Any]:
    """Boundaries from a (1, T) or (B, S) position-id tensor: a document starts wherever the position is 0.

    Runs on the tensor's device and reads the result back once (one sync when it is on a GPU). Used only when a
    forward arrives without collated metadata.
    """
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    bounds = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    host = tuple(int(x) for x in bounds.cpu().tolist())
    lengths = [b - a for a, b in zip(host[:-1], host[1:])]
    return {
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "nbkit_cu_seqlens_host": host,
    }
