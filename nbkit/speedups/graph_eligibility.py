"""Whether a decoder layer's call can replay as a CUDA graph, and why not: the reasons ``cuda_graphs`` runs a call
eagerly, the variant a set of graphs is captured for, and the checks on a model and a layer that decide them.

Why apart from the graphs: these are the rules a graph's frozen Python imposes (hooks run once, at capture; random
numbers repeat; shapes must be static), stated once; ``cuda_graphs`` applies them and counts what they refuse.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ..ops.layer_graphs import GraphedLayer
from ..ops.recompute_graphs import RecomputedLayer
from .graph_buckets import rope_key

_MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def layer_parameters(layer: torch.nn.Module) -> int:
    """A layer's parameter count, 4-bit weights counted by their unpacked shape."""
    total = 0
    for p in layer.parameters():
        state = getattr(p, "quant_state", None)
        total += int(torch.Size(state.shape).numel()) if state is not None and getattr(state, "shape", None) else p.numel()
    return total


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooked(layer: torch.nn.Module) -> bool:
    """Whether a module inside ``layer`` (not the layer itself: its hooks run around the replay), or every module,
    has hooks: they run in Python, so a graph would run them once, at its capture."""
    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, f"_global{name}", None) for name in _HOOKS):
        return True
    return any(getattr(m, name, None) for m in layer.modules() if m is not layer for name in _HOOKS)


def layer_shape(layer: torch.nn.Module) -> tuple:
    """What makes two decoder layers run the same kernels on the same shapes: their class, attention type and
    parameters' shapes and dtypes. One warm-up per shape in a capture call (a warm-up is a whole eager forward and
    backward of the layer); the layers after it capture on the kernels and workspaces it made."""
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in layer.named_parameters())
    return type(layer), rope_key(layer), params


class Kind(enum.Enum):
    """What the code does with a reason a layer call runs eagerly."""

    THIS_CALL = "this call"  # the forward's shape or arguments: the next forward may replay
    CHECKPOINTED = "checkpointed"  # recomputed in backward: captured at its next call once un-checkpointed
    LASTING = "lasting"  # this layer stays eager in this variant (hooks, unreached parameters, failed capture, memory)


@dataclass(frozen=True)
class Eager:
    """Why a layer call runs eagerly: ``text`` is what is said once and counted in ``CudaGraphs.eager``."""

    text: str
    kind: Kind = Kind.THIS_CALL


NOT_TRAINING = Eager("not training")
CHECKPOINTED = Eager("checkpointed layer", Kind.CHECKPOINTED)
HOOKED = Eager("hooks inside the layer", Kind.LASTING)
UNREACHED = Eager("trainable parameters the graph does not reach (held by reference outside their module)",
                  Kind.LASTING)
CAPTURE_FAILED = Eager("capture failed", Kind.LASTING)
TOO_MANY_CAPTURES = Eager("too many captures")
OTHER_ROPE = Eager("position embeddings differ between layers of one type")
OTHER_GRAD = Eager("the input's requires_grad differs from the capture's")
OTHER_TURN = Eager("a forward of another bucket awaits its backward (their graphs share a pool)")


@dataclass(frozen=True)
class Variant:
    """What one set of graphs is captured for: the same for every layer of one forward, decided at its first."""

    bucket: int
    autocast: tuple  # (enabled, dtype) on the input's device
    constants: tuple  # the bool/int/float/str keyword arguments, sorted
    tokenwise: tuple  # which per-token arguments are given


Entry = Union[GraphedLayer, RecomputedLayer, Eager]


def stale(entry: Entry, kept: bool) -> bool:
    """Whether a layer's entry in a variant is captured again at its next call: it had no graphs because the plan
    did not graph it then, or it has the graphs of the other plan (kept: ``GraphedLayer``; checkpointed:
    ``RecomputedLayer``)."""
    if isinstance(entry, Eager):
        return entry.kind is Kind.CHECKPOINTED
    return isinstance(entry, GraphedLayer) != kept


def layer_reason(runner: Any, layer: Any) -> Optional[Eager]:
    """Why this layer's call runs eagerly whatever the forward (None: it may run on graphs)."""
    if not layer.module.training or not torch.is_grad_enabled():
        return NOT_TRAINING
    if not runner.plans[layer.index].graphed:
        return CHECKPOINTED
    return None


def why_not_model(base: torch.nn.Module, layers: list[torch.nn.Module]) -> Optional[str]:
    config = getattr(base, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if any(getattr(text, key, None) for key in _MOE_CONFIG_KEYS):
        return "a MoE model (its experts' shapes depend on the routing)"
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout > 0 (a graph would repeat its random numbers)"
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, torch.nn.Dropout) and m.p > 0:
                return "dropout > 0 in a decoder layer (a graph would repeat its random numbers)"
    return None
