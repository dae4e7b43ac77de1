"""Speedup ``fused_lora``: PEFT LoRA Linear layers (dense or 4-bit base) run ``ops.lora_linear.fused_lora_linear``.

Why and the numerics: ``nbkit.ops.lora_linear``. This module decides which layers qualify (one active vanilla
adapter, no DoRA/variant, no LoRA bias, dropout 0, not merged, a frozen ``nn.Linear`` or bitsandbytes ``Linear4bit``
base, not ``fan_in_fan_out``) and gives each an instance ``forward`` through the ledger. At call time anything
unusual (adapters disabled, merged, ``adapter_names`` mixing) runs PEFT's own forward. A 4-bit base's weight is
dequantized at each call, unless ``dequant_cache`` keeps a dequantized copy of it.

Groups (``groups=True``, the ``lora_groups`` switch): sibling layers that read the same input (``GROUPS``: a layer's
q/k/v, its gate/up) run ``ops.lora_linear.grouped_lora_linear``: whichever member is called first computes all of
them for that input, the others return theirs when called with the same tensor (anything else computes afresh), so
the model's own forward is untouched. A group needs the same adapter, scaling, factor dtypes, base kind and input
width in every member, and biases in all or none.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..ops.lora_linear import fused_lora_linear, grouped_lora_linear
from .dequant_cache import dequantize, dequantize_into, kept_group, kept_weight
from .ledger import PatchLedger

logger = logging.getLogger(__name__)


def _dense_weight(base: nn.Linear) -> Callable[[torch.dtype], torch.Tensor]:
    def weight(dtype: torch.dtype) -> torch.Tensor:
        return base.weight.to(dtype)

    return weight


def _nf4_weight(base: nn.Module) -> Callable[[torch.dtype], torch.Tensor]:
    def weight(dtype: torch.dtype) -> torch.Tensor:
        kept = kept_weight(base, dtype)  # dequant_cache's copy, where it keeps one
        return kept if kept is not None else dequantize(base, dtype)

    return weight


def _stacked_weight(bases: list[nn.Module], four_bit: bool) -> Callable[[torch.dtype], torch.Tensor]:
    """The frozen weights of a group's bases stacked by rows: dequant_cache's stacked copy where it keeps one."""
    def weight(dtype: torch.dtype) -> torch.Tensor:
        if not four_bit:
            return torch.cat([b.weight.to(dtype) for b in bases])
        kept = kept_group(bases, dtype)
        if kept is not None:
            return kept
        out = torch.empty(sum(b.out_features for b in bases), bases[0].in_features, dtype=dtype,
                          device=bases[0].weight.device)
        row = 0
        for base in bases:
            rows, kept_one = out[row:row + base.out_features], kept_weight(base, dtype)
            if kept_one is not None:
                rows.copy_(kept_one)
            else:
                dequantize_into(base, rows)
            row += base.out_features
        return out

    return weight


def _is_linear4bit(module: nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def _is_lora_linear(module: nn.Module) -> bool:
    """PEFT's LoRA wrapper of a Linear (dense or bitsandbytes), not Embedding/Conv/ParamWrapper."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return False
    if isinstance(module, LoraLinear):
        return True
    try:
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except ImportError:
        return False
    return isinstance(module, LoraLinear4bit)


def why_not_fusable(module: nn.Module) -> Optional[str]:
    """None when ``module`` can run the fused forward; else the reason (for the one message per reason)."""
    if not _is_lora_linear(module):
        return "not a PEFT LoRA Linear"
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1:
        return "more than one active adapter"
    name = active[0]
    base = module.get_base_layer()
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out (Conv1D) base"
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False):
        return "a LoRA variant (DoRA or similar)"
    if getattr(module, "lora_bias", {}).get(name, False) or module.lora_B[name].bias is not None:
        return "LoRA bias"
    dropout = module.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and not (isinstance(dropout, nn.Dropout) and dropout.p == 0):
        return "lora_dropout > 0"
    if not isinstance(module.lora_A[name], nn.Linear) or not isinstance(module.lora_B[name], nn.Linear):
        return "non-Linear LoRA factors"
    if _is_linear4bit(base):
        if getattr(base.weight, "quant_state", None) is None:
            return "4-bit weight without quant_state"
    elif type(base) is not nn.Linear:
        return f"base layer {type(base).__name__}"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "trainable base weight"
    return None


def _fused_forward(module: nn.Module, name: str, weight_fn: Callable) -> Callable[..., torch.Tensor]:
    cls_forward = type(module).forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if (args or kwargs or module.disable_adapters or module.merged
                or module.active_adapters != [name] or not x.is_floating_point()):
            return cls_forward(module, x, *args, **kwargs)  # PEFT's own path for anything unusual
        base = module.get_base_layer()
        return fused_lora_linear(x, module.lora_A[name].weight, module.lora_B[name].weight, base.bias,
                                 module.scaling[name], weight_fn)

    return forward


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings that read the same input


