"""Fused LoRA (nbkit.speedups.fused_lora) against PEFT's own forward: outputs and gradients.

Tolerances: fp32 on CPU, equal to 1e-6 relative (the same products, the LoRA term accumulated by the GEMM instead of
added afterwards); bf16 autocast within 3e-2 relative of the largest value (PEFT rounds the LoRA term to bf16 three
times, the fused path once); a whole FastSFT run in fp32 gives the same first loss as fused_lora=False to 1e-6 and
later losses to 1e-4 (Adam scales up the rounding of gradients that start at zero).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from nbkit.speedups.fused_lora import FusedLoRA, why_not_fusable


class _Block(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 48, bias=bias)
        self.o_proj = nn.Linear(48, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.tanh(self.q_proj(x)))  # smooth: bf16 rounding cannot flip a mask


def _peft(seed: int = 0, **lora_kw) -> nn.Module:
    torch.manual_seed(seed)
    model = get_peft_model(_Block(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], **lora_kw))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; a non-zero B makes every gradient path count
            nn.init.normal_(p, std=0.5)
    return model


def _run(model: nn.Module, x: torch.Tensor, fused: bool, autocast: bool = False) -> list[torch.Tensor]:
    speedup = FusedLoRA()
    if fused:
        assert speedup.attach(model), speedup.skipped
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = model(x)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    finally:
        speedup.detach()
    grads = [p.grad.clone() for _, p in sorted(model.named_parameters()) if p.requires_grad]
    return [y.detach().float(), x.grad] + grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def test_fp32_equal_to_peft(one_thread):
    model = _peft()
    x = torch.randn(3, 7, 32)
    plain, fused = _run(model, x, False), _run(model, x, True)
    assert len(plain) == 2 + 4  # output, input grad, A and B of both layers
    for a, b in zip(fused, plain):
        assert _rel(a, b) <= 1e-6


def test_bf16_autocast_close_to_peft(one_thread):
    model = _peft()
    x = torch.randn(4, 16, 32)
    for a, b in zip(_run(model, x, True, autocast=True), _run(model, x, False, autocast=True)):
        assert _rel(a, b) <= 3e-2


def test_detach_restores_peft_forward_and_disabled_adapters_fall_back(one_thread):
    model = _peft()
    speedup = FusedLoRA()
    assert speedup.attach(model) and speedup.fused_layers == 2
    layer = model.base_model.model.q_proj
    assert "forward" in layer.__dict__
    x = torch.randn(2, 32)
    with model.disable_adapter():  # PEFT's path: the base layer alone
        assert torch.equal(layer(x), layer.base_layer(x))
    speedup.detach()
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("kw,reason", [({"lora_dropout": 0.1}, "lora_dropout > 0"),
                                       ({"use_dora": True}, "a LoRA variant (DoRA or similar)")])
def test_unsupported_layers_keep_peft(kw, reason):
    model = _peft(**kw)
    assert why_not_fusable(model.base_model.model.q_proj) == reason
    speedup = FusedLoRA()
    assert not speedup.attach(model)
    assert speedup.skipped == {reason: 2}


def test_4bit_base_matches_peft(one_thread):
    """A bitsandbytes NF4 base (quantized on the CPU, as moving a Linear4bit to a device does): fused == PEFT."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    torch.manual_seed(0)
    dense = _Block(bias=False)
    block = _Block(bias=False)
    for name in ("q_proj", "o_proj"):
        lin = getattr(dense, name)
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.float32,
                              quant_type="nf4", compress_statistics=True)
        q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True, module=q)
        setattr(block, name, q.to("cpu"))  # .to() quantizes the weight (nothing does it on first use)
        assert getattr(block, name).weight.quant_state is not None
    model = get_peft_model(block, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)
    assert why_not_fusable(model.base_model.model.q_proj) is None
    x = torch.randn(3, 5, 32)
    plain, fused = _run(model, x, False), _run(model, x, True)
    for a, b in zip(fused, plain):
        assert _rel(a, b) <= 1e-5


def test_checkpoint_recompute_skips_the_final_base_gemm(one_thread, monkeypatch):
    """Non-reentrant checkpoint stops recomputing once the last saved tensor is back: the final projection's base
    GEMM (whose output backward never reads) runs twice per step, not three times; gradients unchanged."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    import nbkit.speedups.fused_lora as lora

    calls: dict[int, int] = {}
    real = lora._dense_weight

    def counting(base: nn.Linear):
        inner = real(base)

        def weight(dtype: torch.dtype) -> torch.Tensor:
            calls[base.out_features] = calls.get(base.out_features, 0) + 1
            return inner(dtype)
        return weight

    monkeypatch.setattr(lora, "_dense_weight", counting)
    model = _peft()
    x = torch.randn(2, 6, 32)

    def grads(fused: bool, early_stop: bool = True) -> list[torch.Tensor]:
        speedup = FusedLoRA()
        if fused:
            assert speedup.attach(model)
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        try:
            with set_checkpoint_early_stop(early_stop):
                y = checkpoint(model, xi, use_reentrant=False)
            (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        finally:
            speedup.detach()
        return [xi.grad] + [p.grad.clone() for _, p in sorted(model.named_parameters()) if p.requires_grad]

    plain = grads(False)
    fused = grads(True)
    assert calls == {48: 3, 32: 2}  # q_proj: forward, recompute, backward; o_proj: forward, backward
    calls.clear()
    no_early = grads(True, early_stop=False)
    assert calls == {48: 3, 32: 3}  # without early stop the recompute runs the whole block
    for a, b, c in zip(fused, no_early, plain):
        assert _rel(a, c) <= 1e-6 and _rel(b, c) <= 1e-6


def test_fastsft_losses_unchanged(tmp_path, one_thread):
    from peft import LoraConfig as LC

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    data = make_dataset("messages", n=64, split="train", seed=0)

    def run(fused: bool):
        model = tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        args = FastSFTConfig(output_dir=str(tmp_path / str(fused)), max_steps=3, per_device_train_batch_size=4,
                             learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, max_length=128, packing=True, gradient_checkpointing=True, disable_tqdm=True,
                             live_dashboard=False, fused_lora=fused)
        trainer = FastSFT(model=model, args=args, train_dataset=data, processing_class=tok,
                          peft_config=LC(r=8, lora_alpha=16, target_modules="all-linear"))
        trainer.train()
        layer = trainer.model.base_model.model.model.layers[0].self_attn.q_proj
        assert "forward" not in layer.__dict__  # detached after train()
        return trainer.nbkit_attached, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    attached, fused = run(True)
    _, plain = run(False)
    assert "fused_lora" in attached
    assert len(fused) == 3
    assert abs(fused[0] - plain[0]) <= 1e-6 * abs(plain[0])  # before any update: the same forward
    for a, b in zip(fused[1:], plain[1:]):
        # after Adam steps: fp32 rounding of gradients that start at ~0 (LoRA B = 0) is normalized up by Adam
        assert abs(a - b) <= 1e-4 * abs(b)
