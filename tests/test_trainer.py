"""FastSFT is a drop-in SFTTrainer: same losses (and so same gradients, step after step) on CPU in fp32.

Tolerance: per-step training losses equal to 1e-5 relative (the packed path sums the same terms in another order).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from parity import Tol, assert_same_series, fast_sft, tiny_lm, train
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

from nbkit import FastSFT, FastSFTConfig
from nbkit.demo.data import make_dataset

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "nbkit" / "demo" / "assets" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _model(tokenizer, family="qwen3"):
    return tiny_lm(family, tokenizer=tokenizer)


def _args(cls, tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / cls.__name__), max_steps=3, per_device_train_batch_size=4, learning_rate=3e-3,
        logging_steps=1, report_to=[], save_strategy="no", bf16=False, use_cpu=True, seed=0,
        gradient_checkpointing=False, disable_tqdm=True, max_length=128, dataloader_num_workers=0,
    )
    base.update(kw)
    if cls is FastSFTConfig:
        base.setdefault("live_dashboard", False)
    return cls(**base)


def _train_both(tokenizer, tmp_path, dataset, **kw):
    """SFTTrainer then FastSFT, full fine-tunes of the same tiny model on the same data and settings."""
    settings = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=3e-3, gradient_checkpointing=False,
                    max_length=128, lora=None, tokenizer=tokenizer, dataset=dataset)
    return [train(fast_sft(tmp_path / cls.__name__, trainer_cls=cls, **settings, **kw)) for cls in (SFTTrainer, FastSFT)]


@pytest.mark.parametrize(
    "fmt,kw",
    [
        ("text", {}),
        ("prompt", {}),  # completion-only loss: TRL's default for prompt-completion data
        ("messages", {"assistant_only_loss": True}),
    ],
)
@pytest.mark.parametrize("packing", [True, False])
def test_fastsft_losses_equal_sfttrainer(tokenizer, tmp_path, fmt, kw, packing):
    dataset = make_dataset(fmt, n=48, split="train", seed=0)
    plain, fast = _train_both(tokenizer, tmp_path, dataset, packing=packing, **kw)
    assert any(s.startswith("cached_packing") for s in fast.trainer.nbkit_attached), fast.trainer.nbkit_attached
    assert len(plain.losses) == 3 and plain.losses[0] > 0
    assert_same_series(fast.losses, plain.losses, Tol(rtol=1e-5, atol=1e-6))
    # detached after training: the user gets a plain model back
    assert fast.trainer.model.config._attn_implementation != "nbkit"


def test_switch_off_is_plain_trl(tokenizer, tmp_path):
    dataset = make_dataset("text", n=16, split="train", seed=0)
    fast = FastSFT(model=_model(tokenizer), args=_args(FastSFTConfig, tmp_path, packing=True, cached_packing=False,
                                                       max_steps=1), train_dataset=dataset, processing_class=tokenizer)
    assert type(fast.data_collator).__name__ == "DataCollatorForLanguageModeling"
    fast.train()
    assert not any(s.startswith("cached_packing") for s in fast.nbkit_attached)


def test_packing_off_still_goes_padding_free(tokenizer, tmp_path):
    dataset = make_dataset("text", n=8, split="train", seed=0)
    fast = FastSFT(model=_model(tokenizer), args=_args(FastSFTConfig, tmp_path, packing=False),
                   train_dataset=dataset, processing_class=tokenizer)
    batch = next(iter(fast.get_train_dataloader()))
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    assert batch["nbkit_cu_seqlens_host"][-1] == batch["input_ids"].shape[1]
    assert len(batch["nbkit_cu_seqlens_host"]) == 4 + 1  # a batch of 4 rows = 4 documents


def test_plain_sftconfig_is_accepted(tokenizer, tmp_path):
    dataset = make_dataset("text", n=8, split="train", seed=0)
    fast = FastSFT(model=_model(tokenizer), args=_args(SFTConfig, tmp_path, packing=True, max_steps=1),
                   train_dataset=dataset, processing_class=tokenizer)
    fast.train()
    assert fast.nbkit_attached and fast.nbkit_attached[0].startswith("cached_packing")


def test_custom_collator_keeps_plain_path_with_a_warning(tokenizer, tmp_path, caplog):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    dataset = make_dataset("text", n=8, split="train", seed=0)
    collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    with caplog.at_level(logging.WARNING, logger="nbkit.trainer"):
        fast = FastSFT(model=_model(tokenizer), args=_args(FastSFTConfig, tmp_path, max_steps=1),
                       data_collator=collator, train_dataset=dataset, processing_class=tokenizer)
    assert "custom data_collator" in caplog.text
    assert fast.data_collator is collator


def test_bad_switch_values_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="attention_kernel"):
        FastSFTConfig(output_dir=str(tmp_path), bf16=False, attention_kernel="fast")
    with pytest.raises(ValueError, match="offload_checkpointing"):
        FastSFTConfig(output_dir=str(tmp_path), bf16=False, offload_checkpointing="yes")


def test_flash_attn_absent_fails_before_training_and_loses_nothing(tokenizer, tmp_path):
    from nbkit.ops.varlen_attention import flash_attn_available

    if flash_attn_available():
        pytest.skip("flash-attn installed")
    dataset = make_dataset("text", n=8, split="train", seed=0)
    model = _model(tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = FastSFT(model=model, args=_args(FastSFTConfig, tmp_path, attention_kernel="flash_attn", max_steps=1),
                   train_dataset=dataset, processing_class=tokenizer)
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        fast.train()
    assert fast.state.global_step == 0
    assert model.config._attn_implementation != "nbkit"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("eos_trained", [False, True])
def test_fastsft_warns_before_training_when_no_row_trains_the_stop_token(tokenizer, tmp_path, caplog, eos_trained):
    """Pre-tokenized rows whose completion mask leaves the eos token out: the model would never learn to stop."""
    from datasets import Dataset

    eos = tokenizer.eos_token_id
    rows = []
    for i in range(8):
        body = [10 + (i + j) % 50 for j in range(12)]
        rows.append({"input_ids": body + [eos], "completion_mask": [0] * 6 + [1] * 6 + [int(eos_trained)]})
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.stop_token"):
        trainer = FastSFT(model=_model(tokenizer), processing_class=tokenizer, train_dataset=Dataset.from_list(rows),
                          args=_args(FastSFTConfig, tmp_path, packing=False))
    warned = [r for r in caplog.records if "stop token" in r.getMessage()]
    assert trainer.nbkit_stop_token is not None and trainer.nbkit_stop_token.ok is eos_trained
    assert bool(warned) is not eos_trained
