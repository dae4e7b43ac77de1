"""Fused LoRA (4-bit and bf16 bases) and Liger's fused kernels against the plain modules on a CUDA GPU in bf16.

Tolerances (bf16; both sides round differently): outputs within 2e-2 and gradients within 5e-2 of the largest
value (relative max error); the fused kernels compute in fp32 inside one kernel, the plain chains round at each op.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_liger_kernels_match_plain_modules(family):
    pytest.importorskip("liger_kernel")
    from nbkit.demo.models import tiny_model
    from nbkit.speedups.fused_kernels import FusedKernels

    model = tiny_model(family, 512, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64).cuda().train()
    ids = torch.randint(0, 512, (2, 256), device="cuda")

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return [out.logits.detach()] + [p.grad.clone() for _, p in sorted(model.named_parameters())]

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
