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
from parity import Tol, assert_same_series, assert_same_tensors, fast_sft, lora_config, train

from nbkit.demo.data import make_dataset


def train_lora(tmp_path, batch: int, accumulation: int, device: str = "cpu", dtype: str = "fp32"):
    """Two SGD steps of FastSFT (packing, LoRA r4): the run's logged losses and trainable weights after them."""
    trainer = fast_sft(
        tmp_path / f"b{batch}a{accumulation}", max_steps=2, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, use_cpu=device == "cpu", bf16=dtype == "bf16",
        shuffle_dataset=False, gradient_checkpointing=False,
        optim="sgd",  # Adam divides by sqrt(v): for LoRA A, whose first gradients are 0, it scales rounding up
        dataset=make_dataset("messages", n=96), lora=lora_config(targets=["q_proj", "v_proj", "down_proj"]))
    return train(trainer)


def assert_same_training(tmp_path, tolerance: float, **where) -> dict[str, float]:
    """GA x4 of 1 row against 1 batch of 4 rows; returns the largest relative weight error per parameter."""
    acc = train_lora(tmp_path, batch=1, accumulation=4, **where)
    big = train_lora(tmp_path, batch=4, accumulation=1, **where)
    assert_same_series(acc.losses, big.losses, Tol(rtol=tolerance))
    assert len(acc.losses) == 2
    assert any("lora_B" in n and w.abs().max() > 0 for n, w in big.weights.items()), "training moved nothing"
    return assert_same_tensors(acc.weights, big.weights, Tol(scaled=tolerance), where="weight after 2 steps")


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
    # FastSFT's sync-free loss (on by default) would not go through the patched method: TRL's path for both
    monkeypatch.setattr("nbkit.speedups.sync_free_loss.applies", lambda trainer, return_outputs: False)
    with pytest.raises(AssertionError):
        assert_same_training(tmp_path, 1e-5)
