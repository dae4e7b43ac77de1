"""``nbkit.step_flops``: FastSFT's FLOPs estimate equals transformers' with the parameter count taken once per run.

Compared (CPU, fp32, tiny qwen3 with LoRA): ``state.total_flos`` of FastSFT and of plain TRL ``SFTTrainer`` on the
same data, and how often each asks the model for its parameter count (transformers: after every micro-step).
"""

from __future__ import annotations

import torch
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from nbkit import FastSFT, FastSFTConfig
from nbkit.demo.data import make_dataset
from nbkit.demo.models import tiny_model
from nbkit.demo.tokenizer import load_demo_tokenizer


def _run(tmp_path, fast: bool, steps: int = 4, runs: int = 1):
    tok = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0)
    common = dict(output_dir=str(tmp_path / f"run-{fast}"), max_steps=steps, per_device_train_batch_size=2,
                  learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                  seed=0, packing=True, max_length=96, dataloader_num_workers=0, disable_tqdm=True)
    args = FastSFTConfig(**common, live_dashboard=False) if fast else SFTConfig(**common)
    torch.manual_seed(0)
    trainer = (FastSFT if fast else SFTTrainer)(
        model=model, args=args, train_dataset=make_dataset("messages", n=64), processing_class=tok,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    calls = []
    count = trainer.model.num_parameters

    def counted(*a, **k):
        calls.append(k)
        return count(*a, **k)

    trainer.model.num_parameters = counted
    flos = []
    for _ in range(runs):
        trainer.train()
        flos.append(trainer.state.total_flos)
    return flos, len(calls)


def test_total_flos_equal_trls_and_the_count_is_taken_once_per_run(tmp_path, one_thread):
    (plain,), plain_calls = _run(tmp_path, fast=False)
    (fast,), fast_calls = _run(tmp_path, fast=True)
    assert fast == plain > 0
    assert plain_calls >= 4 and fast_calls == 1


def test_each_train_call_counts_again(tmp_path, one_thread):
    flos, calls = _run(tmp_path, fast=True, steps=2, runs=2)
    assert calls == 2 and flos[0] > 0
