"""Fast MoE routing: an experts forward for transformers' ``ExpertsInterface``, with LoRA on the experts.

Why: transformers' experts run either as a Python loop over experts (``eager``: one host sync per expert) or as
``grouped_mm`` with many full passes over the routed activations (gathers, bias gathers, sentinel masks, an
unfused gate). PEFT's ``target_parameters`` LoRA on the 3-D expert tensors adds, every step, ``W + BA`` for all
experts (twice: PEFT's parametrization is evaluated once more at registration) and a full weight gradient of that
sum. ``nbkit_experts_forward`` computes the same numbers from the ops in ``nbkit.ops``:

* ``moe_routing``: one sort of the assignments by expert; each expert's rows as one contiguous slice, all experts
  in one ``grouped_mm`` per projection ("grouped" backend: CUDA, bf16, dims multiple of 8, zero host syncs) or one
  matmul per slice ("loop": CPU, fp32/fp16, odd shapes); the weighted combine (and gpt-oss's down bias) as one
  gather-and-sum per token in fp32; LoRA on expert weights as low-rank products on each expert's slice
  (``W + BA`` is never formed);
* ``moe_gates``: the gate (SwiGLU, or gpt-oss's interleaved clamped SwiGLU) and its bias in one pass each way;
  any other ``_apply_gate``/``act_fn`` runs as the model defines it, on the sorted rows.

Contract (see ``nbkit.speedups.ledger``): ``FastMoERouting().attach(model)`` registers ``nbkit_experts_forward`` under
the name ``"nbkit"`` (idempotent) and, through its ``PatchLedger``: selects it with ``model.set_experts_implementation``
(or the experts' config for a bare module), keeps each experts module's plan (backend, gate, kernels: chosen once,
here) as ``_nbkit_moe_plan``, and, for PEFT ``ParamWrapper`` chains around experts, sets the outermost wrapper's
``forward`` on that instance so that PEFT's parametrization is not registered and the LoRA factors reach the experts
forward as low-rank products. ``detach()`` undoes the ledger. Unsupported models (no experts behind the interface,
tensor/expert parallel sharding, non-float expert weights) keep transformers' path with one log line.

Not supported (the model stays on transformers' path): expert-parallel sentinels (ids >= num_experts), quantized
expert tensors. PEFT states the bypass leaves to PEFT: merged or disabled adapters, ``adapter_names`` batches,
fp8 base weights; a wrapper whose ``forward`` is already replaced on the instance (e.g. by accelerate hooks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..model_parts import unwrap_model
from ..ops import moe_gates, moe_routing
from ..ops.moe_gates import gate_activation
from ..ops.moe_routing import add_lora, combine, dispatch, experts_linear, route
from .ledger import PatchLedger

logger = logging.getLogger(__name__)

IMPL_NAME = "nbkit"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------------------------
# Per-module plan (chosen in attach) and the experts forward registered with transformers
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    up_name: str  # "gate_up_proj" (gated) or "up_proj"
    trans: bool  # weights stored (E, out, in): y = x @ W[e].T
    has_bias: bool
    gate: str  # "swiglu" | "gptoss" (nbkit.ops.moe_gates) | "generic" (the model's own _apply_gate / act_fn)
    device: torch.device
    dtype: torch.dtype
    backend: str  # "grouped" | "loop"
    triton: bool  # the Triton kernels: dispatch/combine always, the gate for "swiglu" and "gptoss"


def _gate_kind(module: nn.Module) -> str:
    from ..trl_seam import SiLUActivation, _default_apply_gate

    gate_fn = getattr(type(module), "_apply_gate", None)
    if not module.has_gate:
        return "generic"
    if gate_fn is _default_apply_gate and isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU)):
        return "swiglu"
    try:
        from ..trl_seam import GptOssExperts
    except ImportError:  # pragma: no cover
        return "generic"
    if gate_fn is GptOssExperts._apply_gate and hasattr(module, "alpha") and hasattr(module, "limit"):
        return "gptoss"
    return "generic"


def _make_plan(module: nn.Module, device: torch.device, dtype: torch.dtype, backend: str = "auto",
               kernels: str = "auto") -> _Plan:
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    w_up, w_down = getattr(module, up_name), module.down_proj
    if backend == "auto":
        dims = (*w_up.shape[1:], *w_down.shape[1:])
        backend = "grouped" if moe_routing.grouped_mm_fits(device, dtype, dims) else "loop"
    available = moe_routing.HAS_TRITON and moe_gates.HAS_TRITON
    if kernels == "triton" and not available:
        raise RuntimeError("nbkit fast_moe_routing: kernels='triton' but triton is not installed")
    use_triton = kernels == "triton" or (kernels == "auto" and device.type == "cuda" and available)
    return _Plan(up_name, not module.is_transposed, bool(module.has_bias), _gate_kind(module), device, dtype,
                 backend, use_triton)


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    dev = weight.device.type
    if torch.is_autocast_enabled(dev) and weight.dtype == torch.float32:
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def _lora_factors(pairs, num_experts: int, dtype: torch.dtype) -> list:
    """PEFT ``ParamWrapper`` factors ``[(A (E*r, in), B (out, r*E), scaling), ...]`` as ``(A (E, r, in),
    B (E, out, r), scaling)``, the layout of ``nbkit.ops.moe_routing.add_lora``."""
    out = []
    for A, B, scaling in pairs:
        r = A.shape[0] // num_experts
        A3 = A.view(num_experts, r, A.shape[1]).to(dtype)
        B3 = B.view(B.shape[0], r, num_experts).permute(2, 0, 1).to(dtype).contiguous()
        out.append((A3, B3, scaling))
    return out


def nbkit_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    nbkit_lora: Optional[dict] = None,
) -> torch.Tensor:
    """Experts forward for ``ExpertsInterface``: same inputs and outputs as the model's own experts forward.

    ``nbkit_lora`` (passed only by the PEFT bypass) maps a weight name to ``[(lora_A, lora_B, scaling), ...]`` in
    PEFT ``ParamWrapper`` layout; those deltas are added as low-rank products on each expert's rows.
    """
    if hidden_states.shape[0] == 0:
        return torch.zeros_like(hidden_states)
    plan = getattr(self, "_nbkit_moe_plan", None)
    w_up0 = getattr(self, "gate_up_proj" if self.has_gate else "up_proj")
    dtype = _compute_dtype(w_up0)
    if plan is None or plan.device != w_up0.device or plan.dtype != dtype:  # selected without attach, or moved
        plan = _make_plan(self, w_up0.device, dtype)
    lora = nbkit_lora or {}
    E = self.num_experts
    with torch.autocast(plan.device.type, enabled=False):
        w_up, w_down = w_up0.to(dtype), self.down_proj.to(dtype)
        r = route(top_k_index, E, host_counts=plan.backend == "loop")
        x = dispatch(hidden_states.to(dtype), r, plan.triton)
        gu = experts_linear(x, w_up, r, plan.trans)
        gu = add_lora(gu, x, _lora_factors(lora.get(plan.up_name, ()), E, dtype), r)
        up_bias = getattr(self, plan.up_name + "_bias") if plan.has_bias else None
        if plan.gate == "generic":
            if up_bias is not None:
                gu = gu + up_bias.to(dtype).index_select(0, r.sorted_e)
            h = self._apply_gate(gu) if self.has_gate else self.act_fn(gu)
        else:
            h = gate_activation(gu, up_bias, r.sorted_e, E, plan.gate, float(getattr(self, "alpha", 0.0)),
                                float(getattr(self, "limit", 0.0)), plan.triton)
        y = experts_linear(h, w_down, r, plan.trans)
        y = add_lora(y, h, _lora_factors(lora.get("down_proj", ()), E, dtype), r)
        down_bias = self.down_proj_bias.to(dtype) if plan.has_bias else None
        out = combine(y, top_k_weights.reshape(-1), down_bias, r, plan.triton)
    return out.to(hidden_states.dtype)


def register() -> None:
    """Register ``nbkit_experts_forward`` as ``"nbkit"`` with transformers' ``ExpertsInterface`` (idempotent)."""
    from ..trl_seam import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if ALL_EXPERTS_FUNCTIONS.get(IMPL_NAME) is not nbkit_experts_forward:
        ExpertsInterface.register(IMPL_NAME, nbkit_experts_forward)


