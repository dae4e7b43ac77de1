"""Fuzz of nbkit's PackedCollator over TRL's packing (hypothesis): the boundary metadata is always consistent.

Documents of random lengths are packed by TRL's own ``pack_dataset`` (``bfd``, ``bfd_split``, ``wrapped``) or, as
FastSFT does without packing, truncated and sent one per row; batches of random size (and, sometimes,
``pad_to_multiple_of``) go through ``PackedCollator(DataCollatorForLanguageModeling(padding_free=True))``. Every token
encodes (document, position), so the checks can tell where each token came from:

- offsets start at 0, strictly increase, end at the token count; the host copy equals the tensor; lengths sum to the
  tokens; ``max_length_q/k`` is the longest document; position ids restart at 0 at each offset and count up;
- no document crosses a packed-row boundary (every row edge is an offset), and none is longer than ``max_length``;
- each document is one contiguous piece of one source document, and over the whole dataset the pieces are exactly
  what the strategy promises: cut to ``max_length`` (bfd, no packing) or split into pieces that cover it once
  (bfd_split); labels equal the inputs except -100 at each document start.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbkit.speedups.packed_attention import PackedCollator

STRIDE = 1000  # token = document * STRIDE + position + 1 (0 stays the pad id)


@pytest.fixture(autouse=True, scope="module")
def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


def _rows(lengths: list[int], strategy: str, max_length: int) -> list[dict]:
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    docs = [[d * STRIDE + p + 1 for p in range(n)] for d, n in enumerate(lengths)]
    if strategy == "none":  # FastSFT without packing: TRL truncated each row; one document per row
        return [{"input_ids": ids[:max_length], "labels": ids[:max_length]} for ids in docs]
    dataset = Dataset.from_dict({"input_ids": docs, "labels": docs})
    return pack_dataset(dataset, max_length, strategy).to_list()


def _collator(pad_to_multiple_of: int | None) -> PackedCollator:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return PackedCollator(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True,
                                                          pad_to_multiple_of=pad_to_multiple_of))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 150), min_size=1, max_size=24),
    max_length=st.integers(1, 96),
    batch_size=st.integers(1, 6),
    strategy=st.sampled_from(["bfd", "bfd_split", "wrapped", "none"]),
    pad_to_multiple_of=st.sampled_from([None, None, 8]),
)
def test_packed_metadata_is_always_consistent(lengths, max_length, batch_size, strategy, pad_to_multiple_of):
    rows = _rows(lengths, strategy, max_length)
    collate = _collator(pad_to_multiple_of)
    pieces: dict[int, list[tuple[int, int]]] = defaultdict(list)  # source document -> (start position, length)
    for b in range(0, len(rows), batch_size):
        examples = rows[b : b + batch_size]
        batch = collate([dict(e) for e in examples])
        ids, labels, pos = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
        real = sum(len(e["input_ids"]) for e in examples)
        cu = batch["cu_seq_lens_q"]
        host = batch["nbkit_cu_seqlens_host"]
        offsets = cu.tolist()

        assert batch["input_ids"].shape[0] == 1 and cu.dtype == torch.int32
        assert tuple(offsets) == tuple(host) and torch.equal(cu, batch["cu_seq_lens_k"])
        assert offsets[0] == 0 and offsets[-1] == ids.numel()
        assert all(a < b for a, b in zip(offsets, offsets[1:])), offsets  # increasing, no empty document
        spans = list(zip(offsets, offsets[1:]))
        assert sum(b - a for a, b in spans) == ids.numel()
        assert batch["max_length_q"] == batch["max_length_k"] == max(b - a for a, b in spans)
        for a, b in spans:
            assert torch.equal(pos[a:b], torch.arange(b - a)), (a, b)
            assert labels[a] == -100
        edges, at = set(), 0
        for e in examples:  # every packed row's edge is a document boundary
            edges.add(at)
            at += len(e["input_ids"])
        edges.add(at)
        assert edges <= set(offsets), (edges, offsets)
        assert ids[real:].eq(0).all() and (ids.numel() - real) < (pad_to_multiple_of or 1)

        for a, b in spans:
            if a >= real:
                continue  # padding added by pad_to_multiple_of: one-token documents of pad
            assert b <= real and b - a <= max_length
            assert torch.equal(labels[a + 1 : b], ids[a + 1 : b])
            if strategy == "wrapped":
                continue  # wrapped packing cuts rows anywhere by design; the row is the document
            tokens = [int(t) - 1 for t in ids[a:b]]
            doc = tokens[0] // STRIDE
            positions = [t % STRIDE for t in tokens]
            assert all(t // STRIDE == doc for t in tokens), tokens  # one source document ...
            assert positions == list(range(positions[0], positions[0] + len(positions)))  # ... one contiguous piece
            pieces[doc].append((positions[0], len(positions)))

    if strategy in ("bfd", "none"):  # every document, cut to max_length, exactly once
        assert dict(pieces) == {d: [(0, min(n, max_length))] for d, n in enumerate(lengths)}
    elif strategy == "bfd_split":  # every token of every document, exactly once
        for d, n in enumerate(lengths):
            covered = sorted(pieces[d])
            assert covered[0][0] == 0 and sum(length for _, length in covered) == n
            assert all(s + length == nxt for (s, length), (nxt, _) in zip(covered, covered[1:])), covered


def test_collator_counts_one_build_per_batch():
    rows = _rows([5, 7, 3, 9], "bfd", 16)
    collate = _collator(None)
    for b in range(0, len(rows), 2):
        collate(rows[b : b + 2])
    assert collate.builds == (len(rows) + 1) // 2
