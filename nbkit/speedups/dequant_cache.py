"""Dequantized weights kept: the frozen 4-bit base weights of fused LoRA layers, dequantized once, while memory allows.

Why: QLoRA dequantizes every frozen 4-bit weight twice a step, for the forward GEMM and again for the input gradient
in backward (``nbkit.ops.lora_linear``, as bitsandbytes does), so that memory holds the 4-bit weights only. On a GPU
with memory to spare (a 1.7B model on a 141 GB card uses a few GB of it) the step pays the dequantization kernels and
their launches for memory nobody uses. This speedup spends that memory: each base weight dequantized once, in the
step's compute dtype, kept as an attribute of its ``Linear4bit`` (``DEQUANTIZED``, set through the ledger), and
``fused_lora``'s weight function returns it instead of dequantizing. The tensor is what bitsandbytes'
dequantization returns, so every output and gradient is bit for bit the same.

When (``before_micro_batch``, called by the trainer before each training micro-batch, after
``selective_checkpointing``'s call): once, at the second micro-batch, when step 1's peak is known and
``selective_checkpointing`` has decided which layers keep their activations. Activations first: keeping a layer's
activations saves its whole forward recompute, a cached weight only its dequantization, so the cache takes memory
only where the activations left it. And before ``cuda_graphs`` captures (the same micro-batch, later), so the graphs
read the kept weights. "auto" caches every qualifying weight or none: all of them when their bytes fit in
``SHARE`` of what is left (the limit torch sees, the per-process fraction applied, less ``MARGIN`` of it, less the
peak allocated so far, less what persistent memory grew since training began (optimizer state), less what the
speedups before it planned); else none, said once with the numbers. Never partly: a partial cache saves little and
would compete with the graphs' pools for the memory near the limit.

Which weights: the frozen NF4/FP4 bases of the LoRA layers ``fused_lora`` runs (``fused_lora.why_not_fusable``);
only the fused path reads the kept copy (PEFT's own forward dequantizes as before). The dtype is the trainer's
compute dtype (fp16 or bf16 mixed precision; else the weight's own ``quant_state`` dtype).

Modes: "auto" (on CUDA, sized by memory), True (cache every qualifying weight, wherever: for tests), False.
Contract: the same outputs and gradients, bit for bit; ``detach()`` drops every kept copy (its memory is free again).
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional, Union

import torch

from ..memory import fmt_bytes, gpu_in_use, memory_readings
from ..say_once import SayOnce
from ..settings import check_value
from .ledger import PatchLedger

logger = logging.getLogger(__name__)

Mode = Union[bool, Literal["auto"]]
DEQUANTIZED = "nbkit_dequantized"  # the attribute of a Linear4bit that holds its kept copy
MARGIN = 0.10  # of the GPU's limit, never planned for (as selective_checkpointing's)
SHARE = 0.5  # of what is left after the margin, the peak, the growth and earlier plans: what the copies may take
PLAN_AT = 2  # the micro-batch before which it decides: step 1's peak and measurements are known then


def dequantize(base: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen 4-bit weight of a bitsandbytes ``Linear4bit``, dequantized, in ``dtype``."""
    import bitsandbytes.functional as bnbf

    weight = base.weight
    return bnbf.dequantize_4bit(weight.data, weight.quant_state).to(dtype)


