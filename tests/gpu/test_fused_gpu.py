"""Fused LoRA (4-bit and bf16 bases) and Liger's fused kernels against the plain modules on a CUDA GPU in bf16.

Tolerances (bf16; both sides round differently): outputs within 2e-2 and gradients within 5e-2 of the largest
value (relative max error); the fused kernels compute in fp32 inside one kernel, the plain chains round at each op.
nbkit's frozen-weight RMSNorm against Liger's (the same math, in fp32 inside one kernel each): outputs and input
gradients within 1e-2 of the largest value and at least 95% of the outputs equal.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
@pytest.mark.parametrize("frozen_norms", [False, True])
def test_liger_kernels_match_plain_modules(family, frozen_norms, monkeypatch):
    pytest.importorskip("liger_kernel")
    from nbkit.demo.models import tiny_model
    from nbkit.speedups.fused_kernels import FusedKernels

    model = tiny_model(family, 512, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64).cuda().train()
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    if frozen_norms:  # as under LoRA: the norms go to nbkit.ops.rms_norm
        for name, p in model.named_parameters():
            p.requires_grad_("norm" not in name)
    from nbkit.speedups import fused_kernels

    frozen_calls = []
    monkeypatch.setattr(fused_kernels, "rms_norm", lambda *a: frozen_calls.append(1) or fused_kernels_rms_norm(*a))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return [out.logits.detach()] + [p.grad.clone() for _, p in sorted(model.named_parameters())
                                        if p.requires_grad]

    plain = run()
    speedup = FusedKernels()
    assert speedup.attach(model) and speedup.kernel == "liger", speedup.counts
    try:
        fused = run()
    finally:
        speedup.detach()
    assert _rel(fused[0], plain[0]) <= 2e-2
    worst = max(_rel(a, b) for a, b in zip(fused[1:], plain[1:]))
    print(family, speedup.counts, "worst grad rel err", worst)
    assert worst <= 5e-2
    assert bool(frozen_calls) == frozen_norms  # frozen norms, and only they, ran nbkit's kernel


def fused_kernels_rms_norm(*args):
    from nbkit.ops.rms_norm import rms_norm

    return rms_norm(*args)


@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("rows,width", [(2048, 2048), (2048 * 16, 128), (4096 * 8, 128), (1000, 5120), (3, 96)])
def test_frozen_weight_rms_norm_matches_liger_and_transformers(casting, offset, rows, width):
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers.functional import liger_rms_norm

    from nbkit.ops.rms_norm import rms_norm, rms_norm_ref

    torch.manual_seed(0)
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 3
    dy = torch.randn_like(x)
    for w_dtype in (torch.bfloat16, torch.float32):
        w = (torch.rand(width, device="cuda") + 0.5 - offset).to(w_dtype)
        outs = []
        for op, extra in ((rms_norm, ()), (liger_rms_norm, (False,)), (rms_norm_ref, ())):
            xx = x.clone().requires_grad_(True)
            y = op(xx, w, 1e-6, offset, casting, *extra)
            y.backward(dy)
            outs.append((y.detach(), xx.grad))
        (y, dx), (liger_y, liger_dx), (ref_y, ref_dx) = outs
        assert y.dtype == x.dtype and dx.dtype == x.dtype
        assert _rel(y, liger_y) <= 1e-2 and _rel(dx, liger_dx) <= 1e-2
        assert (y == liger_y).float().mean().item() >= 0.95
        assert _rel(y, ref_y) <= 2e-2 and _rel(dx, ref_dx) <= 5e-2


@pytest.mark.parametrize("four_bit", [True, False])
def test_fused_lora_matches_peft(four_bit):
    from peft import LoraConfig, get_peft_model

    from nbkit.speedups.fused_lora import FusedLoRA

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(1024, 2816, bias=False), nn.SiLU(), nn.Linear(2816, 1024, bias=False))
    if four_bit:
        import bitsandbytes as bnb

        for i in (0, 2):
            lin = block[i]
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                                  quant_type="nf4", compress_statistics=True)
            q.weight = bnb.nn.Params4bit(lin.weight.data.to(torch.bfloat16), requires_grad=False, quant_type="nf4",
                                         compress_statistics=True, module=q)
            block[i] = q
    block = block.to(device="cuda", dtype=torch.bfloat16) if not four_bit else block.cuda()
    model = get_peft_model(block, LoraConfig(r=16, lora_alpha=32, target_modules=["0", "2"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    x0 = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)

    def run(fused: bool):
        speedup = FusedLoRA()
        if fused:
            assert speedup.attach(model) and speedup.fused_layers == 2
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(x)
            y.float().square().mean().backward()
        finally:
            speedup.detach()
        return [y.detach(), x.grad] + [p.grad for _, p in sorted(model.named_parameters()) if p.requires_grad]

    plain, fused = run(False), run(True)
    assert _rel(fused[0], plain[0]) <= 2e-2
    for a, b in zip(fused[1:], plain[1:]):
        assert _rel(a, b) <= 5e-2


class _Projections(nn.Module):
    """One decoder layer's projections at Qwen3-1.7B's widths: q/k/v of the normed input, gate/up of another."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(2048, n, bias=False) for n in (2048, 1024, 1024))
        self.gate_proj, self.up_proj = nn.Linear(2048, 6144, bias=False), nn.Linear(2048, 6144, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        h = qkv[..., :2048] + qkv[..., 2048:3072].repeat(1, 2) * qkv[..., 3072:].repeat(1, 2)
        return torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h)


@pytest.mark.parametrize("cached", [False, True])
def test_lora_groups_match_each_alone_and_peft(cached):
    """4-bit bases in bf16 at 4,096 tokens: the groups (dequantized each call, or dequant_cache's stacked copy)
    against each layer alone (outputs within 1e-2, gradients within 2e-2: the same products summed in another order)
    and PEFT (the tolerances above)."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model

    from nbkit.speedups.dequant_cache import DequantCache
    from nbkit.speedups.fused_lora import FusedLoRA

    torch.manual_seed(0)
    block = _Projections()
    for name, lin in list(block.named_children()):
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                              quant_type="nf4", compress_statistics=True)
        q.weight = bnb.nn.Params4bit(lin.weight.data.to(torch.bfloat16), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True, module=q)
        setattr(block, name, q)
    model = get_peft_model(block.cuda(), LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    x0 = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    cache = DequantCache(mode=True, dtype=torch.bfloat16)
    if cached:
        assert cache.attach(model) and cache.before_micro_batch(2) > 0

    def run(speedup):
        if speedup is not None:
            assert speedup.attach(model)
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(x)
            y.float().square().mean().backward()
        finally:
            if speedup is not None:
                speedup.detach()
        return [y.detach(), x.grad] + [p.grad for _, p in sorted(model.named_parameters()) if p.requires_grad]

    try:
        grouped_lora = FusedLoRA(groups=True)
        grouped, alone, plain = run(grouped_lora), run(FusedLoRA()), run(None)
        assert [len(g.members) for g in grouped_lora.grouped] == [3, 2]
    finally:
        cache.detach()
    assert len(grouped) == 2 + 10
    assert _rel(grouped[0], alone[0]) <= 1e-2 and _rel(grouped[0], plain[0]) <= 2e-2
    for a, b, c in zip(grouped[1:], alone[1:], plain[1:]):
        assert _rel(a, b) <= 2e-2 and _rel(a, c) <= 5e-2
