"""Out-of-memory errors that name the step, the memory figures and the settings that would make it fit.

Why: free GPUs run out of memory. A careful user wants the error to say where it happened, how much memory is in
use now, and which one or two settings to change, with the failed step's memory given back so the notebook can go
on (a retry in the same kernel must not start from a full device).

Contract (``ReliableTraining`` uses these; each also works on its own):

- ``TrainingOutOfMemoryError`` is a ``torch.OutOfMemoryError``: code that catches that still does, and accelerate's
  ``auto_find_batch_size`` still recognises it (the message keeps the phrase " out of memory.").
- ``out_of_memory_error`` builds it, reading the figures through ``nbkit.memory.device_memory``; ``free_memory``
  gives back what a failed step held (gradients, cached allocator blocks). The caller must drop the original
  exception first (its traceback pins the step's activations): ``forget_exception`` clears those frames.
- ``fit_suggestions`` picks the settings most likely to make a step fit, best first.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
from typing import Any

import torch

from ..memory import DeviceMemory, device_memory, fmt_bytes
from ..speedups.nf4_weights import kept_bytes


class TrainingOutOfMemoryError(torch.OutOfMemoryError):
    """The device ran out of memory during training; the message names the step, the figures and what to change."""


def forget_exception(error: BaseException) -> str:
    """The error's message; its traceback frames are cleared so the tensors they hold (activations) can be freed."""
    message = str(error).strip()
    traceback.clear_frames(error.__traceback__)  # frames still executing (the caller's) are skipped
    error.__traceback__ = None
    return message


def free_memory(model: torch.nn.Module | None = None) -> None:
    """Give back what a failed step held: the model's gradients, unreachable tensors, the allocator's cached blocks."""
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_quantized(model: Any) -> bool:
    base = model
    if hasattr(base, "get_base_model"):  # a PEFT model
        with contextlib.suppress(Exception):
            base = base.get_base_model()
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)
                or getattr(getattr(base, "config", None), "quantization_config", None))


def _param_bytes(model: Any) -> int:
    try:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    except Exception:  # a model without parameters() (never in practice)
        return 0


def fit_suggestions(args: Any, model: Any = None, figures: DeviceMemory | None = None) -> list[str]:
    """The two or three settings most likely to make a step fit, best first.

    Activations grow with tokens per step (batch size x max_length) and shrink with (offloaded) checkpointing; the
    weights shrink with a 4-bit base. When the weights take most of the device, 4-bit comes first; when
    ``dequant_cache`` keeps dequantized copies on the model, turning it off comes before everything.
    """
    tips: list[str] = []
    kept = kept_bytes(model) if isinstance(model, torch.nn.Module) else 0
    if kept:  # memory dequant_cache took after step 1: the first thing to give back
        tips.append(f"dequant_cache=False (gives back the {fmt_bytes(kept)} of 4-bit weights it keeps dequantized)")
    batch = int(getattr(args, "per_device_train_batch_size", 1) or 1)
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    max_length = getattr(args, "max_length", None)
    if batch > 1:
        tips.append(f"per_device_train_batch_size={max(1, batch // 2)} with gradient_accumulation_steps="
                    f"{accumulation * 2} (the same effective batch; about half the activation memory)")
    if max_length and max_length > 128:
        what = "tokens per packed row" if getattr(args, "packing", False) else "the longest row"
        tips.append(f"max_length={max_length // 2} (activations grow with {what})")
    if not getattr(args, "gradient_checkpointing", False):
        tips.append("gradient_checkpointing=True (keeps one layer's activations at a time, recomputes the rest)")
    elif getattr(args, "offload_checkpointing", "auto") is not True:
        tips.append("offload_checkpointing=True (checkpointed layer inputs move to pinned CPU memory)")
    quantized = model is not None and _is_quantized(model)
    if model is not None and not quantized:
        four_bit = "nbkit.load_model(..., load_in_4bit=True) (a 4-bit NF4 base: about a quarter of bf16 weight memory)"
        heavy = figures is not None and figures.total and _param_bytes(model) > 0.5 * figures.total
        tips.insert(0, four_bit) if heavy else tips.append(four_bit)
    return tips[:3]


def out_of_memory_error(
    original: str, *, step: int, micro_batch: int | None, accumulation: int, where: str, args: Any, model: Any,
    device: torch.device | str | None = None,
) -> TrainingOutOfMemoryError:
    """The error ``ReliableTraining`` raises after an OOM (call ``free_memory`` first, so the figures show what is
    left)."""
    figures = device_memory(device)
    at = f"Step {step}"
    if micro_batch is not None and accumulation > 1:
        at += f" (micro-batch {micro_batch} of {accumulation})"
    # the phrase " out of memory." keeps accelerate's auto_find_batch_size recognising the error
    lines = [f"{at} ran out of memory. It failed in {where}."]
    lines.append("Memory now (the failed step's memory was given back): "
                 + (figures.describe() if figures is not None else "no CUDA device, figures unavailable"))
    tips = fit_suggestions(args, model, figures)
    if tips:
        lines.append("To make it fit, change one of:")
        lines += [f"  - {tip}" for tip in tips]
    first = original.splitlines()[0] if original else ""
    lines.append(f"(torch said: {first})")
    return TrainingOutOfMemoryError("\n".join(lines))