def kept_weight(base: torch.nn.Module, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The copy this speedup kept for ``base`` in ``dtype``, or None (then the caller dequantizes)."""
    kept = vars(base).get(DEQUANTIZED)
    return kept if kept is not None and kept.dtype == dtype else None


def _dequantized_bytes(base: torch.nn.Module, dtype: torch.dtype) -> int:
    shape = getattr(base.weight.quant_state, "shape", None)
    numel = int(torch.Size(shape).numel()) if shape is not None else int(base.in_features * base.out_features)
    return numel * dtype.itemsize


def kept_bytes(model: torch.nn.Module) -> int:
    """Bytes of the copies kept on ``model``'s modules now (0: none; what ``dequant_cache=False`` gives back)."""
    kept = (vars(m).get(DEQUANTIZED) for m in model.modules())
    return sum(t.numel() * t.element_size() for t in kept if isinstance(t, torch.Tensor))


def _bases(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The 4-bit bases of the LoRA layers fused_lora runs, in model order."""
    from .fused_lora import _is_linear4bit, _is_lora_linear, why_not_fusable

    found = []
    for module in model.modules():
        if _is_lora_linear(module) and why_not_fusable(module) is None:
            base = module.get_base_layer()
            if _is_linear4bit(base):
                found.append(base)
    return found


class DequantCache:
    """Keep the fused LoRA layers' frozen 4-bit weights dequantized, decided before the second micro-batch.

    ``dtype``: the compute dtype of the trainer's steps (None: each weight's ``quant_state`` dtype). After the
    decision ``kept_bytes`` is what the copies take (0: none kept).
    """

    name = "dequant_cache"

    def __init__(self, mode: Mode = "auto", dtype: Optional[torch.dtype] = None) -> None:
        check_value("dequant_cache", mode)
        self.mode, self.dtype = mode, dtype
        self._ledger = PatchLedger(self.name)
        self._say = SayOnce(logger, "nbkit dequant_cache")
        self._reset()

    def _reset(self) -> None:
        self._bases: list[torch.nn.Module] = []
        self._device = torch.device("cpu")
        self._allocated_at_start = 0
        self.decided = False
        self.kept_bytes = 0

    @property
    def engaged(self) -> bool:
        """Whether copies are kept now (False before the decision and when they did not fit)."""
        return self.kept_bytes > 0

    def attach(self, model: torch.nn.Module) -> bool:
        self.detach()
        if self.mode is False:
            return False
        bases = _bases(model)
        if not bases:
            self._say("none", "no 4-bit base weight under a fused LoRA layer; nothing to keep", logging.INFO)
            return False
        device = bases[0].weight.device
        if self.mode == "auto" and memory_readings(device) is None:
            self._say("auto", f"off (model on {device.type}; 'auto' sizes by CUDA memory)", logging.INFO)
            return False
        self._bases, self._device = bases, device
        self._allocated_at_start = gpu_in_use(device)
        return True

    def detach(self) -> None:
        self._ledger.undo()  # the kept copies go with their attributes
        self._reset()

    def _dtype(self, base: torch.nn.Module) -> torch.dtype:
        return self.dtype or getattr(base.weight.quant_state, "dtype", None) or torch.bfloat16

    def before_micro_batch(self, index: int, reserved: int = 0) -> int:
        """Decide once, before micro-batch ``index`` = ``PLAN_AT`` (``reserved``: bytes the speedups called before it
        planned for at the longest micro-batch); return the bytes kept."""
        if self.decided or index < PLAN_AT or not self._bases:
            return self.kept_bytes
        self.decided = True
        need = sum(_dequantized_bytes(b, self._dtype(b)) for b in self._bases)
        readings = memory_readings(self._device)
        if self.mode == "auto":
            if readings is None:
                return 0
            limit, peak, allocated = readings
            grown = max(0, allocated - self._allocated_at_start)
            left = int(limit * (1 - MARGIN)) - peak - grown - reserved
            if need > SHARE * left:
                self._say("decide", f"not kept: the dequantized weights take {fmt_bytes(need)}, more than "
                          f"{SHARE:.0%} of the {fmt_bytes(max(0, left))} left ({fmt_bytes(limit)} limit less "
                          f"{MARGIN:.0%}, the {fmt_bytes(peak)} peak, {fmt_bytes(grown)} grown since training began "
                          f"and {fmt_bytes(reserved)} planned for activations)", logging.INFO)
                return 0
        with torch.no_grad():
            for base in self._bases:
                self._ledger.set(base, DEQUANTIZED, dequantize(base, self._dtype(base)))
        self.kept_bytes = need
        self._say("decide", f"{len(self._bases)} frozen 4-bit weights kept dequantized ({fmt_bytes(need)}): no "
                  "dequantization in the steps from now on", logging.INFO)
        return need


def compute_dtype(args: Any) -> Optional[torch.dtype]:
    """The dtype a trainer's mixed precision computes in (None: no mixed precision, the weights' own)."""
    if getattr(args, "fp16", False):
        return torch.float16
    if getattr(args, "bf16", False):
        return torch.bfloat16
    return None
