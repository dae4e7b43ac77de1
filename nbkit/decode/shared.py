"""What every decoding path checks the same way: the reason a path does not apply, the settings that change greedy
choices, what a kept decoder depends on, and the graph backend a decoder captures with.

Why one module: the dense and graphed paths refuse the same things (no device their backend runs on, several
devices, a generation config that changes greedy choices, sliding windows shorter than the conversation) and must
say it in the same words, and they rebuild on the same signal (``parameter_signature``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..model_parts import unwrap_model
from ..ops.layer_graphs import CudaGraphBackend

_GREEDY_CHANGERS = (  # generation-config fields that make greedy decoding differ from a plain argmax
    ("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0), ("bad_words_ids", None), ("min_length", 0),
    ("min_new_tokens", 0), ("forced_bos_token_id", None), ("forced_eos_token_id", None),
    ("suppress_tokens", None), ("begin_suppress_tokens", None), ("sequence_bias", None),
    ("exponential_decay_length_penalty", None), ("guidance_scale", 1.0), ("remove_invalid_values", False),
    ("watermarking_config", None), ("encoder_repetition_penalty", 1.0),
)


class Unsupported(RuntimeError):
    """This model or setting cannot take a fast path; the message is the reason, for one log line."""


def greedy_changers(generation_config: Any) -> list[str]:
    """The generation-config fields that would make ``generate``'s greedy tokens differ from a plain argmax."""
    found = []
    for name, neutral in _GREEDY_CHANGERS:
        value = getattr(generation_config, name, neutral)
        if value is not None and value != neutral and not (neutral == 0 and value == 0):
            found.append(f"{name}={value!r}")
    return found


def parameter_signature(model: torch.nn.Module, versions: bool = False) -> tuple:
    """What a decoder built from ``model`` depends on, in one walk over its modules: where every parameter lives
    (a captured step reads them there) and, with ``versions``, their in-place versions too (a copy of their values
    goes stale when an optimizer steps them in place); and each adapter layer's switches."""
    from ..trl_seam import BaseTunerLayer

    params, flags = [], []
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                params.append((p.data_ptr(), p._version) if versions else p.data_ptr())
        if isinstance(module, BaseTunerLayer):
            flags.append((module.disable_adapters, tuple(module.active_adapters), tuple(module.merged_adapters)))
    return tuple(params), tuple(flags)


def text_config(base: torch.nn.Module) -> Any:
    """The language model's config (a multimodal config's text part)."""
    return base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config


def placement_reason(model: torch.nn.Module, backend: Any) -> str | None:
    """None when ``model`` sits on one device that ``backend`` captures on (``CudaGraphBackend``: a CUDA device;
    ``None``, eager, or a ``TapeBackend``: any), else why not."""
    base = unwrap_model(model)
    needs = getattr(backend, "device_type", None)
    if needs == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    try:
        device = next(base.parameters()).device
    except StopIteration:
        return "the model has no parameters"
    if needs is not None and device.type != needs:
        return f"the model is on {device.type}"
    if getattr(base, "hf_device_map", None) and len(set(map(str, base.hf_device_map.values()))) > 1:
        return "the model is spread over several devices"
    return None


def window_reason(config: Any, total_len: int) -> str | None:
    """Why a sliding-window model cannot decode ``total_len`` positions on a full-length cache, or None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    sliding = window is not None and (types is None or "sliding_attention" in types)
    if getattr(config, "model_type", None) == "qwen2" and not getattr(config, "use_sliding_window", False):
        sliding = False
    if sliding and total_len >= window:
        return f"sliding-window attention ({window} positions) shorter than this conversation ({total_len})"
    return None


def default_backend(graphs: bool) -> Any:
    """The backend a decoder captures its step with: CUDA graphs, or ``None`` (the step runs eagerly)."""
    return CudaGraphBackend() if graphs else None
