"""nbkit.ops.tiled_mlp against its reference (CPU).

Reference: the same MLP module called once on the whole input, differentiated by autograd (output, the input's
gradient, every trainable parameter's gradient). The MLP is Llama's ``down(silu(gate(x)) * up(x))`` in plain torch,
optionally with frozen base weights and trainable low-rank adapters (LoRA written out in torch). Tolerances: fp32
agrees to rtol 1e-5, atol 1e-6 (tiling only splits the parameters' gradient GEMMs into per-tile sums). bf16 agrees
to rtol 2^-7 with atol 2^-6 of the largest reference value: outputs and the input's gradient are the same per-row
bf16 math, but a weight's gradient is a sum of per-tile bf16 products in fp32 where the reference rounds one GEMM,
which differ by up to ~2 bf16 steps (2^-8) of the largest value. Memory is read from torch's profiler.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from nbkit.ops.tiled_mlp import tile_bounds, tiled_mlp

H, INTER, T = 12, 40, 13
FP32 = dict(rtol=1e-5, atol=1e-6)
BF16_RTOL = 2**-7


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable ``scale * B A`` (B not zero, so both adapters get gradients)."""

    def __init__(self, base: nn.Linear, rank: int = 3, scale: float = 2.0):
        super().__init__()
        self.base, self.scale = base.requires_grad_(False), scale
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


class LlamaLikeMLP(nn.Module):
    def __init__(self, lora: bool = False, dropout: float = 0.0, seed: int = 0, hidden: int = H, inter: int = INTER):
        super().__init__()
        torch.manual_seed(seed)
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        if lora:
            self.gate_proj, self.up_proj = LoRALinear(self.gate_proj), LoRALinear(self.up_proj)
            self.down_proj = LoRALinear(self.down_proj)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.dropout(F.silu(self.gate_proj(x)) * self.up_proj(x)))


def trainable(mlp: nn.Module) -> list[torch.Tensor]:
    return [p for p in mlp.parameters() if p.requires_grad]


def outputs_and_grads(mlp: nn.Module, x: torch.Tensor, run) -> list[torch.Tensor]:
    """[output, d x, d each trainable parameter] of ``run(mlp, x)`` against a fixed upstream gradient."""
    x = x.detach().requires_grad_(True)
    y = run(mlp, x)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.dtype)
    return [y.detach(), *torch.autograd.grad(y, [x, *trainable(mlp)], upstream)]


def plain(mlp, x):
    return mlp(x)


def tiled(**kw):
    return lambda mlp, x: tiled_mlp(mlp, x, trainable(mlp), **kw)


def inputs(shape, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)


def assert_bf16_close(got, ref):
    for a, e in zip(got, ref):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=BF16_RTOL, atol=2 * BF16_RTOL * e.abs().max().item())


TILINGS = [dict(tiles=1), dict(tiles=3), dict(tiles=T), dict(tile_tokens=5), dict(tile_tokens=64), dict()]


@pytest.mark.parametrize("kw", TILINGS, ids=lambda kw: str(kw) or "default")
@pytest.mark.parametrize("shape", [(2, T, H), (T, H)], ids=["BTH", "NH"])
def test_fp32_output_and_gradients_equal_the_plain_mlp(shape, kw):
    mlp, x = LlamaLikeMLP(), inputs(shape)
    got, ref = outputs_and_grads(mlp, x, tiled(**kw)), outputs_and_grads(mlp, x, plain)
    assert len(got) == 5
    for a, e in zip(got, ref):
        torch.testing.assert_close(a, e, **FP32)


def test_lora_adapters_on_frozen_weights_get_the_plain_gradients():
    mlp, x = LlamaLikeMLP(lora=True), inputs((2, T, H))
    got, ref = outputs_and_grads(mlp, x, tiled(tiles=4)), outputs_and_grads(mlp, x, plain)
    assert len(got) == 2 + 6  # output, d x, A and B of three layers
    for a, e in zip(got, ref):
        torch.testing.assert_close(a, e, **FP32)
    assert all(m.base.weight.grad is None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))


def test_bf16_output_and_gradients_match_the_plain_mlp_within_bf16_rounding():
    mlp, x = LlamaLikeMLP().to(torch.bfloat16), inputs((2, 40, H), torch.bfloat16)
    got, ref = outputs_and_grads(mlp, x, tiled(tile_tokens=7)), outputs_and_grads(mlp, x, plain)
    assert_bf16_close(got, ref)
    wrong = outputs_and_grads(mlp, x[:, :33], plain)  # negative control: the last tile's tokens left out
    with pytest.raises(AssertionError):
        assert_bf16_close(wrong[3:], ref[3:])


def test_recompute_runs_under_the_forwards_autocast():
    mlp, x = LlamaLikeMLP(), inputs((2, T, H))
    seen = []  # the dtype gate_proj computes in, at each call (forward tiles, then recompute tiles)
    mlp.gate_proj.register_forward_hook(lambda module, args, out: seen.append(out.dtype))

    def under_autocast(run):
        return lambda m, v: _autocast(run, m, v)

    got = outputs_and_grads(mlp, x, under_autocast(tiled(tiles=3)))  # backward runs outside autocast
    assert seen == [torch.bfloat16] * 6
    ref = outputs_and_grads(mlp, x, under_autocast(plain))
    assert got[0].dtype == torch.bfloat16
    assert_bf16_close(got, ref)


