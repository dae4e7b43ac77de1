"""nbkit.ops.rms_norm (frozen weight) against transformers' RMSNorm modules and against its torch twin (CPU).

The twin equals transformers' Qwen3 (llama casting) and Gemma2 (gemma casting, weight offset 1) norms exactly in
float32, forward and input gradient (autograd through the module). The Triton kernels are checked against the twin
under TRITON_INTERPRET=1 (a subprocess: the interpreter must be on before triton is imported): float32 within 2e-6
relative to the output's scale (another summation order), float16 within 2 units of the last place and at least
98% of the outputs equal (the same roundings, so llama's rounding before the weight is checked); rows that do
not fill a program's block, widths that are not powers of two, 3-D inputs; and compiled for sm_90 without a GPU.
bf16 against transformers' modules and against Liger's kernels on the GPU: tests/gpu/test_fused_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from nbkit.ops import rms_norm as R
from nbkit.speedups.fused_kernels import frozen_weight_first
from tests.ops.triton_checks import compile_for_sm90, ptrs, run_interpreted


def _modules(n: int):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    llama, gemma = Qwen3RMSNorm(n, eps=1e-6), Gemma2RMSNorm(n, eps=1e-6)
    with torch.no_grad():
        llama.weight.copy_(torch.randn(n) * 0.5 + 1)
        gemma.weight.copy_(torch.randn(n) * 0.5)
    return llama.requires_grad_(False), gemma.requires_grad_(False)


@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 128), (33, 2048)])
def test_twin_equals_transformers_norms_and_their_input_gradients(shape):
    llama, gemma = _modules(shape[-1])
    for module, casting, offset in ((llama, "llama", 0.0), (gemma, "gemma", 1.0)):
        x = (torch.randn(shape) * 3).requires_grad_(True)
        upstream = torch.randn(shape)
        plain = module(x)
        (plain_dx,) = torch.autograd.grad(plain, x, upstream)
        twin = R.rms_norm_ref(x, module.weight, 1e-6, offset, casting)
        (twin_dx,) = torch.autograd.grad(twin, x, upstream)
        torch.testing.assert_close(twin, plain, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(twin_dx, plain_dx, rtol=1e-5, atol=1e-6)


def test_off_triton_and_off_gpu_the_op_is_the_twin_and_bad_castings_are_refused():
    x, w = torch.randn(4, 16, requires_grad=True), torch.rand(16)
    assert torch.equal(R.rms_norm(x, w, 1e-5), R.rms_norm_ref(x, w, 1e-5))
    assert R.rms_norm(x, w, 1e-5).requires_grad
    with pytest.raises(ValueError, match="casting"):
        R.rms_norm(x, w, 1e-5, casting="none")


def test_the_dispatch_sends_frozen_weights_to_the_frozen_op_and_the_rest_to_liger():
    calls = []
    general = frozen_weight_first(lambda *a: calls.append(("general", a[3:])) or a[0],
                                  lambda *a: calls.append(("frozen", a[3:])) or a[0])
    x = torch.randn(2, 8)
    general(x, torch.ones(8), 1e-6, 0.0, "llama", False)
    general(x, torch.ones(8, requires_grad=True), 1e-6, 0.0, "llama", False)  # a trainable norm: Liger's, with dW
    general(x, torch.ones(8), 1e-6, 1.0, "gemma", True)
    general(x, torch.ones(8), 1e-6, 0.0, "none", False)  # a casting the frozen op does not have
    assert calls == [("frozen", (0.0, "llama")), ("general", (0.0, "llama", False)), ("frozen", (1.0, "gemma")),
                     ("general", (0.0, "none", False))]


_SCRIPT = """
import torch
from nbkit.ops import rms_norm as R

def close(a, b, dtype, what):
    scale = max(1.0, b.float().abs().max().item())
    tol = 2e-6 * scale if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * scale
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol, (what, dtype, err, tol)

torch.manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for shape in ((5, 48), (2, 7, 128), (70, 96), (3, 2048), (2, 3000)):
        for casting, offset in (("llama", 0.0), ("gemma", 1.0)):
            for wdtype in (dtype, torch.float32):
                x = (torch.randn(shape) * 2).to(dtype)
                w = (torch.randn(shape[-1]) * 0.5 + 1 - offset).to(wdtype)
                up = torch.randn(shape).to(dtype)
                xk = x.clone().requires_grad_(True)
                y = R.rms_norm(xk, w, 1e-6, offset, casting)
                (dx,) = torch.autograd.grad(y, xk, up)
                assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape
                xr = x.float().requires_grad_(True)
                ref = R.rms_norm_ref(x, w, 1e-6, offset, casting)
                refd = R.rms_norm_ref(xr, w, 1e-6, offset, casting)
                (ref_dx,) = torch.autograd.grad(refd, xr, up.float())
                what = (shape, casting, wdtype)
                close(y, ref, dtype, ("forward",) + what)
                if dtype == torch.float16:  # the same roundings as the twin: nearly every element equal
                    assert (y == ref).float().mean().item() >= 0.98, ("rounding", what)
                close(dx, ref_dx, dtype, ("input gradient",) + what)
print("RMS_NORM_KERNELS_OK")
"""


def test_kernels_equal_the_twin_under_the_interpreter():
    run_interpreted(_SCRIPT, "RMS_NORM_KERNELS_OK")


def test_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    f = ptrs(["x_ptr", "w_ptr", "y_ptr", "r_ptr"], "*bf16") | {"r_ptr": "*fp32", "n_rows": "i32", "n": "i32",
                                                              "eps": "fp32", "offset": "fp32"}
    b = ptrs(["dy_ptr", "x_ptr", "w_ptr", "dx_ptr"], "*bf16") | {"r_ptr": "*fp32", "n_rows": "i32", "n": "i32",
                                                               "offset": "fp32"}
    b = {k: b[k] for k in ("dy_ptr", "x_ptr", "w_ptr", "r_ptr", "dx_ptr", "n_rows", "n", "offset")}
    f = {k: f[k] for k in ("x_ptr", "w_ptr", "y_ptr", "r_ptr", "n_rows", "n", "eps", "offset")}
    cases = []
    for n in (128, 2048, 5120):
        block_n, rows, _ = R._layout(n)
        cases.append((R._forward_kernel, f, {"GEMMA": False, "BLOCK_N": block_n, "ROWS": rows}))
        cases.append((R._backward_kernel, b, {"BLOCK_N": block_n, "ROWS": rows}))
    compile_for_sm90(cases, str(tmp_path))
