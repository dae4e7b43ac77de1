"""A dense decoding copy of a (4-bit, LoRA-adapted) model: each linear layer's base weight dequantized once, its
active LoRA adapters added, in the compute dtype; everything else (embeddings, norms, buffers) shared, not copied.

Why: at batch size 1 a decode step reads every weight once. Through bitsandbytes and PEFT that is a 4-bit
dequantizing matrix-vector kernel plus three or four adapter kernels per linear layer; on the dense copy it is one
cuBLAS call. Where the GPU has room for the copy (``fits``), chat decodes on it (``nbkit.fast_decode``).

Contract:
- ``build(model)``: the copy, a model of the same transformers class in eval mode on the model's device, whose
  forward computes what ``model``'s forward computes with each linear layer's weight replaced by
  ``dequantize(W) + sum of the active adapters' delta weights``, summed in float32 and rounded once to the compute
  dtype, and computing as bitsandbytes' layers do (input cast to the compute dtype, output back to the input's).
  Every other parameter and buffer is the model's own tensor, shared; 16-bit layers without adapters too.
  Adapters the merge cannot express (DoRA, non-LoRA tuners, merged adapters) raise ``ValueError`` naming them.
- ``extra_bytes(model)``: the bytes the copy allocates (the merged and dequantized weights).
- ``fits(model)``: None when the copy fits beside what the process holds now (``FILL`` of the limit the
  process may reach, after the copy), else the reason.
- ``signature(model)``: what the copy depends on (every parameter's storage, the trainable parameters' in-place
  versions, the adapters' switches); a copy built under another signature is stale.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

from .memory import fmt_bytes
from .speedups.ledger import unwrap_model

FILL = 0.8  # the copy may take the process to this fraction of its GPU limit, no further


def _params4bit() -> tuple[Any, Any]:
    try:
        from bitsandbytes.functional import dequantize_4bit
        from bitsandbytes.nn import Params4bit
    except ImportError:  # no bitsandbytes: nothing is 4-bit
        return (), None
    return Params4bit, dequantize_4bit


def _tuners() -> tuple[Any, Any, Any]:
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return (), (), ()
    return LoraLayer, BaseTunerLayer, ModulesToSaveWrapper


def _dense(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` as a plain tensor of ``dtype`` (a 4-bit weight dequantized)."""
    params4bit, dequantize_4bit = _params4bit()
    if params4bit and isinstance(weight, params4bit):
        return dequantize_4bit(weight.data, weight.quant_state).to(dtype)
    if weight.dtype in (torch.int8, torch.uint8):
        raise ValueError(f"a {weight.dtype} weight cannot be made dense (only bitsandbytes 4-bit and 16/32-bit)")
    return weight.data.to(dtype)


def _active(module: Any) -> list[str]:
    if getattr(module, "disable_adapters", False):
        return []
    return [name for name in module.active_adapters if name in getattr(module, "lora_A", {})]


def _merged_weight(module: Any, dtype: torch.dtype) -> torch.Tensor:
    """A LoRA layer's base weight plus its active adapters' deltas, summed in float32, rounded once."""
    base = module.get_base_layer()
    if getattr(module, "merged_adapters", None):
        raise ValueError(f"{type(module).__name__} has merged adapters {module.merged_adapters}: unmerge them first")
    names = _active(module)
    if any(module.use_dora.get(name, False) for name in names):
        raise ValueError("DoRA adapters are not merged into the dense copy")
    params4bit, _ = _params4bit()
    if not names and not (params4bit and isinstance(base.weight, params4bit)):
        return base.weight.data  # nothing to add, 16-bit already: shared
    weight = _dense(base.weight, torch.float32)
    for name in names:
        weight = weight + module.get_delta_weight(name).to(torch.float32)
    return weight.to(dtype)


