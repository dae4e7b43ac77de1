"""``ops.reference_attention.doc_attention``: exact against a dense fp64 formula, and its SDPA calls are ones the fused
kernels can take.

SDPA's flash and memory-efficient kernels (CUDA and CPU) accept 4-D inputs only; a 3-D call silently runs the math
kernel, which materializes the (n, n) scores: O(n^2) memory and several times the time (the T4 path and every CPU run
go through this function).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nbkit.ops.reference_attention import AttnCall, doc_attention


def _dense(q, k, v, allowed, scale):
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v.double()).to(q.dtype)


def _qkv(n, heads=4, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, n, dim, generator=g) for _ in range(3)]


@pytest.mark.parametrize("masked", [False, True])
def test_plain_sdpa_paths_equal_the_dense_formula(masked):
    n = 96
    q, k, v = _qkv(n)
    call = AttnCall(scaling=16**-0.5, window=None, softcap=None, sinks=None, dropout=0.0)
    i = torch.arange(n)
    causal = i[None, :] <= i[:, None]
    allowed = causal & ((i[:, None] < 40) == (i[None, :] < 40)) if masked else causal  # two documents
    out = doc_attention(q, k, v, call, training=False, allowed=allowed if masked else None)
    assert out.shape == q.shape
    torch.testing.assert_close(out, _dense(q, k, v, allowed, call.scaling), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_is_called_with_4d_inputs(monkeypatch, masked):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dim(), k.dim(), v.dim()))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = _qkv(32)
    call = AttnCall(scaling=0.25, window=None, softcap=None, sinks=None, dropout=0.0)
    allowed = torch.ones(32, 32, dtype=torch.bool).tril() if masked else None
    doc_attention(q, k, v, call, training=True, allowed=allowed)
    assert seen == [(4, 4, 4)]
