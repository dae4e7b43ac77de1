"""Hardware defaults on a CUDA GPU: with bf16/fp16 unset, FastSFTConfig picks the mixed precision
``nbkit.load_model`` computes in (bf16 on sm80+, fp16 below), says so in one line, and pins batches.

Run: ``python -m pytest -q tests/gpu/test_settings_gpu.py`` (seconds).
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_an_unset_precision_follows_the_gpu_and_batches_are_pinned(tmp_path, caplog):
    from nbkit import FastSFTConfig
    from nbkit.loading import pick_compute_dtype

    with caplog.at_level(logging.WARNING, logger="nbkit.config"):
        args = FastSFTConfig(output_dir=str(tmp_path), packing=True, max_length=4096)
    bf16 = pick_compute_dtype() == torch.bfloat16
    assert (args.bf16, args.fp16) == (bf16, not bf16)
    lines = [r.getMessage() for r in caplog.records if r.name == "nbkit.config"]
    assert len(lines) == 1 and ("bf16 mixed precision" if bf16 else "fp16 mixed precision") in lines[0]
    assert torch.cuda.get_device_name() in lines[0]
    assert args.dataloader_pin_memory is True
    explicit = FastSFTConfig(output_dir=str(tmp_path), bf16=False, dataloader_pin_memory=False)
    assert (explicit.bf16, explicit.fp16, explicit.dataloader_pin_memory) == (False, False, False)


def test_qlora_trains_under_the_fp16_a_t4_gets(tmp_path, monkeypatch):
    """On a T4 an unset precision becomes fp16 (simulated here: the hardware reading says fp16). TRL casts QLoRA
    adapters to bf16, whose gradients fp16's scaler cannot unscale: FastSFT keeps them in fp32 and trains."""
    from nbkit import FastSFT, FastSFTConfig, settings
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.loading import load_model

    tokenizer = load_demo_tokenizer()
    tiny_model("qwen3", len(tokenizer), pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    model, tokenizer = load_model(str(tmp_path / "base"), load_in_4bit=True, dtype=torch.float16, lora_r=8)
    monkeypatch.setattr(settings, "hardware_precision", lambda use_cpu=False: ("fp16", "Tesla T4 has no fast bf16"))
    args = FastSFTConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2, packing=True,
                         max_length=128, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                         live_dashboard=False, assistant_only_loss=True)
    assert (args.bf16, args.fp16) == (False, True)
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=64), processing_class=tokenizer)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
