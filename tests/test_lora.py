"""Fused LoRA (nbkit.speedups.fused_lora) against PEFT's own forward: outputs and gradients.

Tolerances: fp32 on CPU, equal to 1e-6 relative (the same products, the LoRA term accumulated by the GEMM instead of
added afterwards); bf16 autocast within 3e-2 relative of the largest value (PEFT rounds the LoRA term to bf16 three
times, the fused path once); a whole FastSFT run in fp32 gives the same first loss as fused_lora=False to 1e-6 and
later losses to 1e-4 (Adam scales up the rounding of gradients that start at zero).
"""

from __future__ import annotations

import pytest
import torch
from parity import Tol, add_lora, assert_same_series, assert_same_tensors, fast_sft, lora_config, train
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
    # PEFT starts B at zero; a non-zero B makes every gradient path count
    return add_lora(_Block(), targets=["q_proj", "o_proj"], seed=seed, random_b=0.5, **lora_kw)


def _run(model: nn.Module, x: torch.Tensor, fused: bool, autocast: bool = False) -> dict[str, torch.Tensor]:
    """The output, the input's gradient and every LoRA gradient of one forward and backward."""
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
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"output": y.detach().float(), "input grad": x.grad, **grads}


def test_fp32_equal_to_peft(one_thread):
    model = _peft()
    x = torch.randn(3, 7, 32)
    plain, fused = _run(model, x, False), _run(model, x, True)
    assert len(plain) == 2 + 4  # output, input grad, A and B of both layers
    assert_same_tensors(fused, plain, Tol(scaled=1e-6))


def test_bf16_autocast_close_to_peft(one_thread):
    model = _peft()
    x = torch.randn(4, 16, 32)
    assert_same_tensors(_run(model, x, True, autocast=True), _run(model, x, False, autocast=True), Tol(scaled=3e-2))


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
    model = add_lora(block, targets=["q_proj", "o_proj"], random_b=0.5)
    assert why_not_fusable(model.base_model.model.q_proj) is None
    x = torch.randn(3, 5, 32)
    assert_same_tensors(_run(model, x, True), _run(model, x, False), Tol(scaled=1e-5))


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
        return {"input grad": xi.grad, **{n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}}

    plain = grads(False)
    fused = grads(True)
    assert calls == {48: 3, 32: 2}  # q_proj: forward, recompute, backward; o_proj: forward, backward
    calls.clear()
    no_early = grads(True, early_stop=False)
    assert calls == {48: 3, 32: 3}  # without early stop the recompute runs the whole block
    assert_same_tensors(fused, plain, Tol(scaled=1e-6), where="early stop")
    assert_same_tensors(no_early, plain, Tol(scaled=1e-6), where="no early stop")


def test_fastsft_losses_unchanged(tmp_path, one_thread):
    from nbkit.demo.data import make_dataset

    data = make_dataset("messages", n=64, split="train", seed=0)

    def run(fused: bool):
        trainer = fast_sft(tmp_path / str(fused), dataset=data, max_steps=3, per_device_train_batch_size=4,
                           learning_rate=3e-3, max_length=128, gradient_checkpointing=True, fused_lora=fused,
                           lora=lora_config(r=8))
        losses = train(trainer).losses
        layer = trainer.model.base_model.model.model.layers[0].self_attn.q_proj
        assert "forward" not in layer.__dict__  # detached after train()
        return trainer.nbkit_attached, losses

    attached, fused = run(True)
    _, plain = run(False)
    assert "fused_lora" in attached
    assert len(fused) == 3
    assert_same_series(fused[:1], plain[:1], Tol(rtol=1e-6))  # before any update: the same forward
    # after Adam steps: fp32 rounding of gradients that start at ~0 (LoRA B = 0) is normalized up by Adam
    assert_same_series(fused[1:], plain[1:], Tol(rtol=1e-4))
