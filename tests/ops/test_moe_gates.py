"""nbkit.ops.moe_gates against its references (CPU, fp32).

References: the plain formulas as the model families write them (SwiGLU ``silu(gate) * up`` on concatenated
halves; gpt-oss's clamped gate on interleaved columns), differentiated by autograd. The torch twin (forward and
its hand-written backward) agrees with them to rtol 1e-4, atol 1e-5, with pre-activations that cross gpt-oss's
clamps; ``gate_activation`` adds the per-expert bias, and experts with no rows get an exactly zero bias gradient.
The Triton kernels are checked against the torch twin under TRITON_INTERPRET=1 (a subprocess: the interpreter must
be on before triton is imported), at the same tolerance, and compiled for sm_90 without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nbkit.ops import moe_gates
from nbkit.ops.moe_gates import GATES, gate_activation, gate_backward, gate_forward
from tests.ops.triton_checks import compile_for_sm90, ptrs, run_interpreted

TOL = dict(rtol=1e-4, atol=1e-5)
ALPHA, LIMIT = 1.702, 1.0  # gpt-oss's alpha; a limit that pre-activations of N(0, 1.5) cross often
S, N, E = 17, 24, 5
EMPTY = 3  # an expert with no rows


def plain_gate(z: torch.Tensor, kind: str) -> torch.Tensor:
    """The formula as transformers writes it (Qwen3-MoE / Mixtral ``act_fn(gate) * up``; GptOssExperts)."""
    if kind == "swiglu":
        gate, up = z.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate, up = z[..., ::2], z[..., 1::2]
    gate = gate.clamp(min=None, max=LIMIT)
    up = up.clamp(min=-LIMIT, max=LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


def _expert_ids(rows: int = S) -> torch.Tensor:
    ids = torch.arange(rows) % (E - 1)
    return torch.sort(torch.where(ids >= EMPTY, ids + 1, ids)).values  # sorted, never EMPTY


def _inputs(n: int = N, rows: int = S, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, 2 * n, generator=g) * 1.5).requires_grad_(True)
    upstream = torch.randn(rows, n, generator=g)
    return z, upstream


@pytest.mark.parametrize("kind", GATES)
def test_torch_twin_equals_the_plain_formula_and_its_autograd_gradient(kind):
    z, upstream = _inputs()
    ref = plain_gate(z, kind)
    (ref_dz,) = torch.autograd.grad(ref, z, upstream)
    if kind == "gptoss":  # the inputs do cross both clamps
        assert (z[:, 0::2] > LIMIT).any() and (z[:, 1::2].abs() > LIMIT).any()
    torch.testing.assert_close(gate_forward(z.detach(), kind, ALPHA, LIMIT), ref.detach(), **TOL)
    torch.testing.assert_close(gate_backward(z.detach(), upstream, kind, ALPHA, LIMIT), ref_dz, **TOL)


def gate_case(kind: str, with_bias: bool, use_triton: bool, n: int = N) -> list[torch.Tensor]:
    """[h, d gu, (d bias)] of ``gate_activation`` on sorted rows, one expert left empty."""
    gu, upstream = _inputs(n)
    ids = _expert_ids()
    bias = (torch.randn(E, 2 * n, generator=torch.Generator().manual_seed(1)) * 0.5).requires_grad_(True)
    inputs = [gu, bias] if with_bias else [gu]
    h = gate_activation(gu, bias if with_bias else None, ids, E, kind, ALPHA, LIMIT, use_triton)
    return [h, *torch.autograd.grad(h, inputs, upstream)]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kind", GATES)
def test_gate_activation_equals_the_formula_on_biased_rows(kind, with_bias):
    got = gate_case(kind, with_bias, use_triton=False)
    gu, upstream = _inputs()
    ids = _expert_ids()
    bias = (torch.randn(E, 2 * N, generator=torch.Generator().manual_seed(1)) * 0.5).requires_grad_(True)
    inputs = [gu, bias] if with_bias else [gu]
    ref = plain_gate(gu + bias[ids] if with_bias else gu, kind)
    ref = [ref, *torch.autograd.grad(ref, inputs, upstream)]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)
    if with_bias:
        assert torch.count_nonzero(got[2][EMPTY]) == 0


def test_an_unknown_gate_is_refused():
    gu, _ = _inputs()
    with pytest.raises(ValueError):
        gate_activation(gu, None, _expert_ids(), E, "geglu")


_TRITON_SCRIPT = """
import torch
from tests.ops.test_moe_gates import gate_case
for kind in ("swiglu", "gptoss"):
    for with_bias, n in ((True, 24), (False, 24), (True, 1030)):  # 1030: two column blocks
        for a, b in zip(gate_case(kind, with_bias, True, n), gate_case(kind, with_bias, False, n)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
print("GATES_TRITON_OK")
"""


def test_triton_gate_kernels_equal_the_torch_twin_interpreted():
    run_interpreted(_TRITON_SCRIPT, "GATES_TRITON_OK")


def test_gate_kernels_compile_for_h100_class_gpus(tmp_path, monkeypatch):
    """Each kernel compiles to a cubin for sm_90 (the H200), without a GPU: catches compile-only errors."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    scalars = {"n_cols": "i32", "alpha": "fp32", "limit": "fp32"}
    fwd = {**ptrs(["gu_ptr", "bias_ptr"], "*bf16"), "eid_ptr": "*i64", "h_ptr": "*bf16", **scalars}
    bwd = {**ptrs(["gu_ptr", "bias_ptr"], "*bf16"), "eid_ptr": "*i64", **ptrs(["gh_ptr", "dgu_ptr"], "*bf16"),
           **scalars}
    cases = [(fn, sig, {"GPTOSS": gptoss, "HAS_BIAS": True, "BLOCK": 1024})
             for fn, sig in ((moe_gates.gate_fwd_kernel, fwd), (moe_gates.gate_bwd_kernel, bwd))
             for gptoss in (True, False)]
    compile_for_sm90(cases, str(tmp_path))