def _active(module: nn.Module) -> str:
    return next(a for a in module.active_adapters if a in module.lora_A)


def _groupable(members: list[nn.Module]) -> bool:
    """Whether fusable LoRA layers can run as one (``grouped_lora_linear``'s requirements)."""
    def key(m: nn.Module) -> tuple:
        name, base = _active(m), m.get_base_layer()
        return (name, m.scaling[name], m.lora_A[name].weight.dtype, m.lora_B[name].weight.dtype,
                _is_linear4bit(base), base.in_features, base.weight.device, base.bias is not None)

    return len({key(m) for m in members}) == 1


def lora_groups(model: nn.Module) -> list[list[nn.Module]]:
    """The groups of fusable LoRA layers that read one input (``GROUPS``, siblings of one parent), in model order."""
    found = []
    for parent in model.modules():
        for names in GROUPS:
            members = [parent._modules.get(n) for n in names]  # children only: PEFT wrappers forward getattr
            if all(m is not None and _is_lora_linear(m) and why_not_fusable(m) is None for m in members) \
                    and _groupable(members):
                found.append(members)
    return found


class _Group:
    """LoRA layers of one parent that read the same input: the first one called computes every member's output for
    that input, and each other member takes its own when called with the same tensor (once)."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self.name = _active(members[0])
        self.bases = [m.get_base_layer() for m in members]
        self.weight_fn = _stacked_weight(self.bases, _is_linear4bit(self.bases[0]))
        self._input: Optional[torch.Tensor] = None
        self._waiting: dict[int, torch.Tensor] = {}

    def usual(self) -> bool:
        """Every member in the state the fused path assumes (adapters on, not merged, this adapter alone)."""
        return all(not m.disable_adapters and not m.merged and m.active_adapters == [self.name] for m in self.members)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is x and index in self._waiting:
            out = self._waiting.pop(index)
            if not self._waiting:
                self._input = None  # every output handed out: hold nothing
            return out
        name = self.name
        biases = [b.bias for b in self.bases] if self.bases[0].bias is not None else None
        outs = grouped_lora_linear(x, [m.lora_A[name].weight for m in self.members],
                                   [m.lora_B[name].weight for m in self.members], biases,
                                   self.members[0].scaling[name], self.weight_fn)
        self._waiting = {i: o for i, o in enumerate(outs) if i != index}
        self._input = x if self._waiting else None
        return outs[index]


def _grouped_forward(module: nn.Module, group: _Group, index: int,
                     single: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or not x.is_floating_point() or not group.usual():
            return single(x, *args, **kwargs)  # the member's own (fused or PEFT's) path
        return group.output(index, x)

    return forward


class FusedLoRA:
    """Speedup: PEFT LoRA Linear layers run ``fused_lora_linear`` while attached (instance ``forward``, reversible);
    with ``groups``, the sibling layers that read one input run ``grouped_lora_linear`` (``lora_groups``)."""

    name = "fused_lora"

    def __init__(self, groups: bool = False) -> None:
        self.groups = groups
        self._modules: list[nn.Module] = []
        self.grouped: list[_Group] = []
        self.skipped: dict[str, int] = {}
        self._ledger = PatchLedger(self.name)

    def attach(self, model: nn.Module) -> bool:
        self.detach()
        for module in model.modules():
            if not _is_lora_linear(module):
                continue
            reason = why_not_fusable(module)
            if reason is not None:
                self.skipped[reason] = self.skipped.get(reason, 0) + 1
                continue
            name = _active(module)
            base = module.get_base_layer()
            weight_fn = _nf4_weight(base) if _is_linear4bit(base) else _dense_weight(base)
            self._ledger.set(module, "forward", _fused_forward(module, name, weight_fn))
            self._modules.append(module)
        if self.groups:
            for members in lora_groups(model):
                group = _Group(members)
                for index, member in enumerate(members):
                    single = member.forward  # the fused forward just set
                    self._ledger.set(member, "forward", _grouped_forward(member, group, index, single))
                self.grouped.append(group)
        for reason, n in self.skipped.items():
            logger.warning("nbkit: fused_lora skips %d LoRA layer(s): %s (they keep PEFT's forward)", n, reason)
        return bool(self._modules)

    def detach(self) -> None:
        self._ledger.undo()
        self._modules = []
        self.grouped = []

    @property
    def fused_layers(self) -> int:
        return len(self._modules)