def _linear_as_bitsandbytes(module: nn.Linear) -> Any:
    """A linear layer that computes in its weight's dtype and returns its input's, as bitsandbytes' 4-bit layers
    do: the rest of the model (norms, embeddings and adapters that training keeps in float32) sees the dtypes the
    original model gives it."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        bias = module.bias
        out = nn.functional.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
        return out.to(x.dtype)

    return forward


def _source(base: nn.Module, name: str) -> nn.Module:
    """The module of ``base`` at ``name`` as it computes now: a PEFT ``ModulesToSaveWrapper`` resolved to the copy it
    runs."""
    _, _, wrapper = _tuners()
    module = base.get_submodule(name) if name else base
    if wrapper and isinstance(module, wrapper):
        active = getattr(module, "active_adapter", None)
        active = active[0] if isinstance(active, (list, tuple)) else active
        if not getattr(module, "disable_adapters", False) and active in module.modules_to_save:
            return module.modules_to_save[active]
        return module.original_module
    return module


def _compute_dtype(base: nn.Module) -> torch.dtype:
    params4bit, _ = _params4bit()
    for param in base.parameters():
        if params4bit and isinstance(param, params4bit):
            return param.quant_state.dtype
    return next(p.dtype for p in base.parameters() if p.is_floating_point())


def build(model: nn.Module) -> nn.Module:
    """The dense decoding copy of ``model`` (see the module docstring)."""
    lora_layer, tuner_layer, _ = _tuners()
    params4bit, _ = _params4bit()
    base = unwrap_model(model)
    dtype = _compute_dtype(base)
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        twin = type(base)(config)
    for name, module in twin.named_modules():
        if not module._parameters and not module._buffers:
            continue
        source = _source(base, name)
        if tuner_layer and isinstance(source, tuner_layer) and not (lora_layer and isinstance(source, lora_layer)):
            raise ValueError(f"{name}: {type(source).__name__} adapters are not merged into the dense copy (LoRA only)")
        is_lora = lora_layer and isinstance(source, lora_layer)
        layer = source.get_base_layer() if is_lora else source
        for key in [k for k, v in module._parameters.items() if v is not None]:
            if key == "weight" and is_lora:
                value = _merged_weight(source, dtype)
            else:
                held = layer._parameters.get(key)
                if held is None:
                    raise ValueError(f"{name}.{key}: no such parameter in the model to copy")
                value = _dense(held, dtype) if params4bit and isinstance(held, params4bit) else held.data
            module._parameters[key] = nn.Parameter(value, requires_grad=False)
        for key in [k for k, v in module._buffers.items() if v is not None]:
            module._buffers[key] = layer._buffers.get(key)
        if isinstance(module, nn.Linear):
            module.forward = _linear_as_bitsandbytes(module)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        twin.tie_weights()
    twin.generation_config = copy.deepcopy(base.generation_config)
    twin.set_attn_implementation(base.config._attn_implementation)
    return twin.eval().requires_grad_(False)


def extra_bytes(model: nn.Module) -> int:
    """Bytes ``build`` allocates: every 4-bit weight dequantized, every adapted 16-bit weight merged."""
    lora_layer, _, _ = _tuners()
    params4bit, _ = _params4bit()
    base = unwrap_model(model)
    size = _compute_dtype(base).itemsize if hasattr(torch.dtype, "itemsize") else 2
    total = 0
    for module in base.modules():
        if lora_layer and isinstance(module, lora_layer):
            weight = module.get_base_layer().weight
            if _active(module) or (params4bit and isinstance(weight, params4bit)):
                total += _shape_numel(weight) * size
        elif params4bit:
            for param in module.parameters(recurse=False):
                if isinstance(param, params4bit) and not _inside_lora(base, module):
                    total += _shape_numel(param) * size
    return total


def _shape_numel(weight: torch.Tensor) -> int:
    quant_state = getattr(weight, "quant_state", None)
    shape = getattr(quant_state, "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else weight.numel()


def _inside_lora(base: nn.Module, module: nn.Module) -> bool:
    lora_layer, _, _ = _tuners()
    return bool(lora_layer) and any(isinstance(m, lora_layer) and m.get_base_layer() is module for m in base.modules())


def fits(model: nn.Module) -> Optional[str]:
    """None when the dense copy fits on the model's GPU now, else why not (see the module docstring)."""
    from .speedups.selective_checkpointing import memory_readings

    base = unwrap_model(model)
    device = next(base.parameters()).device
    readings = memory_readings(device) if device.type == "cuda" else None
    if readings is None:
        return f"the model is on {device.type}, not a CUDA GPU"
    limit, _, allocated = readings
    need = extra_bytes(model)
    if allocated + need > FILL * limit:
        return (f"a dense copy for decoding needs {fmt_bytes(need)} beside the {fmt_bytes(allocated)} in use, past "
                f"{FILL:.0%} of the {fmt_bytes(limit)} this process may use")
    return None


def signature(model: nn.Module) -> tuple:
    """What a dense copy of ``model`` depends on (see the module docstring)."""
    _, tuner_layer, _ = _tuners()
    params = tuple((p.data_ptr(), p._version if p.requires_grad else 0) for p in model.parameters())
    flags = tuple(
        (bool(m.disable_adapters), tuple(m.active_adapters), tuple(m.merged_adapters))
        for m in model.modules() if tuner_layer and isinstance(m, tuner_layer)
    )
    return params, flags
