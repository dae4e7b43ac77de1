"""GPU tests for nbkit.speedups.moe (bf16 on CUDA): parity (full fine-tune, LoRA on experts), no host sync in the
grouped path, empty experts.

Tolerance: for every output and gradient, the relative error ``||a - ref|| / ||ref||`` against an fp32 reference
(the eager experts on fp32 copies of the same weights) is below 5e-2, and no more than 1.5x (+2e-3) the error of
transformers' own bf16 experts path on the same inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from nbkit.speedups import moe
from nbkit.speedups.moe import FastMoERouting

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
T, H, INTER, E = 2048, 256, 384, 16


def _experts(family: str, top_k: int) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt_oss":
        m = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                                       num_experts_per_tok=top_k))
    else:
        m = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E,
                                           num_experts_per_tok=top_k))
    for p in m.parameters():
        nn.init.normal_(p, std=0.06)  # gate/up pre-activations of about one unit
    if family == "gpt_oss":
        m.limit = 2.0  # so that gpt-oss's clamps are crossed by a few percent of the units
    return m.to(DEV)


class _Holder(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts


def _routing(top_k, index=None):
    torch.manual_seed(1)
    x = torch.randn(T, H, device=DEV)
    logits = torch.randn(T, E, device=DEV)
    if index is None:
        index = logits.topk(top_k, dim=-1).indices
    return x, logits, index


def _run(experts, impl, x, logits, index, dtype):
    """Forward + backward in ``dtype``; returns [out, dx, dlogits, *dparams] in fp32."""
    experts.config._experts_implementation = impl
    x = x.to(dtype).requires_grad_(True)
    logits = logits.to(dtype).requires_grad_(True)
    weights = logits.gather(1, index).softmax(-1)
    out = experts(x, index, weights)
    probe = torch.linspace(-1, 1, out.numel(), device=DEV).view_as(out).to(dtype)
    params = [p for p in experts.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * probe).sum(), [x, logits, *params])
    return [t.float() for t in (out, *grads)]


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _check(got, ref, baseline, what):
    for i, (g, r, b) in enumerate(zip(got, ref, baseline)):
        err, base_err = _rel(g, r), _rel(b, r)
        assert err < 5e-2 and err <= 1.5 * base_err + 2e-3, f"{what}[{i}]: nbkit {err:.2e}, transformers {base_err:.2e}"


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("backend", ["auto", "loop"])
@pytest.mark.parametrize("top_k", [1, 4])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_bf16_parity(family, top_k, backend, kernels):
    """bf16 outputs and grads (hidden, router, experts) vs an fp32 reference, grouped and slice backends."""
    moe.register()
    x, logits, index = _routing(top_k)
    ref_mod = _experts(family, top_k)
    ref = _run(ref_mod, "eager", x, logits, index, torch.float32)
    mod = copy.deepcopy(ref_mod).to(torch.bfloat16)
    baseline = _run(mod, "grouped_mm", x, logits, index, torch.bfloat16)
    fm = FastMoERouting(backend=backend, kernels=kernels)
    assert fm.attach(_Holder(mod))
    plan = mod._nbkit_moe_plan
    assert plan.backend == ("grouped" if backend == "auto" else "loop")
    got = _run(mod, "nbkit", x, logits, index, torch.bfloat16)
    fm.detach()
    _check(got, ref, baseline, f"{family} top{top_k} {backend}/{plan.backend} kernels={kernels}")


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_grouped_path_has_no_host_sync(family, lora):
    """The grouped path runs forward and backward under sync debug mode 'error': full fine-tune (expert weight
    and bias grads) and LoRA r=16 through the PEFT bypass."""
    from peft import LoraConfig, inject_adapter_in_model

    moe.register()
    holder = _Holder(_experts(family, 4).to(torch.bfloat16))
    if lora:
        cfg = LoraConfig(r=16, lora_alpha=32, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        holder = inject_adapter_in_model(cfg, holder)
    fm = FastMoERouting()
    assert fm.attach(holder) and bool(fm.lora_bypassed) == lora
    plan = (holder.experts.get_base_layer() if lora else holder.experts)._nbkit_moe_plan
    assert plan.backend == "grouped" and plan.triton
    x, logits, index = _routing(4)
    x = x.bfloat16().requires_grad_(True)
    logits = logits.bfloat16().requires_grad_(True)
    for _ in range(2):  # the first call also compiles the Triton kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = holder.experts(x, index, logits.gather(1, index).softmax(-1))
            out.float().square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is not None for p in holder.parameters() if p.requires_grad)
    fm.detach()


def test_empty_experts_get_zero_grads_grouped():
    """grouped_mm's weight gradient for experts with no rows is exactly zero (no stale memory)."""
    moe.register()
    mod = _experts("qwen3_moe", 2).to(torch.bfloat16)
    fm = FastMoERouting()
    assert fm.attach(_Holder(mod)) and mod._nbkit_moe_plan.backend == "grouped"
    pairs = torch.tensor([[0, 3], [3, 9], [9, 0]], device=DEV)
    index = pairs[torch.randint(0, 3, (T,), device=DEV)]
    x, logits, _ = _routing(2)
    # trash the allocator's free memory first, so stale values would show
    junk = torch.full((64, 2**20), float("nan"), device=DEV)
    del junk
    got = _run(mod, "nbkit", x, logits, index, torch.bfloat16)
    fm.detach()
    unused = [e for e in range(E) if e not in (0, 3, 9)]
    for g in got[3:]:
        assert torch.count_nonzero(g[unused]) == 0
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("r", [16, 12])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_lora_bf16_matches_peft(family, r):
    """LoRA on both expert tensors: nbkit (separate low-rank products on the sorted rows) vs PEFT's parametrization
    path, bf16 (out, dx, LoRA A/B grads); r=12 is zero-padded to rank 16 for grouped_mm."""
    from peft import LoraConfig, inject_adapter_in_model

    moe.register()
    x, logits, index = _routing(4)
    results = {}
    for name in ("peft_fp32", "peft_bf16", "nbkit"):
        dtype = torch.float32 if name == "peft_fp32" else torch.bfloat16
        holder = _Holder(_experts(family, 4))
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        holder = inject_adapter_in_model(cfg, holder)
        torch.manual_seed(2)
        for n, p in holder.named_parameters():
            if "lora_B" in n:
                nn.init.normal_(p, std=0.02)
        holder = holder.to(dtype)
        experts = holder.experts.get_base_layer()
        experts.config._experts_implementation = "grouped_mm" if dtype == torch.bfloat16 else "eager"
        fm = FastMoERouting()
        if name == "nbkit":
            assert fm.attach(holder) and fm.lora_bypassed == 1
        xx = x.to(dtype).requires_grad_(True)
        out = holder.experts(xx, index, logits.gather(1, index).softmax(-1).to(dtype))
        probe = torch.linspace(-1, 1, out.numel(), device=DEV).view_as(out).to(dtype)
        factors = [p for n, p in holder.named_parameters() if "lora_" in n]
        grads = torch.autograd.grad((out * probe).sum(), [xx, *factors])
        results[name] = [t.float() for t in (out, *grads)]
        fm.detach()
    _check(results["nbkit"], results["peft_fp32"], results["peft_bf16"], f"lora {family} r={r}")
