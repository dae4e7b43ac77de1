"""Gate activations of MoE experts, fused with the per-expert bias: ``h = gate(gu + bias[e])`` on sorted rows.

Why: the gate between an expert's up and down projections is elementwise, so unfused it costs several full passes
over the widest activation (bias gather and add, strided gate/up slices, the activation, and their backward with
zero-fills). Fused, it is one pass each way, in fp32, saving only ``gu``.

Gates (``GATES``), each with its layout of the up projection's output ``gu`` (rows, 2 * n):

* ``"swiglu"``: concatenated ``[gate | up]``, ``h = silu(gate) * up`` (Qwen3-MoE, Mixtral, ...);
* ``"gptoss"``: interleaved ``[g0, u0, g1, u1, ...]``, gpt-oss's clamped gate
  ``h = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.

Each gate's math is written once in torch (``swiglu``/``swiglu_grad``, ``gptoss_glu``/``gptoss_glu_grad``: the
reference; the backward by hand, so that nothing but ``gu`` is saved) and once in Triton (the ``_tl_*`` helpers the
two kernels call). ``gate_activation`` runs either. Contract: torch and optional Triton only, no transformers or
PEFT; the gradient at a clamp's edge is the upstream gradient (as torch's ``clamp``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

try:  # optional: the fused kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

HAS_TRITON = triton is not None
GATES = ("swiglu", "gptoss")
_BLOCK = 1024


# ----------------------------------------------------------------------------------------------------------------
# The math, in torch (the reference)
# ----------------------------------------------------------------------------------------------------------------
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_grad(gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``swiglu`` for the upstream gradient ``g``."""
    s = torch.sigmoid(gate)
    return g * up * s * (1 + gate * (1 - s)), g * gate * s


def gptoss_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


