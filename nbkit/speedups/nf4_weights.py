"""The frozen 4-bit weights of bitsandbytes ``Linear4bit`` layers: dequantized on demand, or a copy kept per layer.

Why a module of its own: two sides read it. ``fused_lora`` runs the LoRA layers and asks for each base weight at
every call (``weight_of``); the layer plan decides, per decoder layer, whether that weight stays 4-bit (dequantized
at each call, twice a step) or is kept dequantized for the run (``keep``, set through the caller's ledger so that
detaching drops it). Neither side imports the other: both import this.

Contract: a kept copy is exactly what ``dequantize`` returns in that dtype, so outputs and gradients are bit for bit
those of dequantizing at each call.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

DEQUANTIZED = "nbkit_dequantized"  # the attribute of a Linear4bit that holds its kept copy


def is_linear4bit(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes ``Linear4bit`` (False when bitsandbytes is absent)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


def dequantize(base: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen 4-bit weight of a bitsandbytes ``Linear4bit``, dequantized, in ``dtype``."""
    import bitsandbytes.functional as bnbf

    weight = base.weight
    return bnbf.dequantize_4bit(weight.data, weight.quant_state).to(dtype)


def kept_weight(base: torch.nn.Module, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The copy kept for ``base`` in ``dtype``, or None (then the caller dequantizes)."""
    kept = vars(base).get(DEQUANTIZED)
    return kept if kept is not None and kept.dtype == dtype else None


def weight_of(base: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """``base``'s weight in ``dtype``: its kept copy where there is one, else dequantized now."""
    kept = kept_weight(base, dtype)
    return kept if kept is not None else dequantize(base, dtype)


def dequantized_bytes(base: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes ``base``'s weight takes dequantized in ``dtype``."""
    shape = getattr(base.weight.quant_state, "shape", None)
    numel = int(torch.Size(shape).numel()) if shape is not None else int(base.in_features * base.out_features)
    return numel * dtype.itemsize


def keep(ledger: Any, base: torch.nn.Module, dtype: torch.dtype) -> int:
    """Keep ``base``'s weight dequantized in ``dtype`` (through ``ledger``: its ``undo`` drops the copy); its bytes."""
    with torch.no_grad():
        ledger.set(base, DEQUANTIZED, dequantize(base, dtype))
    return dequantized_bytes(base, dtype)


def kept_bytes(model: torch.nn.Module) -> int:
    """Bytes of the copies kept on ``model``'s modules now (0: none)."""
    kept = (vars(m).get(DEQUANTIZED) for m in model.modules())
    return sum(t.numel() * t.element_size() for t in kept if isinstance(t, torch.Tensor))
