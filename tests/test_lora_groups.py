"""``lora_groups``: fused LoRA layers that read one input (q/k/v, gate/up) run as one, against each alone and PEFT.

Tolerances as in test_lora.py: fp32 on CPU equal to 1e-5 relative of the largest value (the same products, summed in
another order: one GEMM over the stacked widths, the block-diagonal B's zeros adding exact zeros), bf16 autocast
within 3e-2 of PEFT. A member called with another input than the one its group computed for computes afresh, so a
model that feeds the projections different tensors (cross-attention) still gets its own outputs.
"""

from __future__ import annotations

import pytest
import torch
from parity import Tol, add_lora, assert_same_series, assert_same_tensors, fast_sft, lora_config, train
from torch import nn

from nbkit.speedups.fused_lora import FusedLoRA, lora_groups

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Layer(nn.Module):
    """A decoder layer's projections: q/k/v of one input, gate/up of another, o and down alone."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(32, n, bias=bias) for n in (48, 16, 16))
        self.o_proj = nn.Linear(80, 32, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(32, 40, bias=False), nn.Linear(32, 40, bias=False)
        self.down_proj = nn.Linear(40, 32, bias=False)

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None) -> torch.Tensor:
        kv = x if kv is None else kv
        h = x + self.o_proj(torch.tanh(torch.cat([self.q_proj(x), self.k_proj(kv), self.v_proj(kv)], -1)))
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def _model(seed: int = 0, bias: bool = False, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return add_lora(_Layer(bias), targets=list(PROJECTIONS), seed=seed, random_b=0.5, **kw)


def _run(model: nn.Module, x: torch.Tensor, speedup: FusedLoRA | None, autocast: bool = False,
         kv: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    if speedup is not None:
        assert speedup.attach(model)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = model(x) if kv is None else model(x, kv=kv)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    finally:
        if speedup is not None:
            speedup.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"output": y.detach().float(), "input grad": x.grad, **grads}


@pytest.mark.parametrize("bias", [False, True])
def test_groups_equal_each_alone_and_peft_fp32(one_thread, bias):
    model = _model(bias=bias)
    speedup = FusedLoRA(groups=True)
    speedup.attach(model)
    assert [len(g.members) for g in speedup.grouped] == [3, 2]
    speedup.detach()
    x = torch.randn(3, 7, 32)
    peft, alone, grouped = _run(model, x, None), _run(model, x, FusedLoRA()), _run(model, x, FusedLoRA(groups=True))
    assert len(grouped) == 2 + 2 * len(PROJECTIONS)
    assert_same_tensors(grouped, alone, Tol(scaled=1e-5), where="grouped vs alone")
    assert_same_tensors(grouped, peft, Tol(scaled=1e-5), where="grouped vs PEFT")


def test_groups_close_to_peft_under_bf16_autocast(one_thread):
    model = _model()
    x = torch.randn(4, 16, 32)
    assert_same_tensors(_run(model, x, FusedLoRA(groups=True), autocast=True), _run(model, x, None, autocast=True),
                        Tol(scaled=3e-2))


def test_other_inputs_compute_afresh_and_nothing_is_held(one_thread):
    """k/v of another tensor than q's (cross-attention): each member its own output; the group holds nothing after."""
    model = _model()
    x, kv = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    speedup = FusedLoRA(groups=True)
    grouped = _run(model, x, speedup, kv=kv)
    assert_same_tensors(grouped, _run(model, x, None, kv=kv), Tol(scaled=1e-5))
    speedup.attach(model)
    try:
        layer = model.base_model.model
        out_k = layer.k_proj(x)  # k first: it computes the group and leaves q's and v's for x
        assert torch.allclose(layer.q_proj(x), layer.q_proj.base_layer(x) + layer.q_proj.lora_B["default"](
            layer.q_proj.lora_A["default"](x)) * layer.q_proj.scaling["default"], atol=1e-5)
        layer.v_proj(x)
        assert all(g._input is None and not g._waiting for g in speedup.grouped)
        assert out_k.shape == (2, 5, 16)
    finally:
        speedup.detach()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_unlike_members_do_not_group():
    """A different rank scaling in one member (alpha_pattern) keeps the q/k/v layers alone; gate/up still group."""
    model = _model(alpha_pattern={"k_proj": 16})
    groups = lora_groups(model)
    assert [[type(m).__name__ for m in g] for g in groups] == [["Linear", "Linear"]]
    assert groups[0][0] is model.base_model.model.gate_proj


