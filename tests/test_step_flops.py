"""``nbkit.speedups.step_flops``: FastSFT's FLOPs estimate equals transformers' with the parameter count taken once per run.

Compared (CPU, fp32, tiny qwen3 with LoRA): ``state.total_flos`` of FastSFT and of plain TRL ``SFTTrainer`` on the
same data, and how often each asks the model for its parameter count (transformers: after every micro-step).
"""

from __future__ import annotations

from parity import fast_sft
from trl import SFTTrainer


def _run(tmp_path, fast: bool, steps: int = 4, runs: int = 1):
    """FastSFT (or TRL's SFTTrainer) on the tiny qwen3 with LoRA: total_flos after each of ``runs`` train() calls,
    and how often the model was asked for its parameter count."""
    trainer = fast_sft(tmp_path / f"run-{fast}", max_steps=steps, trainer_cls=None if fast else SFTTrainer)
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
