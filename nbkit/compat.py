"""Names that changed between the transformers versions nbkit supports (5.17 to the newest 5.x), in one place.

transformers 5.2x renamed gradient checkpointing to activation checkpointing and deprecated the old names (a
FutureWarning on every call). nbkit's own calls use the new name where it exists and the old one elsewhere.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def enable_activation_checkpointing(model: torch.nn.Module, kwargs: Optional[dict[str, Any]] = None) -> None:
    """``activation_checkpointing_enable`` (newer transformers) or ``gradient_checkpointing_enable`` (older)."""
    kwargs = {"use_reentrant": False} if kwargs is None else kwargs
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_args(enabled: bool, kwargs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``TrainingArguments`` keywords that switch checkpointing, under the name this transformers uses."""
    from transformers import TrainingArguments

    new = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    prefix = "activation_checkpointing" if new else "gradient_checkpointing"
    out: dict[str, Any] = {prefix: enabled}
    if kwargs is not None:
        out[f"{prefix}_kwargs"] = kwargs
    return out
