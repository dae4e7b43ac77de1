"""The contract every nbkit speedup follows.

A speedup is an object the trainer owns. ``attach(model)`` installs it on one model and must be reversible:
``detach()`` leaves the model exactly as it found it. Registering a function with transformers under the name
``"nbkit"`` is the only global act a speedup may take, and it must be idempotent. Kernel or mode choice happens
in ``attach``, never in the hot path. What a speedup cannot support it says once, by name, and it then leaves the
model on the plain path (``attach`` returns ``False``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Speedup(Protocol):
    name: str

    def attach(self, model: torch.nn.Module) -> bool:
        """Install on ``model``; return whether it is active (False: plain path kept, reason already logged)."""

    def detach(self) -> None:
        """Undo ``attach``; safe to call twice or without a prior attach."""


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
