"""Finding the parts of a model that nbkit works on: the transformers model under its wrappers, and its decoder layers.

Why one module: the speedups, chat, export and the reliability checks all need "the model that owns ``config``" and
"the decoder layers", and three copies of either drift apart (one wrapper or one transformers version handled in one
copy only). Nothing here changes a model.
"""

from __future__ import annotations

from typing import Optional

import torch


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``PreTrainedModel`` under PEFT / accelerate wrappers (the one that owns ``config``)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):  # PEFT
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP / accelerate
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
    return model


def decoder_layer_class() -> Optional[type]:
    """transformers' ``GradientCheckpointingLayer`` (the base class of every decoder layer with a per-layer
    checkpointing flag); None on a transformers without it."""
    try:
        from .trl_seam import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def is_decoder_layer(module: torch.nn.Module) -> Optional[bool]:
    """Whether ``module`` is a decoder layer; None when this transformers cannot tell (no layer class)."""
    kind = decoder_layer_class()
    return None if kind is None else isinstance(module, kind)


def decoder_layers(model: torch.nn.Module) -> Optional[list[torch.nn.Module]]:
    """The decoder layers of ``model`` (wrappers unwrapped), in module order; None when this transformers has no
    decoder layer class to find them by."""
    kind = decoder_layer_class()
    if kind is None:
        return None
    return [m for m in unwrap_model(model).modules() if isinstance(m, kind)]
