"""``expandable_segments`` on a CUDA GPU: a QLoRA FastSFT run with its defaults allocates from expandable segments
while it trains ("auto" on a CUDA GPU on Linux), leaves the allocator's setting as found when it ends, and trains bit
for bit as the run with the setting off (allocation only).

Tolerance: none; losses and every step's LoRA gradients equal.
"""

from __future__ import annotations

import pytest
import torch
from grad_steps import StepGrads
from parity import assert_same_tensors
from transformers import TrainerCallback

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4)
STEPS = 4


class SegmentKinds(TrainerCallback):
    """After each optimizer step: the kinds of the segments the run made (expandable or not; those cached before it
    are left out), and the choice torch reads."""

    def __init__(self) -> None:
        self.before = {s["address"] for s in torch.cuda.memory_snapshot()}
        self.expandable: list[set] = []
        self.choice: list = []

    def on_step_end(self, args, state, control, **kwargs):
        from nbkit.speedups.expandable_segments import user_choice

        made = [s for s in torch.cuda.memory_snapshot() if s["address"] not in self.before]
        self.expandable.append({bool(s["is_expandable"]) for s in made})
        self.choice.append(user_choice())


def _train(tmp_path, tag: str, mode):
    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.loading import load_model

    tok = load_demo_tokenizer()
    folder = tmp_path / "base"
    if not (folder / "config.json").exists():
        tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, seed=0, **SHAPE).save_pretrained(folder)
        tok.save_pretrained(folder)
    torch.cuda.empty_cache()  # segments an earlier test left cached are not this run's
    torch.manual_seed(0)
    model, _ = load_model(str(folder), load_in_4bit=True, dtype=torch.bfloat16, lora_r=8)
    extra = {} if mode == "default" else {"expandable_segments": mode}
    args = FastSFTConfig(output_dir=str(tmp_path / tag), max_steps=STEPS, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, packing=True, max_length=512, bf16=True, learning_rate=1e-2,
                         optim="sgd", logging_steps=1, report_to=[], save_strategy="no", seed=0,
                         shuffle_dataset=False, live_dashboard=False, **extra)
    torch.manual_seed(0)
    grads, kinds = StepGrads(), SegmentKinds()
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=300), processing_class=tok,
                      callbacks=[grads, kinds])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    attached = trainer.nbkit_attached
    del trainer, model
    torch.cuda.empty_cache()
    return losses, grads.steps, kinds, attached


def test_the_default_run_allocates_expandable_segments_and_trains_bit_for_bit_as_without(tmp_path):
    from nbkit.speedups.expandable_segments import current_settings, user_choice

    before = (user_choice(), current_settings())
    plain = _train(tmp_path, "plain", False)
    fast = _train(tmp_path, "default", "default")
    print(f"attached {fast[3]}; expandable segments after each step: off {plain[2].expandable}, default "
          f"{fast[2].expandable}; losses {plain[0]} vs {fast[0]}")
    assert "expandable_segments" in fast[3] and "expandable_segments" not in plain[3]
    if before[1] is not None:  # where torch can say which settings it holds (not 2.11): on while the run trained
        assert fast[2].choice == [True] * STEPS and plain[2].choice == [before[0]] * STEPS
    assert all(True in kinds for kinds in fast[2].expandable)  # the run's new segments: expandable
    assert all(kinds == {False} for kinds in plain[2].expandable)
    assert (user_choice(), current_settings()) == before  # the allocator's setting as found
    assert fast[0] == plain[0]
    assert len(fast[1]) == len(plain[1]) == STEPS
    for step, (got, want) in enumerate(zip(fast[1], plain[1]), 1):
        assert_same_tensors(got, want, where=f"gradient of step {step}")  # bit for bit