def gptoss_glu_grad(gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor, alpha: float,
                    limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``gptoss_glu`` for the upstream gradient ``g``."""
    gate_c, up_c = gate.clamp(max=limit), up.clamp(-limit, limit)
    s = torch.sigmoid(gate_c * alpha)
    d_up = torch.where((up >= -limit) & (up <= limit), g * gate_c * s, 0.0)
    d_gate = torch.where(gate <= limit, g * (up_c + 1) * (s + alpha * gate_c * s * (1 - s)), 0.0)
    return d_gate, d_up


def split_gate_up(z: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) halves of ``z`` (rows, 2n) in ``kind``'s layout."""
    return (z[:, 0::2], z[:, 1::2]) if kind == "gptoss" else z.chunk(2, dim=-1)


def gate_forward(z: torch.Tensor, kind: str, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """``h`` (rows, n) of the pre-activations ``z`` (rows, 2n), in ``z``'s dtype."""
    gate, up = split_gate_up(z, kind)
    return gptoss_glu(gate, up, alpha, limit) if kind == "gptoss" else swiglu(gate, up)


def gate_backward(z: torch.Tensor, g: torch.Tensor, kind: str, alpha: float = 0.0,
                  limit: float = 0.0) -> torch.Tensor:
    """``dz`` (rows, 2n) in ``z``'s layout, for the upstream gradient ``g`` (rows, n) of ``gate_forward``."""
    gate, up = split_gate_up(z, kind)
    if kind == "gptoss":
        return torch.stack(gptoss_glu_grad(gate, up, g, alpha, limit), dim=-1).view_as(z)
    return torch.cat(swiglu_grad(gate, up, g), dim=-1)


def expert_row_sums(g: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E, n) per-expert sums of the rows of ``g`` (a bias gradient), as one small GEMM: no atomics."""
    experts = torch.arange(num_experts, device=g.device).unsqueeze(1)
    return (expert_ids.unsqueeze(0) == experts).to(g.dtype).mm(g)


# ----------------------------------------------------------------------------------------------------------------
# The same math in Triton (CUDA; TRITON_INTERPRET=1, set before triton is imported, runs it on CPU)
# ----------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _tl_swiglu(gate, up):
        return gate * tl.sigmoid(gate) * up

    @triton.jit
    def _tl_swiglu_grad(gate, up, g):
        s = tl.sigmoid(gate)
        return g * up * s * (1.0 + gate * (1.0 - s)), g * gate * s

    @triton.jit
    def _tl_gptoss_glu(gate, up, alpha, limit):
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(gate * alpha)

    @triton.jit
    def _tl_gptoss_glu_grad(gate, up, g, alpha, limit):
        gate_c = tl.minimum(gate, limit)
        up_c = tl.minimum(tl.maximum(up, -limit), limit)
        s = tl.sigmoid(gate_c * alpha)
        d_up = tl.where((up >= -limit) & (up <= limit), g * gate_c * s, 0.0)
        d_gate = tl.where(gate <= limit, g * (up_c + 1.0) * (s + alpha * gate_c * s * (1.0 - s)), 0.0)
        return d_gate, d_up

    @triton.jit
    def _tl_load_pre_act(gu_ptr, bias_ptr, eid_ptr, row, cols, mask, n_cols,
                         GPTOSS: tl.constexpr, HAS_BIAS: tl.constexpr):
        # fp32 (gate, up) of one row's column block, bias added, and their column offsets in gu's layout
        if GPTOSS:  # interleaved [g0, u0, g1, u1, ...]
            gcol = 2 * cols
            ucol = 2 * cols + 1
        else:  # concatenated [gate | up]
            gcol = cols
            ucol = cols + n_cols
        src = gu_ptr + row * (2 * n_cols)
        gate = tl.load(src + gcol, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + ucol, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = bias_ptr + tl.load(eid_ptr + row).to(tl.int64) * (2 * n_cols)
            gate += tl.load(b + gcol, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(b + ucol, mask=mask, other=0.0).to(tl.float32)
        return gate, up, gcol, ucol

    @triton.jit
    def gate_fwd_kernel(gu_ptr, bias_ptr, eid_ptr, h_ptr, n_cols, alpha, limit,
                        GPTOSS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate, up, gcol, ucol = _tl_load_pre_act(gu_ptr, bias_ptr, eid_ptr, row, cols, mask, n_cols, GPTOSS, HAS_BIAS)
        if GPTOSS:
            h = _tl_gptoss_glu(gate, up, alpha, limit)
        else:
            h = _tl_swiglu(gate, up)
        tl.store(h_ptr + row * n_cols + cols, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gate_bwd_kernel(gu_ptr, bias_ptr, eid_ptr, gh_ptr, dgu_ptr, n_cols, alpha, limit,
                        GPTOSS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate, up, gcol, ucol = _tl_load_pre_act(gu_ptr, bias_ptr, eid_ptr, row, cols, mask, n_cols, GPTOSS, HAS_BIAS)
        g = tl.load(gh_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if GPTOSS:
            d_gate, d_up = _tl_gptoss_glu_grad(gate, up, g, alpha, limit)
        else:
            d_gate, d_up = _tl_swiglu_grad(gate, up, g)
        dst = dgu_ptr + row * (2 * n_cols)
        tl.store(dst + gcol, d_gate.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + ucol, d_up.to(dgu_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# The autograd function
# ----------------------------------------------------------------------------------------------------------------
def _biased(gu: torch.Tensor, bias: Optional[torch.Tensor], expert_ids: torch.Tensor) -> torch.Tensor:
    z = gu.float()
    return z if bias is None else z + bias.float().index_select(0, expert_ids)


class _GateActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu, bias, expert_ids, num_experts, kind, alpha, limit, use_triton):
        ctx.args = (expert_ids, num_experts, kind, alpha, limit, use_triton)
        ctx.save_for_backward(gu, bias)
        n = gu.shape[1] // 2
        if use_triton:
            h = gu.new_empty(gu.shape[0], n)
            gate_fwd_kernel[(gu.shape[0], triton.cdiv(n, _BLOCK))](
                gu, bias if bias is not None else gu, expert_ids, h, n, alpha, limit,
                GPTOSS=kind == "gptoss", HAS_BIAS=bias is not None, BLOCK=_BLOCK)
            return h
        return gate_forward(_biased(gu, bias, expert_ids), kind, alpha, limit).to(gu.dtype)

    @staticmethod
    def backward(ctx, gh):
        gu, bias = ctx.saved_tensors
        expert_ids, num_experts, kind, alpha, limit, use_triton = ctx.args
        gh = gh.contiguous()
        if use_triton:
            dgu = torch.empty_like(gu)
            n = gu.shape[1] // 2
            gate_bwd_kernel[(gu.shape[0], triton.cdiv(n, _BLOCK))](
                gu, bias if bias is not None else gu, expert_ids, gh, dgu, n, alpha, limit,
                GPTOSS=kind == "gptoss", HAS_BIAS=bias is not None, BLOCK=_BLOCK)
        else:
            dgu = gate_backward(_biased(gu, bias, expert_ids), gh.float(), kind, alpha, limit).to(gu.dtype)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            dbias = expert_row_sums(dgu, expert_ids, num_experts).to(bias.dtype)
        return dgu if ctx.needs_input_grad[0] else None, dbias, None, None, None, None, None, None


def gate_activation(gu: torch.Tensor, bias: Optional[torch.Tensor], expert_ids: torch.Tensor, num_experts: int,
                    kind: str, alpha: float = 0.0, limit: float = 0.0, use_triton: bool = False) -> torch.Tensor:
    """``h = gate(gu + bias[expert_ids])``, (rows, n) in ``gu``'s dtype, computed in fp32.

    ``gu``: (rows, 2n) contiguous, in ``kind``'s layout (``GATES``); ``bias``: (E, 2n) or None; ``expert_ids``:
    (rows,) expert of each row. Saves only ``gu`` (and ``bias``); ``use_triton``: the fused kernels.
    """
    if kind not in GATES:
        raise ValueError(f"gate {kind!r}: one of {GATES}")
    return _GateActivation.apply(gu, bias, expert_ids, num_experts, kind, float(alpha), float(limit), use_triton)
