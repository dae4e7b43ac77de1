"""nbkit.ops.moe_routing against its references (CPU, fp32).

References: ``torch.bincount``/``argsort`` for the route; a per-row matmul with gathered expert weights for
``experts_linear`` and ``add_lora``; plain indexing and a weighted sum for ``dispatch``/``combine``. Values and
gradients agree to rtol 1e-4, atol 1e-5; experts with no rows get exactly zero weight gradients. The Triton combine
kernels are checked against the torch twin under TRITON_INTERPRET=1 (a subprocess: the interpreter must be on
before triton is imported), at the same tolerance, and compiled for sm_90 without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from nbkit.ops import moe_routing
from nbkit.ops.moe_routing import add_lora, combine, dispatch, experts_linear, route
from tests.ops.triton_checks import compile_for_sm90, ptrs, run_interpreted

TOL = dict(rtol=1e-4, atol=1e-5)
T, K, E = 13, 2, 6
EMPTY = (2, 5)  # experts no token is routed to


def _index(tokens: int = T, top_k: int = K, seed: int = 0) -> torch.Tensor:
    """(tokens, top_k) distinct experts per token, never those in ``EMPTY``."""
    used = torch.tensor([e for e in range(E) if e not in EMPTY])
    g = torch.Generator().manual_seed(seed)
    return torch.stack([used[torch.randperm(len(used), generator=g)[:top_k]] for _ in range(tokens)])


def _grads(out, inputs):
    probe = torch.linspace(-1, 1, out.numel()).view_as(out)
    return torch.autograd.grad((out * probe).sum(), inputs)


def _assert_close_all(got, ref):
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("host_counts", [False, True])
def test_route_sorts_assignments_by_expert_and_offsets_end_each_slice(host_counts):
    index = _index()
    r = route(index, E, host_counts=host_counts)
    flat = index.reshape(-1)
    assert torch.equal(r.flat_e, flat)
    assert torch.equal(r.perm, torch.argsort(flat, stable=True))
    assert torch.equal(r.sorted_e, flat[r.perm])
    assert torch.equal(r.inv_perm[r.perm], torch.arange(flat.numel()))
    assert torch.equal(r.token_idx, r.perm // K)
    counts = torch.bincount(flat, minlength=E)
    assert torch.equal(r.offs.long(), counts.cumsum(0)) and r.offs.dtype == torch.int32
    assert r.counts == (counts.tolist() if host_counts else None)


def _reference_linear(x, w, r, trans):
    w_rows = w[r.sorted_e]  # (S, ., .)
    return torch.einsum("sn,smn->sm" if trans else "sn,snm->sm", x, w_rows)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_experts_linear_equals_a_matmul_per_row_with_its_experts_weight(backend, trans):
    torch.manual_seed(0)
    r = route(_index(), E, host_counts=backend == "loop")
    x = torch.randn(T * K, 8, requires_grad=True)
    w = (torch.randn(E, 16, 8) if trans else torch.randn(E, 8, 16)).requires_grad_(True)  # (E, out, in) / (E, in, out)
    ref = _reference_linear(x, w, r, trans)
    got = experts_linear(x, w, r, trans)
    torch.testing.assert_close(got, ref, **TOL)
    grads = _grads(got, [x, w])
    _assert_close_all(grads, _grads(ref, [x, w]))
    assert torch.count_nonzero(grads[1][list(EMPTY)]) == 0


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_experts_linear_with_a_frozen_weight_still_gives_the_input_gradient(backend):
    torch.manual_seed(0)
    r = route(_index(), E, host_counts=backend == "loop")
    x = torch.randn(T * K, 8, requires_grad=True)
    w = torch.randn(E, 8, 16)
    (dx,) = _grads(experts_linear(x, w, r, False), [x])
    torch.testing.assert_close(dx, _grads(_reference_linear(x, w, r, False), [x])[0], **TOL)


@pytest.mark.parametrize("rank", [3, 8])
@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_add_lora_equals_the_low_rank_formula_per_row(backend, rank):
    """``y + scaling * (x A_e^T) B_e^T``; rank 3 is zero-padded on the grouped backend, with the same numbers."""
    torch.manual_seed(0)
    r = route(_index(), E, host_counts=backend == "loop")
    x = torch.randn(T * K, 8, requires_grad=True)
    w = torch.randn(E, 16, 8)
    A = torch.randn(E, rank, 8, requires_grad=True)
    B = torch.randn(E, 16, rank, requires_grad=True)
    got = add_lora(experts_linear(x, w, r, True), x, [(A, B, 0.5)], r)
    u = torch.einsum("sn,srn->sr", x, A[r.sorted_e]) * 0.5
    ref = _reference_linear(x, w, r, True) + torch.einsum("sr,smr->sm", u, B[r.sorted_e])
    torch.testing.assert_close(got, ref, **TOL)
    _assert_close_all(_grads(got, [x, A, B]), _grads(ref, [x, A, B]))


def dispatch_combine_case(use_triton: bool, n: int, with_bias: bool, top_k: int = K) -> list[torch.Tensor]:
    """Outputs and gradients of ``dispatch`` and ``combine`` on one routing: [xs, out, dx, dy, dw, (dbias)]."""
    torch.manual_seed(0)
    r = route(_index(top_k=top_k), E, host_counts=False)
    x = torch.randn(T, n, requires_grad=True)
    y = torch.randn(T * top_k, n, requires_grad=True)
    w = torch.rand(T * top_k, requires_grad=True)
    bias = torch.randn(E, n, requires_grad=True) if with_bias else None
    xs = dispatch(x, r, use_triton)
    out = combine(y, w, bias, r, use_triton)
    (dx,) = _grads(xs, [x])
    rest = _grads(out, [y, w] + ([bias] if with_bias else []))
    return [xs, out, dx, *rest]


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dispatch_and_combine_equal_plain_indexing_and_a_weighted_sum(with_bias, top_k):
    got = dispatch_combine_case(False, 24, with_bias, top_k)
    torch.manual_seed(0)
    r = route(_index(top_k=top_k), E, host_counts=False)
    x = torch.randn(T, 24, requires_grad=True)
    y = torch.randn(T * top_k, 24, requires_grad=True)
    w = torch.rand(T * top_k, requires_grad=True)
    bias = torch.randn(E, 24, requires_grad=True) if with_bias else None
    xs = x[r.token_idx]
    rows = y[r.inv_perm] + (bias[r.flat_e] if with_bias else 0)  # assignment order
    out = (rows * w.unsqueeze(1)).view(T, top_k, 24).sum(1)
    ref = [xs, out, *_grads(xs, [x]), *_grads(out, [y, w] + ([bias] if with_bias else []))]
    _assert_close_all(got, ref)


_TRITON_SCRIPT = """
from tests.ops.test_moe_routing import dispatch_combine_case, _assert_close_all
for n, with_bias, top_k in ((24, True, 2), (24, False, 1), (1030, True, 2)):  # 1030: two column blocks
    _assert_close_all(dispatch_combine_case(True, n, with_bias, top_k), dispatch_combine_case(False, n, with_bias, top_k))
