"""``nbkit.speedups.step_walks``: the gradient clip and ``zero_grad`` over the trainable parameters give transformers' numbers.

Compared (CPU, fp32, tiny qwen3 with LoRA, gradient accumulation 2 so ``zero_grad`` matters): FastSFT against
FastSFT with transformers' own clip and ``zero_grad`` (the ``step_walks`` row left out of the table, everything else
equal): the logged
losses and gradient norms and the trained LoRA weights bitwise equal; how often each walks the model's parameters;
the model's ``zero_grad`` is its own again after ``train()``.
"""

from __future__ import annotations

import pytest
import torch
from parity import assert_same_series, assert_same_tensors, fast_sft, train

from nbkit import speedups
from nbkit.demo.models import tiny_model


def _transformers_walks(monkeypatch) -> None:
    """FastSFT with transformers' own clip and zero_grad, everything else equal: the row left out of the table."""
    monkeypatch.setattr(speedups, "SPEEDUPS", tuple(s for s in speedups.SPEEDUPS if s.name != "step_walks"))


def _run(tmp_path, name: str, max_grad_norm: float = 1.0, steps: int = 3):
    trainer = fast_sft(tmp_path / name, max_steps=steps, gradient_accumulation_steps=2, learning_rate=1e-2,
                       max_grad_norm=max_grad_norm)
    walks = []
    params = trainer.model.parameters

    def counted(*a, **k):
        walks.append(1)
        return params(*a, **k)

    trainer.model.parameters = counted
    run = train(trainer)
    return run, len(walks), trainer.model


def assert_same_training(run, ref) -> None:
    """Bitwise: the same gradients reach the same kernels. The logged losses and gradient norms, the LoRA weights."""
    assert_same_series(run.losses, ref.losses)
    assert_same_series([h["grad_norm"] for h in run.logged], [h["grad_norm"] for h in ref.logged], what="grad_norm")
    assert_same_tensors(run.weights, ref.weights, where="LoRA weight")
    assert all("lora_" in n for n in run.weights)


@pytest.mark.parametrize("max_grad_norm", [1.0, 1e-3])  # 1e-3: every step clipped
def test_same_norms_losses_and_weights_with_fewer_walks(tmp_path, one_thread, max_grad_norm):
    with pytest.MonkeyPatch.context() as mp:
        _transformers_walks(mp)
        ref, ref_walks, _ = _run(tmp_path, "ref", max_grad_norm)
    run, walks, model = _run(tmp_path, "fast", max_grad_norm)
    assert len(run.losses) == 3
    assert_same_training(run, ref)
    # transformers walks the parameters for the clip and for zero_grad after each of the 3 optimizer steps; the
    # speedup lists them once (the other walks, building the optimizer and the like, are the same in both)
    assert ref_walks - walks == 2 * 3 - 1
    assert "zero_grad" not in vars(model)  # the model's own method again


def test_without_clipping_zero_grad_still_clears(tmp_path, one_thread):
    with pytest.MonkeyPatch.context() as mp:
        _transformers_walks(mp)
        ref, _, _ = _run(tmp_path, "ref", max_grad_norm=0.0)
    run, _, model = _run(tmp_path, "fast", max_grad_norm=0.0)
    assert_same_training(run, ref)
    assert "zero_grad" not in vars(model)


def test_train_mode_is_set_without_walking_the_module_tree(tmp_path, one_thread, monkeypatch):
    """Per micro-step ``model.train()``: transformers' recursion through every module against the flat list; the same
    training either way, and the model's own ``train`` again afterwards."""
    calls = []
    original = torch.nn.Module.train

    def counted(self, mode=True):
        calls.append(mode)
        return original(self, mode)

    monkeypatch.setattr(torch.nn.Module, "train", counted)
    with pytest.MonkeyPatch.context() as mp:
        _transformers_walks(mp)
        ref, _, ref_model = _run(tmp_path, "ref")
    ref_calls, modules = len(calls), len(list(ref_model.modules()))
    calls.clear()
    run, _, model = _run(tmp_path, "fast")
    assert_same_training(run, ref)
    # 3 optimizer steps x 2 micro-steps, each a walk of every module in transformers' loop; the flat list walks at
    # the first only (the model comes from its load in eval mode)
    assert ref_calls - len(calls) == (3 * 2 - 1) * modules
    assert "train" not in vars(model)


def test_the_flat_train_leaves_what_module_train_leaves():
    from nbkit.speedups.step_walks import _flat_train

    model = tiny_model("qwen3", 64)
    train = _flat_train(model)
    assert train is not None
    model.eval()
    model.model.layers[1].mlp.train()  # a mixed tree: some modules on, most off
    assert train() is model and all(m.training for m in model.modules())
    model.model.layers[0].eval()  # one subtree switched off between steps
    train()
    assert all(m.training for m in model.modules())
    train(False)
    assert not any(m.training for m in model.modules())
    with pytest.raises(ValueError):
        train("yes")

    class Frozen(torch.nn.Linear):
        def train(self, mode: bool = True):  # an override that must run every time
            return super().train(False)

    model.model.layers[0].mlp.gate_proj = Frozen(4, 4)
    assert _flat_train(model) is None


def test_another_transformers_release_keeps_its_own_clip_and_says_so_once(tmp_path, one_thread, monkeypatch, caplog):
    """A transformers whose ``Trainer._clip_grad_norm`` differs from the mirrored ones (simulated: another function in
    its place): that function clips every optimizer step, the numbers are transformers', one warning names it."""
    import logging

    from transformers import Trainer

    from nbkit.speedups import step_walks

    with pytest.MonkeyPatch.context() as mp:
        _transformers_walks(mp)
        ref, _, _ = _run(tmp_path, "ref")
    original, calls = Trainer._clip_grad_norm, []

    def clip_grad_norm(self, model):
        calls.append(1)
        return original(self, model)

    monkeypatch.setattr(Trainer, "_clip_grad_norm", clip_grad_norm)
    monkeypatch.setattr(step_walks.SAY_ONCE, "_said", set())
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.step_walks"):
        run, _, _ = _run(tmp_path, "other")
        _run(tmp_path, "again", steps=1)
    said = [r.getMessage() for r in caplog.records if "step_walks" in r.getMessage()]
    assert len(said) == 1 and "Trainer._clip_grad_norm differs" in said[0], said
    assert len(calls) == 3 + 1  # every optimizer step of both runs
    assert_same_training(run, ref)