# ----------------------------------------------------------------------------------------------------------------
# PEFT: LoRA on expert tensors without the parametrization
# ----------------------------------------------------------------------------------------------------------------
class _LoraBypass:
    """Instance ``forward`` of the outermost PEFT ``ParamWrapper`` around an experts module.

    PEFT registers a parametrization computing ``W + scaling * B A`` for all experts (evaluated on registration
    and on use). Here the active LoRA factors go to the experts forward instead; any state this does not cover is
    handed to PEFT's own forward unchanged.
    """

    def __init__(self, outer: nn.Module, chain: list, experts: nn.Module):
        self.outer, self.chain, self.experts = outer, chain, experts

    def original(self, *args, **kwargs):
        return type(self.outer).forward(self.outer, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if kwargs.get("adapter_names") is not None or self.experts.config._experts_implementation != IMPL_NAME:
            return self.original(*args, **kwargs)
        lora = {}
        for wrapper in self.chain:
            if wrapper.merged or wrapper.disable_adapters:
                return self.original(*args, **kwargs)
            if wrapper.get_param().dtype not in _FLOAT_DTYPES:
                return self.original(*args, **kwargs)
            names = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
            if names:
                lora[wrapper.parameter_name] = [
                    (wrapper.lora_A[a].weight, wrapper.lora_B[a].weight, wrapper.scaling[a]) for a in names
                ]
        kwargs.pop("adapter_names", None)
        return self.experts(*args, nbkit_lora=lora, **kwargs)


def _param_wrapper_cls():
    try:
        from ..trl_seam import ParamWrapper
    except ImportError:
        return None
    return ParamWrapper


# ----------------------------------------------------------------------------------------------------------------
# The speedup object
# ----------------------------------------------------------------------------------------------------------------
def _is_interface_experts(module: nn.Module) -> bool:
    """An experts module whose class went through transformers' ``use_experts_implementation``."""
    return (
        all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "config", "num_experts"))
        and hasattr(type(module), "_apply_gate")
        and hasattr(type(module).forward, "__wrapped__")
    )