print("ROUTING_TRITON_OK")
"""


def test_triton_dispatch_and_combine_equal_the_torch_twin_interpreted():
    run_interpreted(_TRITON_SCRIPT, "ROUTING_TRITON_OK")


def test_combine_kernels_compile_for_h100_class_gpus(tmp_path, monkeypatch):
    """Each kernel compiles to a cubin for sm_90 (the H200), without a GPU: catches compile-only errors."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cases = [
        (moe_routing.unsort_sum_kernel, {"y_ptr": "*bf16", "inv_ptr": "*i64", **ptrs(["w_ptr", "bias_ptr"], "*bf16"),
                                         "eid_ptr": "*i64", "out_ptr": "*bf16", "n_cols": "i32"},
         {"K": 4, "HAS_W": True, "HAS_BIAS": True, "BLOCK": 1024}),
        (moe_routing.combine_bwd_kernel, {**ptrs(["g_ptr", "y_ptr"], "*bf16"), "tok_ptr": "*i64",
                                          **ptrs(["ws_ptr", "bias_ptr"], "*bf16"), "eid_ptr": "*i64",
                                          "gy_ptr": "*bf16", "gw_ptr": "*fp32"},
         {"n_cols": 2880, "HAS_BIAS": True, "NEED_GW": True, "BLOCK": 1024}),
    ]
    compile_for_sm90(cases, str(tmp_path))
