"""``tiled_mlp`` on a CUDA GPU in bf16 (tiles of 64 tokens; every other switch at its default, Liger's MLP kernel included when
installed): the same losses and LoRA gradients as the untiled MLP. Tolerance: losses 2e-2 relative (bf16; the tiles'
gradients are summed in fp32, the plain path's by one bf16 GEMM), LoRA weights after 2 SGD steps 5e-2 relative."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiled_mlp_matches_the_plain_mlp_in_bf16(tmp_path, family):
    from peft import LoraConfig

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()

    def run(tiled):
        model = tiny_model(family, len(tok), dtype=torch.bfloat16, pad_token_id=tok.pad_token_id, seed=0)
        args = FastSFTConfig(output_dir=str(tmp_path / str(tiled)), max_steps=2, per_device_train_batch_size=2,
                             packing=True, max_length=512, bf16=True, learning_rate=1e-2, optim="sgd",
                             logging_steps=1, report_to=[], save_strategy="no", seed=0, shuffle_dataset=False,
                             gradient_checkpointing=True, live_dashboard=False, tiled_mlp=tiled,
                             tiled_mlp_tokens=64)
        torch.manual_seed(0)
        trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=200), processing_class=tok,
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, {n: p.detach().float() for n, p in trainer.model.named_parameters() if p.requires_grad}, trainer

    plain_losses, plain_w, _ = run(False)
    tiled_losses, tiled_w, trainer = run(True)
    assert "tiled_mlp" in trainer.nbkit_attached
    assert tiled_losses == pytest.approx(plain_losses, rel=2e-2)
    worst = max(float((tiled_w[n] - w).abs().max() / w.abs().max().clamp_min(1e-12)) for n, w in plain_w.items())
    print(f"{family}: losses {plain_losses} vs {tiled_losses}; largest relative LoRA weight difference {worst:.2e}")
    assert worst <= 5e-2


def test_auto_tiles_when_the_gpu_is_short_of_memory(tmp_path, monkeypatch):
    """'auto' on a GPU whose limit, as the run's budget reads it (``Budget.crowded``), is faked to 1 MiB (below what
    the run holds, the memory in use read for real): the MLP calls are tiled, and the run trains as the plain MLP
    does (the tolerances above)."""
    from peft import LoraConfig

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.ops import tiled_mlp as tiled_op
    from nbkit.speedups import layer_budget

    tok = load_demo_tokenizer()
    calls = []
    apply = tiled_op._TiledMLP.apply
    monkeypatch.setattr(tiled_op._TiledMLP, "apply", lambda *a: calls.append(1) or apply(*a))

    def run(tiled):
        model = tiny_model("llama", len(tok), dtype=torch.bfloat16, pad_token_id=tok.pad_token_id, seed=0)
        args = FastSFTConfig(output_dir=str(tmp_path / str(tiled)), max_steps=2, per_device_train_batch_size=2,
                             packing=True, max_length=512, bf16=True, learning_rate=1e-2, optim="sgd",
                             logging_steps=1, report_to=[], save_strategy="no", seed=0, shuffle_dataset=False,
                             gradient_checkpointing=True, live_dashboard=False, tiled_mlp=tiled)
        torch.manual_seed(0)
        trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=200), processing_class=tok,
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, {n: p.detach().float() for n, p in trainer.model.named_parameters() if p.requires_grad}

    plain_losses, plain_w = run(False)
    assert not calls
    monkeypatch.setattr(layer_budget, "gpu_limit", lambda device: 1 << 20)  # the budget's limit ('auto''s rule)
    auto_losses, auto_w = run("auto")
    assert calls, "auto did not tile on a GPU short of memory"
    assert auto_losses == pytest.approx(plain_losses, rel=2e-2)
    worst = max(float((auto_w[n] - w).abs().max() / w.abs().max().clamp_min(1e-12)) for n, w in plain_w.items())
    assert worst <= 5e-2