def _unsupported_reason(base: nn.Module, experts: list) -> Optional[str]:
    dist = getattr(getattr(base, "config", None), "distributed_config", None)
    if getattr(base, "_tp_size", None) or getattr(dist, "tp_size", None) or getattr(dist, "enable_expert_parallel", 0):
        return "tensor/expert-parallel sharding (expert-parallel sentinel ids) is not supported"
    for m in experts:
        names = ("gate_up_proj" if m.has_gate else "up_proj", "down_proj")
        for name in names:
            p = getattr(m, name, None)
            if not isinstance(p, torch.Tensor) or p.dim() != 3 or p.shape[0] != m.num_experts:
                return f"{type(m).__name__}.{name} is not a ({m.num_experts}, ., .) expert tensor"
            if p.dtype not in _FLOAT_DTYPES:
                return f"{type(m).__name__}.{name} has dtype {p.dtype} (quantized experts are not supported)"
    return None


class FastMoERouting:
    """nbkit's MoE experts path (see the module docstring). ``attach(model) -> bool``, ``detach()``.

    ``backend``: "auto" (grouped_mm on CUDA bf16 with aligned dims, else contiguous slices), "grouped" or "loop".
    ``kernels``: "auto" (Triton on CUDA when installed), "triton" or "torch". LoRA on experts always runs as
    separate low-rank products on each expert's sorted rows.
    """

    name = "fast_moe_routing"

    def __init__(self, backend: str = "auto", kernels: str = "auto") -> None:
        if backend not in ("auto", "grouped", "loop") or kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"backend={backend!r}, kernels={kernels!r}")
        self.backend, self.kernels = backend, kernels
        self._ledger = PatchLedger(self.name)

    @property
    def lora_bypassed(self) -> int:
        """How many PEFT wrapper chains around experts run their LoRA through nbkit now (0 when detached)."""
        return sum(what.endswith(".forward") for what in self._ledger.entries())

    def attach(self, model: nn.Module) -> bool:
        self.detach()
        base = unwrap_model(model)
        experts = [m for m in base.modules() if _is_interface_experts(m)]
        if not experts:
            # a dense model: nothing to route, so nothing to warn about
            logger.info("nbkit fast_moe_routing: off for %s: no experts module goes through transformers' "
                        "ExpertsInterface", type(base).__name__)
            return False
        reason = _unsupported_reason(base, experts)
        if reason:
            impl = experts[0].config._experts_implementation
            logger.warning("nbkit fast_moe_routing: off for %s: %s; experts stay on transformers' %r",
                           type(base).__name__, reason, impl)
            return False
        plans = []
        for m in experts:  # chosen once, before anything changes
            w = getattr(m, "gate_up_proj" if m.has_gate else "up_proj")
            plans.append(_make_plan(m, w.device, _compute_dtype(w), self.backend, self.kernels))
        register()
        try:
            self._select(base, experts)
        except (RuntimeError, ValueError) as err:  # e.g. a load-time-only implementation (deepgemm_megamoe)
            self._ledger.undo()
            logger.warning("nbkit fast_moe_routing: off for %s: cannot switch the experts implementation (%s)",
                           type(base).__name__, err)
            return False
        for m, plan in zip(experts, plans):
            self._ledger.set(m, "_nbkit_moe_plan", plan)
        self._bypass_peft(base)
        logger.info("nbkit fast_moe_routing: on for %d experts modules of %s (backend=%s, gate=%s, kernels=%s, "
                    "LoRA bypass on %d)", len(experts), type(base).__name__, plans[0].backend, plans[0].gate,
                    "triton" if plans[0].triton else "torch", self.lora_bypassed)
        return True

    def detach(self) -> None:
        self._ledger.undo()

    # -- helpers --------------------------------------------------------------------------------------------
    def _select(self, base: nn.Module, experts: list) -> None:
        if hasattr(base, "set_experts_implementation") and hasattr(base, "get_experts_implementation"):
            previous = base.get_experts_implementation()
            self._ledger.call("set_experts_implementation", lambda: base.set_experts_implementation(previous))
            base.set_experts_implementation(IMPL_NAME)
        for m in experts:  # bare modules, or configs the model-level setter does not reach
            if m.config._experts_implementation != IMPL_NAME:
                self._ledger.set(m.config, "_experts_implementation_internal", IMPL_NAME)

    def _bypass_peft(self, base: nn.Module) -> None:
        pw_cls = _param_wrapper_cls()
        if pw_cls is None:
            return
        wrappers = [m for m in base.modules() if isinstance(m, pw_cls)]
        inner = {id(w.base_layer) for w in wrappers}
        kept: dict = {}  # reason -> number of experts modules left on PEFT's path
        for outer in (w for w in wrappers if id(w) not in inner):
            chain, cur = [], outer
            while isinstance(cur, pw_cls):
                chain.append(cur)
                cur = cur.base_layer
            if not _is_interface_experts(cur):
                continue
            plan = cur._nbkit_moe_plan
            why = None
            if "forward" in outer.__dict__:
                why = "its forward is already replaced on the instance (hooks)"
            for w in chain:
                if w.parameter_name not in (plan.up_name, "down_proj") or w.num_experts != cur.num_experts:
                    why = f"LoRA on {w.parameter_name!r} is not an expert weight nbkit computes"
            if why:
                kept[why] = kept.get(why, 0) + 1
                continue
            self._ledger.set(outer, "forward", _LoraBypass(outer, chain, cur))
        for why, count in kept.items():
            logger.warning("nbkit fast_moe_routing: LoRA on %d experts modules stays on PEFT's parametrization "
                           "(W + BA formed each step): %s", count, why)
