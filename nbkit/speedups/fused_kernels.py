"""Fused layer kernels (RMSNorm, SwiGLU/GeGLU, RoPE) from Liger-Kernel, attached per model and reversible.

Why: in a profiled FastSFT step (H200, Qwen3-1.7B QLoRA, 16K tokens) the decoder's norms, activation and rotary
embedding ran as chains of small elementwise kernels (fp32 upcasts, pow, mean, rsqrt, multiplies, casts, slices and
concatenations), each reading and writing a full activation: together with the LoRA glue, more GPU time than the
matrix products. Liger-Kernel already ships one Triton kernel per op with a matching backward, so nbkit uses it
(an optional dependency: ``pip install "nbkit-sft[liger]"``) rather than its own kernels, with one exception: a norm
whose weight is frozen (every norm under LoRA) runs ``nbkit.ops.rms_norm``, whose backward computes the input
gradient only over independent blocks of rows, where Liger's loops over each SM's share of the rows in turn (a
fixed cost per call, ~55-60 us on an H200). The choice is made per call, by ``weight.requires_grad``.

How it hooks in:
- RMSNorm modules and gated MLPs get an instance ``forward`` that calls Liger's op (removed on ``detach``).
- RoPE is a module-level function that the attention calls by name, so the only way in is to replace
  ``modeling_<family>.apply_rotary_pos_emb`` for the duration of the run: the one patch of a module-level function
  in nbkit, made through the ledger (restored on ``detach``, skipped when someone else already replaced it).

Contract: only families whose RMSNorm casting, MLP activation and RoPE layout are known to match Liger's are touched
(``FAMILIES``); any other module keeps its own forward. Liger's kernels need a CUDA (or other Triton) device; on CPU
the speedup does not attach. Numerics: the same math in fp32 inside one kernel, so bf16 outputs differ from the
unfused chain only by rounding (GPU parity test: tests/gpu/test_fused_gpu.py).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from ..model_parts import unwrap_model
from ..ops.rms_norm import CASTINGS, rms_norm
from .ledger import PatchLedger

logger = logging.getLogger(__name__)

# model_type -> (RMSNorm offset, Liger casting mode, gated activation op, RoPE patchable)
FAMILIES: dict[str, tuple[float, str, str, bool]] = {
    "llama": (0.0, "llama", "swiglu", True),
    "mistral": (0.0, "llama", "swiglu", True),
    "qwen2": (0.0, "llama", "swiglu", True),
    "qwen3": (0.0, "llama", "swiglu", True),
    "qwen3_moe": (0.0, "llama", "swiglu", True),
    "mixtral": (0.0, "llama", "swiglu", True),
    "gemma": (1.0, "gemma", "geglu", True),
    "gemma2": (1.0, "gemma", "geglu", True),
    "gemma3_text": (1.0, "gemma", "geglu", True),
}
_SILU = {"silu", "swish"}
_GELU_TANH = {"gelu_pytorch_tanh", "gelu_new"}


class KernelOps(NamedTuple):
    """The four ops, with Liger's functional signatures: rms_norm(x, w, eps, offset, casting_mode, in_place),
    swiglu(a, b) = silu(a) * b, geglu(a, b) = gelu_tanh(a) * b, rope(q, k, cos, sin, position_ids, unsqueeze_dim)."""

    rms_norm: Callable
    swiglu: Callable
    geglu: Callable
    rope: Callable
    source: str


def frozen_weight_first(general: Callable, frozen: Callable) -> Callable:
    """An ``rms_norm`` op (Liger's signature) that calls ``frozen(x, w, eps, offset, casting)`` when ``w`` does not
    train and its casting is one ``nbkit.ops.rms_norm`` has, and ``general`` otherwise."""

    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 0.0, casting_mode: str = "llama",
                 in_place: bool = True) -> torch.Tensor:
        if w.requires_grad or casting_mode not in CASTINGS:
            return general(x, w, eps, offset, casting_mode, in_place)
        return frozen(x, w, eps, offset, casting_mode)

    return rms_norm


def liger_ops() -> Optional[KernelOps]:
    """Liger-Kernel's ops (frozen-weight norms through ``nbkit.ops.rms_norm``), or None when Liger is not installed
    (or fails to import)."""
    try:
        from liger_kernel.transformers import functional as F
    except Exception:
        return None
    return KernelOps(frozen_weight_first(F.liger_rms_norm, rms_norm), F.liger_swiglu, F.liger_geglu, F.liger_rope,
                     "liger")


def _rms_forward(module: nn.Module, op: Callable, offset: float, casting: str) -> Callable[[torch.Tensor], torch.Tensor]:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        # in_place=False: the incoming gradient may be read again (gemma2's sandwich norms, residual branches)
        return op(hidden_states, module.weight, eps, offset, casting, False)

    return forward


def _mlp_forward(module: nn.Module, op: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(op(module.gate_proj(x), module.up_proj(x)))

    return forward


def _activation_name(module: nn.Module, config: Any) -> Optional[str]:
    act = getattr(module, "act_fn", None)
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    return name if isinstance(name, str) else None


def _rope_function(op: Callable) -> Callable:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1):
        return op(q, k, cos, sin, None, unsqueeze_dim)

    apply_rotary_pos_emb.__module__ = __name__
    apply_rotary_pos_emb.nbkit_fused = True
    return apply_rotary_pos_emb


class FusedKernels:
    """Speedup: Liger's RMSNorm, SwiGLU/GeGLU and RoPE kernels on one model while attached."""

    name = "fused_kernels"

    def __init__(self, rope: bool = True, ops: Optional[KernelOps] = None) -> None:
        """``ops``: the kernels to use (default: Liger-Kernel's; tests pass reference ops to run on CPU)."""
        self.rope = rope
        self.ops = ops
        self._ledger = PatchLedger(self.name)
        self.kernel: Optional[str] = None
        self.counts: dict[str, int] = {}

    def attach(self, model: nn.Module) -> bool:
        self.detach()
        base = unwrap_model(model)
        config = getattr(base, "config", None)
        family = getattr(config.get_text_config(), "model_type", None) if config is not None else None
        if family not in FAMILIES:
            logger.info("nbkit: fused_kernels knows no kernels for model_type=%r; plain modules kept", family)
            return False
        ops = self.ops
        if ops is None:
            param = next(base.parameters(), None)
            if param is None or param.device.type != "cuda":
                logger.info("nbkit: fused_kernels needs a CUDA device (Triton kernels); plain modules kept")
                return False
            ops = liger_ops()
            if ops is None:
                logger.warning("nbkit: fused_kernels needs Liger-Kernel (pip install 'nbkit-sft[liger]'); plain modules kept")
                return False
        offset, casting, gate, rope = FAMILIES[family]
        text_config = config.get_text_config()
        want_act = _SILU if gate == "swiglu" else _GELU_TANH
        counts = {"rms_norm": 0, gate: 0, "rope": 0}
        for module in base.modules():
            cls = type(module).__name__
            if cls.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor) \
                    and module.weight.dim() == 1:
                self._ledger.set(module, "forward", _rms_forward(module, ops.rms_norm, offset, casting))
                counts["rms_norm"] += 1
            elif all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")) \
                    and _activation_name(module, text_config) in want_act:
                self._ledger.set(module, "forward", _mlp_forward(module, ops.swiglu if gate == "swiglu" else ops.geglu))
                counts[gate] += 1
        if self.rope and rope:
            counts["rope"] = self._patch_rope(type(base).__module__, ops.rope)
        self.counts = counts
        self.kernel = ops.source
        return len(self._ledger) > 0

    def _patch_rope(self, module_name: str, op: Callable) -> int:
        """Replace the family's ``apply_rotary_pos_emb`` while attached (the attention calls it by module name)."""
        try:
            mod = importlib.import_module(module_name)
        except ImportError:
            return 0
        original = getattr(mod, "apply_rotary_pos_emb", None)
        if original is None or getattr(original, "__module__", None) != module_name:
            return 0  # absent, or already replaced by someone else (Liger's own patching, another trainer)
        self._ledger.set(mod, "apply_rotary_pos_emb", _rope_function(op))
        return 1

    def detach(self) -> None:
        self._ledger.undo()
