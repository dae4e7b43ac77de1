"""Gradient accumulation: FastSFT with gradient_accumulation_steps=4 trains like per_device_train_batch_size x 4.

With packing, each micro-batch is one packed row; transformers and TRL normalise the loss by the number of trained
tokens over the whole accumulation window (``num_items_in_batch``), so 4 micro-batches of 1 row give the same update
as 1 batch of 4 rows. Compared: the LoRA weights after 2 SGD steps (fp32, CPU; so the weights move by the gradients
themselves), to 1e-5 relative, and the logged losses to 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from nbkit import FastSFT, FastSFTConfig
from nbkit.demo.data import make_dataset
from nbkit.demo.models import tiny_model
from nbkit.demo.tokenizer import load_demo_tokenizer


def _train(tmp_path, batch: int, accumulation: int):
    tok = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0)
    args = FastSFTConfig(
        output_dir=str(tmp_path / f"b{batch}a{accumulation}"), max_steps=2, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, bf16=False, seed=0, packing=True, max_length=96, shuffle_dataset=False,
        dataloader_num_workers=0, disable_tqdm=True, live_dashboard=False, gradient_checkpointing=False,
        optim="sgd",  # Adam divides by sqrt(v): for LoRA A, whose first gradients are 0, it scales rounding up
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    torch.manual_seed(0)
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=96), processing_class=tok,
                      peft_config=lora)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return losses, weights


def test_accumulating_four_micro_batches_equals_one_batch_four_times_larger(tmp_path, one_thread):
    losses_acc, weights_acc = _train(tmp_path, batch=1, accumulation=4)
    losses_big, weights_big = _train(tmp_path, batch=4, accumulation=1)
    assert losses_acc == pytest.approx(losses_big, rel=1e-5) and len(losses_acc) == 2
    assert any("lora_B" in n and w.abs().max() > 0 for n, w in weights_big.items()), "training moved nothing"
    for name, w in weights_big.items():
        err = float((weights_acc[name] - w).abs().max() / w.abs().max().clamp_min(1e-12))
        assert err <= 1e-5, (name, err)
