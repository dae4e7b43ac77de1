"""``nbkit.step_walks``: the gradient clip and ``zero_grad`` over the trainable parameters give transformers' numbers.

Compared (CPU, fp32, tiny qwen3 with LoRA, gradient accumulation 2 so ``zero_grad`` matters): FastSFT against
FastSFT with transformers' own clip and ``zero_grad`` (the mixin bypassed, everything else equal): the logged
losses and gradient norms and the trained LoRA weights bitwise equal; how often each walks the model's parameters;
the model's ``zero_grad`` is its own again after ``train()``.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from nbkit import FastSFT, FastSFTConfig
from nbkit.demo.data import make_dataset
from nbkit.demo.models import tiny_model
from nbkit.demo.tokenizer import load_demo_tokenizer
from nbkit.step_walks import CachedTrainableWalks


def _transformers_walks(monkeypatch) -> None:
    """The mixin made a pass-through: FastSFT with transformers' own clip and zero_grad, everything else equal."""
    monkeypatch.setattr(CachedTrainableWalks, "train",
                        lambda self, *a, **k: super(CachedTrainableWalks, self).train(*a, **k))
    monkeypatch.setattr(CachedTrainableWalks, "_clip_grad_norm",
                        lambda self, model: super(CachedTrainableWalks, self)._clip_grad_norm(model))


def _run(tmp_path, name: str, max_grad_norm: float = 1.0, steps: int = 3):
    tok = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0)
    args = FastSFTConfig(output_dir=str(tmp_path / name), max_steps=steps, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[],
                         save_strategy="no", use_cpu=True, bf16=False, seed=0, packing=True, max_length=96,
                         dataloader_num_workers=0, disable_tqdm=True, live_dashboard=False,
                         max_grad_norm=max_grad_norm)
    torch.manual_seed(0)
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=64), processing_class=tok,
                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    walks = []
    params = trainer.model.parameters

    def counted(*a, **k):
        walks.append(1)
        return params(*a, **k)

    trainer.model.parameters = counted
    trainer.train()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    return logs, lora, len(walks), trainer.model


@pytest.mark.parametrize("max_grad_norm", [1.0, 1e-3])  # 1e-3: every step clipped
def test_same_norms_losses_and_weights_with_fewer_walks(tmp_path, one_thread, max_grad_norm):
    with pytest.MonkeyPatch.context() as mp:
        _transformers_walks(mp)
        ref_logs, ref_lora, ref_walks, _ = _run(tmp_path, "ref", max_grad_norm)
    logs, lora, walks, model = _run(tmp_path, "fast", max_grad_norm)
    assert len(logs) == 3 and logs == ref_logs  # bitwise: the same gradients reach the same kernels
    assert lora.keys() == ref_lora.keys() and all(torch.equal(lora[n], ref_lora[n]) for n in lora)
    # transformers walks the parameters for the clip and for zero_grad after each of the 3 optimizer steps; the
    # mixin lists them once (the other walks, building the optimizer and the like, are the same in both)
    assert ref_walks - walks == 2 * 3 - 1
    assert "zero_grad" not in vars(model)  # the model's own method again


def test_without_clipping_zero_grad_still_clears(tmp_path, one_thread):
    with pytest.MonkeyPatch.context() as mp:
        _transformers_walks(mp)
        ref_logs, ref_lora, _, _ = _run(tmp_path, "ref", max_grad_norm=0.0)
    logs, lora, _, model = _run(tmp_path, "fast", max_grad_norm=0.0)
    assert logs == ref_logs and all(torch.equal(lora[n], ref_lora[n]) for n in lora)
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
        ref_logs, ref_lora, _, ref_model = _run(tmp_path, "ref")
    ref_calls, modules = len(calls), len(list(ref_model.modules()))
    calls.clear()
    logs, lora, _, model = _run(tmp_path, "fast")
    assert logs == ref_logs and all(torch.equal(lora[n], ref_lora[n]) for n in lora)
    # 3 optimizer steps x 2 micro-steps, each a walk of every module in transformers' loop; the flat list walks at
    # the first only (the model comes from its load in eval mode)
    assert ref_calls - len(calls) == (3 * 2 - 1) * modules
    assert "train" not in vars(model)


def test_the_flat_train_leaves_what_module_train_leaves():
    from nbkit.step_walks import _flat_train

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
