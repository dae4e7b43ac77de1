"""nbkit.speedups.fused_kernels wiring on CPU: which modules get the fused ops, that the model computes the same
function, and that ``detach`` restores everything (Liger's Triton kernels need a GPU: their numerics are
tests/gpu/test_fused_gpu.py).

The ops injected here are plain-torch versions of Liger's functional contract (casting modes 'llama' and 'gemma',
RMSNorm offset, SwiGLU, tanh-GeGLU, RoPE). Tolerance: fp32 outputs and gradients equal to 1e-5 relative.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from parity import Tol, assert_same_tensors, run_steps

from nbkit.demo.models import tiny_model
from nbkit.speedups.fused_kernels import FAMILIES, FusedKernels, KernelOps


def _rms_norm(x, w, eps, offset=0.0, casting_mode="llama", in_place=True):
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "gemma":
        return (y * (offset + w.float())).to(dtype)
    return (offset + w) * y.to(dtype)


def _rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


CALLS: dict[str, int] = {}


def _counting(name, fn):
    def wrapped(*args, **kwargs):
        CALLS[name] = CALLS.get(name, 0) + 1
        return fn(*args, **kwargs)

    return wrapped


OPS = KernelOps(
    rms_norm=_counting("rms_norm", _rms_norm),
    swiglu=_counting("swiglu", lambda a, b: torch.nn.functional.silu(a) * b),
    geglu=_counting("geglu", lambda a, b: torch.nn.functional.gelu(a, approximate="tanh") * b),
    rope=_counting("rope", _rope),
    source="reference",
)


def _forward_backward(model, ids) -> dict[str, torch.Tensor]:
    """The logits and every parameter's gradient of one forward and backward."""
    kept = {}

    def forward(model, batch):
        out = model(**batch)
        kept["logits"] = out.logits.detach()
        return out.loss

    run = run_steps(model, [dict(input_ids=ids, labels=ids)], forward=forward)
    return {**kept, **run.grads[0]}


@pytest.mark.parametrize("family,gate", [("qwen3", "swiglu"), ("llama", "swiglu"), ("gemma2", "geglu")])
def test_same_function_and_detach_restores(family, gate, one_thread):
    model = tiny_model(family, 256).train()
    ids = torch.randint(0, 256, (2, 24))
    plain = _forward_backward(model, ids)
    modeling = importlib.import_module(type(model).__module__)
    original_rope = modeling.apply_rotary_pos_emb
    speedup = FusedKernels(ops=OPS)
    CALLS.clear()
    assert speedup.attach(model)
    layers = model.config.num_hidden_layers
    assert speedup.counts[gate] == layers and speedup.counts["rms_norm"] >= 2 * layers + 1
    assert speedup.counts["rope"] == 1 and modeling.apply_rotary_pos_emb is not original_rope
    fused = _forward_backward(model, ids)
    assert CALLS["rope"] == layers and CALLS[gate] == layers and CALLS["rms_norm"] == speedup.counts["rms_norm"]
    speedup.detach()
    assert modeling.apply_rotary_pos_emb is original_rope
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert_same_tensors(fused, plain, Tol(scaled=1e-5))


def test_unknown_family_and_cpu_without_ops_do_not_attach():
    model = tiny_model("gpt_oss", 256)
    assert model.config.model_type not in FAMILIES
    assert not FusedKernels(ops=OPS).attach(model)
    assert not FusedKernels().attach(tiny_model("qwen3", 256))  # CPU: Liger's Triton kernels cannot run


def test_rope_left_alone_when_already_replaced():
    model = tiny_model("qwen3", 256)
    modeling = importlib.import_module(type(model).__module__)
    original = modeling.apply_rotary_pos_emb
    first, second = FusedKernels(ops=OPS), FusedKernels(ops=OPS)
    try:
        assert first.attach(model)
        patched = modeling.apply_rotary_pos_emb
        assert second.attach(model) and second.counts["rope"] == 0  # someone else's replacement is not stacked
        second.detach()
        assert modeling.apply_rotary_pos_emb is patched
    finally:
        first.detach()
    assert modeling.apply_rotary_pos_emb is original
