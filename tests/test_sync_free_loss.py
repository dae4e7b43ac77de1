"""``sync_free_metrics``: FastSFT's loss and every logged value equal TRL's own ``compute_loss``, and its step reads
nothing on the host between forward and backward.

Compared (CPU, fp32): the whole log history (loss, grad_norm, entropy, mean_token_accuracy, num_tokens, MoE aux_loss,
the learning rate), and the trained weights, of FastSFT with the switch on and off; with packing (padding-free:
token counts from the batch shape) and without (padded: from the attention mask), with logging every step and every
second step under gradient accumulation (TRL averages a window's micro-steps), a MoE family (its auxiliary loss)
and an evaluation. Equal to 1e-6 relative (the same expressions, evaluated in the same order). Host reads are counted
by wrapping ``Tensor.item`` / ``Tensor.__bool__`` / ``Tensor.tolist`` during ``compute_loss``.
"""

from __future__ import annotations

import pytest
import torch
from parity import assert_same_tensors, fast_sft, train

from nbkit.demo.data import make_dataset


def _trainer(tmp_path, sync_free: bool, family="qwen3", packing=True, logging_steps=1, accumulation=1):
    return fast_sft(
        tmp_path / f"{sync_free}-{family}-{packing}", family=family, max_steps=4, gradient_accumulation_steps=accumulation,
        logging_steps=logging_steps, shuffle_dataset=False, packing=packing, sync_free_metrics=sync_free,
        per_device_eval_batch_size=2, eval_strategy="no", eval_dataset=make_dataset("messages", n=8, split="eval"))


def _history(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in ("train_runtime", "train_samples_per_second",
                                                       "train_steps_per_second", "eval_runtime",
                                                       "eval_samples_per_second", "eval_steps_per_second")}
            for h in trainer.state.log_history]


@pytest.mark.parametrize("family, packing, logging_steps, accumulation", [
    ("qwen3", True, 1, 1), ("qwen3", False, 1, 1), ("qwen3", True, 2, 2), ("qwen3_moe", True, 1, 1)])
def test_logged_values_and_weights_equal_trls(tmp_path, one_thread, family, packing, logging_steps, accumulation):
    runs = {}
    for sync_free in (False, True):
        run = train(_trainer(tmp_path, sync_free, family, packing, logging_steps, accumulation))
        run.trainer.evaluate()
        runs[sync_free] = (_history(run.trainer), run)
    (plain, plain_run), (fast, fast_run) = runs[False], runs[True]
    assert len(plain) == len(fast) and len(plain) >= 3
    keys = {k for h in plain for k in h}
    assert {"loss", "entropy", "mean_token_accuracy", "num_tokens", "eval_loss", "eval_entropy"} <= keys, keys
    if family == "qwen3_moe":
        assert "aux_loss" in keys
    for a, b in zip(plain, fast):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-6), (key, a[key], b[key])
            assert not isinstance(b[key], torch.Tensor), key
    assert [h["num_tokens"] for h in plain if "num_tokens" in h][-1] > 0
    assert isinstance(fast_run.trainer._total_train_tokens, int)
    assert_same_tensors(fast_run.weights, plain_run.weights, where="trained weight")  # bitwise


def test_the_step_reads_nothing_on_the_host(tmp_path, one_thread, monkeypatch):
    """TRL's compute_loss reads the metrics on the host in every micro-step; the sync-free one never does."""
    counts = {}
    for sync_free in (False, True):
        trainer = _trainer(tmp_path, sync_free, packing=False)  # padded: TRL reads the mask's token count too
        batch = next(iter(trainer.get_train_dataloader()))
        reads = []
        for name in ("item", "__bool__", "tolist"):
            original = getattr(torch.Tensor, name)

            def counted(self, *a, _original=original, _name=name, _reads=reads, **k):
                _reads.append(_name)
                return _original(self, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)
        trainer.model.train()
        with trainer.nbkit_speedups():  # as in train(): nbkit's packed attention builds no mask (no read there)
            loss = trainer.compute_loss(trainer.model, batch)
            monkeypatch.undo()
            counts[sync_free] = len(reads)
            loss.backward()
    assert counts[False] >= 3, counts  # the control: TRL's own reads are seen
    assert counts[True] == 0, counts


def test_cases_it_does_not_mirror_take_trls_path(tmp_path):
    from nbkit.speedups import sync_free_loss

    trainer = _trainer(tmp_path, True)
    assert sync_free_loss.applies(trainer, return_outputs=False)
    assert not sync_free_loss.applies(trainer, return_outputs=True)
    trainer.compute_loss_func = lambda *a, **k: None
    assert not sync_free_loss.applies(trainer, return_outputs=False)
    trainer.compute_loss_func = None
    trainer.args.sync_free_metrics = False
    assert not sync_free_loss.applies(trainer, return_outputs=False)
