"""Attention sinks on torch's flash ops (nbkit.ops.sink_attention) on a CUDA GPU.

Tolerances (bf16 operands, relative error ||a - b|| / ||b||): the kernel's output and gradients (q, k, v, sinks)
within 2e-2 of the exact fp32 per-document loop; a packed tiny gpt-oss's logits no further from the fp32 truth
than 1.5x the plain path's distance + 2e-3 (plain = transformers' eager gpt-oss, each document alone).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_probe_passes_here():
    from nbkit.ops.sink_attention import sink_kernel_works

    works, reason = sink_kernel_works(torch.device("cuda"))
    assert works, reason


@pytest.mark.parametrize("window", [None, 128])
def test_bf16_matches_exact_fp32_loop_with_grads(window):
    from nbkit.ops.reference_attention import AttnCall, doc_attention
    from nbkit.ops.sink_attention import sink_attention

    torch.manual_seed(0)
    lens = [300, 17, 900, 64, 1]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    T, H, KV, D = sum(lens), 8, 2, 64
    q32, k32, v32 = (torch.randn(T, h, D, device="cuda") for h in (H, KV, KV))
    sinks32 = torch.randn(H, device="cuda")
    weight = torch.randn(T, H, D, device="cuda")

    leaves = [x.bfloat16().requires_grad_() for x in (q32, k32, v32)] + [sinks32.clone().requires_grad_()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # forward and backward: no host sync
    try:
        out = sink_attention(*leaves[:3], leaves[3], cu, max(lens), D**-0.5, window)
        grads = torch.autograd.grad((out.float() * weight).sum(), leaves)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    ref_leaves = [x.clone().requires_grad_() for x in (q32, k32, v32, sinks32)]
    q, k, v, sinks = ref_leaves
    call = AttnCall(scaling=D**-0.5, window=window, softcap=None, sinks=sinks, dropout=0.0)
    pieces = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kh, vh = (x[a:b].repeat_interleave(H // KV, 1).transpose(0, 1) for x in (k, v))
        pieces.append(doc_attention(q[a:b].transpose(0, 1), kh, vh, call, training=False).transpose(0, 1))
    ref = torch.cat(pieces)
    ref_grads = torch.autograd.grad((ref * weight).sum(), ref_leaves)
    assert _rel(out, ref) < 2e-2, _rel(out, ref)
    for name, a, b in zip("q k v sinks".split(), grads, ref_grads):
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))


def test_packed_gpt_oss_uses_varlen_and_matches_plain():
    from nbkit.demo.models import tiny_model
    from nbkit.ops.packed_boundaries import metadata_from_lengths
    from nbkit.speedups.packed_attention import PackedAttention

    lens = [300, 17, 200, 64]
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 512, (n,), generator=g) for n in lens]
    model = tiny_model("gpt_oss", 512, dtype=torch.bfloat16, attn_implementation="eager").cuda()
    truth_model = copy.deepcopy(model).float()
    with torch.no_grad():
        plain = torch.cat([model(input_ids=d[None].cuda()).logits[0] for d in docs])
        truth = torch.cat([truth_model(input_ids=d[None].cuda()).logits[0] for d in docs])
    speedup = PackedAttention(kernel="auto")
    assert speedup.attach(model)
    assert speedup.kernel == "varlen", speedup.kernel
    meta = metadata_from_lengths(lens)
    meta = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in meta.items()}
    with torch.no_grad():
        out = model(input_ids=torch.cat(docs)[None].cuda(), **meta).logits[0]
    speedup.detach()
    ours, theirs = _rel(out, truth), _rel(plain, truth)
    print(f"gpt_oss varlen+sinks vs fp32 truth: nbkit {ours:.2e}, plain eager {theirs:.2e}")
    assert ours <= 1.5 * theirs + 2e-3, (ours, theirs)
