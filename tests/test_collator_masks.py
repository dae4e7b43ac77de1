"""TRL's completion and assistant masks survive nbkit's collator: the labels FastSFT trains on are -100 exactly
where TRL's own collator puts -100 (prompt-completion data with completion-only loss, conversational data with
assistant_only_loss), packed or not.

Packed, both collators are padding-free and the batches must be equal. Unpacked, TRL pads rows while nbkit's
collator (``trainer.nbkit_collator``, which FastSFT's own data loaders use) flattens them (``PackedCollator`` over TRL's
padding-free collator): each row's labels from its second token on
must be TRL's, and its first label -100 (in a padded row it is never a target; in a flattened row it would be
predicted from the previous document).
"""

from __future__ import annotations

import pytest
import torch

CASES = [("prompt", {}), ("messages", {"assistant_only_loss": True})]


@pytest.fixture(scope="module")
def tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _trainers(tok, tmp_path, fmt, extra, packing):
    from trl import SFTConfig, SFTTrainer

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model

    data = make_dataset(fmt, n=24, split="train", seed=0)
    common = dict(packing=packing, max_length=96, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                  save_strategy="no", dataloader_num_workers=0, **extra)
    out = []
    for trainer_cls, config_cls, kw in ((SFTTrainer, SFTConfig, {}), (FastSFT, FastSFTConfig, {"live_dashboard": False})):
        model = tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id)
        args = config_cls(output_dir=str(tmp_path / trainer_cls.__name__), **common, **kw)
        out.append(trainer_cls(model=model, args=args, train_dataset=data, processing_class=tok))
    return out


@pytest.mark.parametrize("fmt,extra", CASES, ids=[c[0] for c in CASES])
def test_packed_batches_are_trls(tok, tmp_path, fmt, extra):
    plain, fast = _trainers(tok, tmp_path, fmt, extra, packing=True)
    rows = [plain.train_dataset[i] for i in range(4)]
    assert rows == [fast.train_dataset[i] for i in range(4)]
    ours, theirs = fast.nbkit_collator(rows), plain.data_collator(rows)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["labels"], theirs["labels"])
    masked = ours["labels"] == -100
    documents = ours["cu_seq_lens_q"].numel() - 1
    assert masked.sum() > 3 * documents and (~masked).any()  # whole prompts are masked (not only document starts)


@pytest.mark.parametrize("fmt,extra", CASES, ids=[c[0] for c in CASES])
def test_unpacked_rows_keep_trls_masks(tok, tmp_path, fmt, extra):
    plain, fast = _trainers(tok, tmp_path, fmt, extra, packing=False)
    rows = [plain.train_dataset[i] for i in range(4)]
    ours, theirs = fast.nbkit_collator(rows), plain.data_collator(rows)
    flat = ours["labels"][0]
    start = 0
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        segment, padded = flat[start:start + n], theirs["labels"][i, :n]
        assert segment[0] == -100
        assert torch.equal(segment[1:], padded[1:])
        assert torch.equal(theirs["labels"][i, n:], torch.full_like(theirs["labels"][i, n:], -100))
        start += n
    assert start == flat.numel()
    trained = (flat != -100).sum()
    assert 0 < trained < flat.numel()
