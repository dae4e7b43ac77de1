"""Gradient accumulation: FastSFT with gradient_accumulation_steps=4 trains like per_device_train_batch_size x 4.

With packing, each micro-batch is one packed row; transformers and TRL normalise the loss by the number of trained
tokens over the whole accumulation window (``num_items_in_batch``), so 4 micro-batches of 1 row give the same update
as 1 batch of 4 rows. Compared: the LoRA weights after 2 SGD steps (so the weights move by the gradients themselves;
LoRA B starts at 0, so after the steps it is the gradients) and the logged losses. Tolerances: fp32 on the CPU 1e-5
relative (the same sums in another grouping); on a GPU fp32 1e-4 (its kernels may split the sums differently per
shape), bf16 3e-2 (bf16 autocast rounds each micro-batch's activations and gradients: ~3 significant digits).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from nbkit import FastSFT, FastSFTConfig
from nbkit.demo.data import make_dataset
from nbkit.demo.models import tiny_model
from nbkit.demo.tokenizer import load_demo_tokenizer


def train_lora(tmp_path, batch: int, accumulation: int, device: str = "cpu", dtype: str = "fp32"):
    """Two SGD steps of FastSFT (packing, LoRA r4): the logged losses and the trainable weights after them."""
    tok = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0)
    args = FastSFTConfig(
        output_dir=str(tmp_path / f"b{batch}a{accumulation}"), max_steps=2, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=device == "cpu", bf16=dtype == "bf16", seed=0, packing=True, max_length=96,
        shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True, live_dashboard=False,
        gradient_checkpointing=False,
        optim="sgd",  # Adam divides by sqrt(v): for LoRA A, whose first gradients are 0, it scales rounding up
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    torch.manual_seed(0)
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=96), processing_class=tok,
                      peft_config=lora)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return losses, weights


def assert_same_training(tmp_path, tolerance: float, **where) -> dict[str, float]:
    """GA x4 of 1 row against 1 batch of 4 rows; returns the largest relative weight error per parameter."""
    losses_acc, weights_acc = train_lora(tmp_path, batch=1, accumulation=4, **where)
    losses_big, weights_big = train_lora(tmp_path, batch=4, accumulation=1, **where)
    assert losses_acc == pytest.approx(losses_big, rel=tolerance) and len(losses_acc) == 2, (losses_acc, losses_big)
    assert any("lora_B" in n and w.abs().max() > 0 for n, w in weights_big.items()), "training moved nothing"
    errors = {}
    for name, w in weights_big.items():
        errors[name] = float((weights_acc[name] - w).abs().max() / w.abs().max().clamp_min(1e-12))
        assert errors[name] <= tolerance, (name, errors[name])
    return errors


def test_accumulating_four_micro_batches_equals_one_batch_four_times_larger(tmp_path, one_thread):
    assert_same_training(tmp_path, 1e-5)


def test_the_comparison_sees_a_loss_normalised_per_micro_batch(tmp_path, one_thread, monkeypatch):
    """Negative control: without num_items_in_batch each micro-batch's mean counts equally, and the check fails."""
    from trl import SFTTrainer

    plain = SFTTrainer.compute_loss

    def per_micro_batch_mean(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = plain(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=None)
        if self.args.gradient_accumulation_steps > 1 and model.training:
            out = (out[0] / self.args.gradient_accumulation_steps, *out[1:]) if return_outputs else \
                out / self.args.gradient_accumulation_steps
        return out

    monkeypatch.setattr(SFTTrainer, "compute_loss", per_micro_batch_mean)
    with pytest.raises(AssertionError):
        assert_same_training(tmp_path, 1e-5)