def test_disabled_adapters_fall_back_to_peft(one_thread):
    model = _model()
    speedup = FusedLoRA(groups=True)
    assert speedup.attach(model)
    layer = model.base_model.model
    x = torch.randn(2, 32)
    try:
        with model.disable_adapter():
            assert torch.equal(layer.q_proj(x), layer.q_proj.base_layer(x))
            assert torch.equal(layer.k_proj(x), layer.k_proj.base_layer(x))
    finally:
        speedup.detach()


def test_4bit_groups_read_the_stacked_copy(one_thread, monkeypatch):
    """NF4 bases: grouped == alone (to 1e-5), dequantized each call or read from dequant_cache's stacked buffer,
    which holds each base's kept copy as a row slice (no dequantization and no copy while it is kept)."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    from test_dequant_cache import four_bit

    import nbkit.speedups.fused_lora as lora
    from nbkit.speedups.dequant_cache import DEQUANTIZED, STACKED, DequantCache

    torch.manual_seed(0)
    model = add_lora(four_bit(_Layer()), targets=list(PROJECTIONS), random_b=0.5)
    x = torch.randn(3, 5, 32)
    alone = _run(model, x, FusedLoRA())
    assert_same_tensors(_run(model, x, FusedLoRA(groups=True)), alone, Tol(scaled=1e-5), where="dequantized")
    cache = DequantCache(mode=True)
    assert cache.attach(model) and cache.before_micro_batch(2) > 0
    layer = model.base_model.model
    stack = vars(layer.q_proj.base_layer)[STACKED]
    assert stack.shape == (80, 32) and vars(layer.v_proj.base_layer)[STACKED] is stack
    assert vars(layer.k_proj.base_layer)[DEQUANTIZED].data_ptr() == stack[48:].data_ptr()
    calls = [0]
    monkeypatch.setattr(lora, "dequantize", lambda *a: calls.__setitem__(0, calls[0] + 1))
    monkeypatch.setattr(lora, "dequantize_into", lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        kept = _run(model, x, FusedLoRA(groups=True))
    finally:
        cache.detach()
    assert calls[0] == 0
    assert_same_tensors(kept, alone, Tol(scaled=1e-5), where="kept")
    assert STACKED not in vars(layer.q_proj.base_layer)


def test_fastsft_losses_with_and_without_groups(tmp_path, one_thread, monkeypatch):
    """A whole FastSFT run (fp32, gradient checkpointing): the groups run (counted), and train as the layers alone."""
    import nbkit.speedups.fused_lora as lora
    from nbkit.demo.data import make_dataset

    data = make_dataset("messages", n=64, split="train", seed=0)
    calls = [0]
    real = lora.grouped_lora_linear

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(lora, "grouped_lora_linear", counted)

    def run(groups: bool):
        calls[0] = 0
        trainer = fast_sft(tmp_path / str(groups), dataset=data, max_steps=3, per_device_train_batch_size=4,
                           learning_rate=3e-3, max_length=128, gradient_checkpointing=True, lora_groups=groups,
                           lora=lora_config(r=8))
        losses = train(trainer).losses
        layer = trainer.model.base_model.model.model.layers[0]
        assert all("forward" not in m.__dict__ for m in layer.modules())  # detached after train()
        return losses, calls[0]

    (grouped, grouped_calls), (alone, alone_calls) = run(True), run(False)
    assert grouped_calls > 0 and alone_calls == 0
    assert len(grouped) == 3
    assert_same_series(grouped[:1], alone[:1], Tol(rtol=1e-6))
    assert_same_series(grouped[1:], alone[1:], Tol(rtol=1e-4))
