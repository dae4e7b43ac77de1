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
