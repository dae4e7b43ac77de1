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


def test_another_transformers_release_keeps_its_own_count_and_says_so_once(tmp_path, one_thread, monkeypatch, caplog):
    """A transformers whose ``Trainer.floating_point_ops`` differs from the mirrored one (simulated: another function
    in its place): step_flops does not attach, that function counts after every micro-step, one warning names it."""
    import logging

    from transformers import Trainer

    from nbkit.speedups import step_flops

    original, calls = Trainer.floating_point_ops, []

    def floating_point_ops(self, inputs):
        calls.append(1)
        return original(self, inputs)

    monkeypatch.setattr(Trainer, "floating_point_ops", floating_point_ops)
    monkeypatch.setattr(step_flops.SAY_ONCE, "_said", set())
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.step_flops"):
        (flos,), counts = _run(tmp_path, fast=True, steps=2)
        _run(tmp_path / "again", fast=True, steps=2)
    said = [r.getMessage() for r in caplog.records if "step_flops" in r.getMessage()]
    assert len(said) == 1 and "Trainer.floating_point_ops differs" in said[0], said
    assert len(calls) == 4 and counts >= 2 and flos > 0  # transformers' own count, after each micro-step
