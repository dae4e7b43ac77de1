"""Attention sinks on a flash-style varlen core (nbkit.ops.sink_attention) against the exact fp32 per-document loop.

The CPU has no flash kernel, so the tests give ``sink_attention`` a reference core with flash's contract: the forward
returns the output and the log-sum-exp over the keys; the backward recomputes P from that log-sum-exp and takes the
row term ``D = rowsum(grad * out)`` from the ``out`` it is handed, as flash's backward does. That is the property
the sink correction relies on (it hands the corrected output), so a core that ignored ``out`` would fail here.
Tolerance: fp32, 1e-5 relative to the largest value. The GPU test (tests/gpu/test_sink_attention_gpu.py) runs
torch's flash ops in bf16.
"""

from __future__ import annotations

import pytest
import torch

from nbkit.ops.reference_attention import AttnCall, doc_attention
from nbkit.ops.sink_attention import sink_attention


def _scores(q, k, scale, window):  # (n, Hq, D), (n, Hkv, D) -> (Hq, n, n) masked
    groups = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(groups, 1).transpose(0, 1)
    s = q.transpose(0, 1) @ kh.transpose(1, 2) * scale
    n = q.shape[0]
    i = torch.arange(n)
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok &= i[None, :] > i[:, None] - window
    return s.masked_fill(~ok, float("-inf")), groups


class ReferenceCore:
    """Flash's forward/backward contract in plain fp32 math, one document at a time."""

    def __init__(self) -> None:
        self.backward_outs: list[torch.Tensor] = []

    def forward(self, q, k, v, cu, max_len, scale, window):
        outs, lses = [], []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            s, groups = _scores(q[a:b], k[a:b], scale, window)
            lse = torch.logsumexp(s, -1)  # (H, n)
            p = torch.exp(s - lse[..., None])
            vh = v[a:b].repeat_interleave(groups, 1).transpose(0, 1)
            outs.append((p @ vh).transpose(0, 1))
            lses.append(lse)
        lse = torch.cat(lses, 1)  # (H, T), flash's layout
        return torch.cat(outs), lse.t(), (lse,)

    def backward(self, grad, q, k, v, out, state, cu, max_len, scale, window):
        self.backward_outs.append(out)
        (lse,) = state
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            s, groups = _scores(q[a:b], k[a:b], scale, window)
            p = torch.exp(s - lse[:, a:b, None])
            g, o = grad[a:b].transpose(0, 1), out[a:b].transpose(0, 1)  # (H, n, D)
            vh = v[a:b].repeat_interleave(groups, 1).transpose(0, 1)
            kh = k[a:b].repeat_interleave(groups, 1).transpose(0, 1)
            dvh = p.transpose(1, 2) @ g
            dp = g @ vh.transpose(1, 2)
            ds = p * (dp - (g * o).sum(-1, keepdim=True))
            dq[a:b] = (ds @ kh * scale).transpose(0, 1)
            dkh = (ds.transpose(1, 2) @ q[a:b].transpose(0, 1) * scale)
            hkv = k.shape[1]
            dk[a:b] = dkh.reshape(hkv, groups, *dkh.shape[1:]).sum(1).transpose(0, 1)
            dv[a:b] = dvh.reshape(hkv, groups, *dvh.shape[1:]).sum(1).transpose(0, 1)
        return dq, dk, dv


def _exact(q, k, v, sinks, cu, scale, window):
    call = AttnCall(scaling=scale, window=window, softcap=None, sinks=sinks, dropout=0.0)
    groups = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qh = q[a:b].transpose(0, 1)
        kh, vh = (x[a:b].repeat_interleave(groups, 1).transpose(0, 1) for x in (k, v))
        outs.append(doc_attention(qh, kh, vh, call, training=False).transpose(0, 1))
    return torch.cat(outs)


def _rel(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_matches_exact_loop(window, hq, hkv):
    torch.manual_seed(0)
    lengths = [7, 1, 12, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    t, d = sum(lengths), 8
    q = torch.randn(t, hq, d, requires_grad=True)
    k = torch.randn(t, hkv, d, requires_grad=True)
    v = torch.randn(t, hkv, d, requires_grad=True)
    sinks = torch.randn(hq, requires_grad=True)
    weight = torch.randn(t, hq, d)
    core = ReferenceCore()
    out = sink_attention(q, k, v, sinks, cu, max(lengths), d ** -0.5, window, core=core)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v, sinks))
    ref = _exact(q, k, v, sinks, cu, d ** -0.5, window)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v, sinks))
    assert _rel(out, ref) <= 1e-5
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) <= 1e-5
    # the backward was handed the sink-corrected output, not the plain one
    assert torch.allclose(core.backward_outs[0], out.detach())


def test_sinks_change_the_result():
    """A sink that takes most of the mass shrinks the output: the test above would notice a dropped sink."""
    torch.manual_seed(1)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    q, k, v = (torch.randn(6, 2, 4) for _ in range(3))
    low = sink_attention(q, k, v, torch.full((2,), -30.0), cu, 6, 0.5, core=ReferenceCore())
    high = sink_attention(q, k, v, torch.full((2,), 30.0), cu, 6, 0.5, core=ReferenceCore())
    assert high.abs().max() < 1e-6 * low.abs().max()


class _PlainOutCore(ReferenceCore):
    """A core that ignores the output it is handed (uses its own plain one): wrong gradients for sinks."""

    def forward(self, q, k, v, cu, max_len, scale, window):
        out, lse, state = super().forward(q, k, v, cu, max_len, scale, window)
        return out, lse, (state[0], out)

    def backward(self, grad, q, k, v, out, state, cu, max_len, scale, window):
        return super().backward(grad, q, k, v, state[1], state[:1], cu, max_len, scale, window)


@pytest.mark.parametrize("core,ok", [(ReferenceCore, True), (_PlainOutCore, False)])
def test_probe_tells_a_right_core_from_a_wrong_one(monkeypatch, core, ok):
    import nbkit.ops.sink_attention as sa

    monkeypatch.setattr(sa, "aten_flash_core", core())
    gen = torch.Generator().manual_seed(0)
    lengths, hq, hkv, d = (40, 24), 4, 2, 64
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), h, d, generator=gen).requires_grad_() for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen).requires_grad_()
    reason = sa._compare(q, k, v, sinks, cu, lengths, hq, hkv, d)
    assert (reason is None) == ok, reason