def _autocast(run, mlp, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return run(mlp, x)


def test_inside_non_reentrant_checkpoint_a_decoder_layer_gets_the_plain_gradients():
    mlp, x = LlamaLikeMLP(lora=True), inputs((2, T, H))
    norm = nn.RMSNorm(H)

    def layer(run):
        return lambda m, v: v + run(m, norm(v))

    def checkpointed(run):
        return lambda m, v: checkpoint(layer(run), m, v, use_reentrant=False)

    got = outputs_and_grads(mlp, x, checkpointed(tiled(tiles=3)))
    ref = outputs_and_grads(mlp, x, layer(plain))
    torch.testing.assert_close(got[0], ref[0], **FP32)
    for a, e in zip(got[1:], ref[1:]):  # the weights' gradients: sums over 3 tiles in another grouping, after the
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)  # norm's backward (seen: 1 element of 120 at 1e-4)


def test_dropout_masks_are_the_same_in_recompute_and_the_rng_moves_on_as_without_recompute():
    mlp, x = LlamaLikeMLP(dropout=0.5).train(), inputs((2, T, H))
    bounds = tile_bounds(T, tiles=3)

    def per_tile_with_graph(m, v):  # what tiled forward computes, drawing the same masks in the same order
        return torch.cat([m(v[:, s:e]) for s, e in bounds], dim=1)

    def then_draw(run):  # a draw between forward and backward, which the recompute must not rewind
        return lambda m, v: (run(m, v), torch.rand(3))[0]

    torch.manual_seed(5)
    ref = outputs_and_grads(mlp, x, then_draw(per_tile_with_graph))
    after_ref = torch.get_rng_state()
    torch.manual_seed(5)
    got = outputs_and_grads(mlp, x, then_draw(tiled(tiles=3)))
    assert torch.equal(torch.get_rng_state(), after_ref)  # recompute restored the RNG it borrowed
    for a, e in zip(got, ref):
        torch.testing.assert_close(a, e, **FP32)
    torch.manual_seed(5)
    unrestored = outputs_and_grads(mlp, x, tiled(tiles=3, preserve_rng_state=False))
    torch.testing.assert_close(unrestored[0], ref[0], **FP32)  # forward is the same ...
    assert not torch.allclose(unrestored[1], ref[1], rtol=0.1, atol=0.1)  # ... but recompute draws other masks


def test_a_token_mixing_forward_or_a_left_out_parameter_is_caught_by_the_comparison():
    mlp, x = LlamaLikeMLP(), inputs((2, T, H))
    mixing = lambda v: mlp(v.cumsum(dim=-2))  # breaks the pointwise contract
    got = outputs_and_grads(mlp, x, lambda m, v: tiled_mlp(mixing, v, trainable(m), tiles=3))
    ref = outputs_and_grads(mlp, x, lambda m, v: mixing(v))
    assert not torch.allclose(got[0], ref[0], **FP32)
    y = tiled_mlp(mlp, x.requires_grad_(True), [mlp.gate_proj.weight], tiles=3)
    y.sum().backward()
    assert mlp.gate_proj.weight.grad is not None and mlp.up_proj.weight.grad is None


def test_tile_bounds_cover_the_tokens_once_and_bad_arguments_are_errors():
    assert tile_bounds(13, tiles=3) == [(0, 4), (4, 8), (8, 13)]
    assert tile_bounds(13, tile_tokens=5) == [(0, 5), (5, 10), (10, 13)]
    assert tile_bounds(13, hidden=8) == [(0, 8), (8, 13)]
    assert tile_bounds(2, tiles=5) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="not both"):
        tile_bounds(13, tiles=2, tile_tokens=4)
    with pytest.raises(ValueError, match="at least 1"):
        tile_bounds(13, tiles=0)


def allocations(fn) -> tuple[int, int]:
    """(largest single allocation, peak bytes allocated above the start) while ``fn`` runs, from the profiler's
    memory events (their running total carries over from earlier profiling, so it is taken from the first event)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Bytes"] for e in events), max(e["Total Allocated"] for e in events) - start


def test_the_intermediate_activations_exist_for_one_tile_at_a_time():
    tokens, tile, hidden, inter = 2048, 128, 8, 256
    mlp, x = LlamaLikeMLP(hidden=hidden, inter=inter), inputs((tokens, hidden)).requires_grad_(True)
    full = tokens * inter * 4  # one (tokens x intermediate) fp32 activation
    largest, peak = allocations(lambda: tiled_mlp(mlp, x, trainable(mlp), tile_tokens=tile).sum().backward())
    assert largest < full / 4 and peak < full
    mlp.zero_grad(set_to_none=True)
    largest, peak = allocations(lambda: mlp(x).sum().backward())  # negative control: the plain MLP
    assert largest >= full and peak >= 3 * full
