"""What an export starts from: a saved adapter folder or a model folder, and the 16-bit base weights.

- ``describe(path)``: a ``Source`` -- ``kind`` "adapter" (an ``adapter_config.json`` is there; ``base`` is its
  ``base_model_name_or_path``) or "model" (a ``config.json``).
- ``load_16bit_base(name)``: the base model's original weights in float32 on the CPU (a folder or a Hub id the cache
  holds). A base saved 4-bit (a ``quantization_config`` in its config) is loaded and dequantized instead.
- ``dequantized_copy(model)``: a plain float32 model from an in-memory (PEFT-wrapped) bitsandbytes 4-bit model: each
  4-bit weight dequantized exactly as its layer computes with it, adapters left out. For when the 16-bit base is not
  at hand; the model passed in is not changed.
- ``saved_dtype(name)``: the dtype a model's config says its weights are stored in (float32 when it says none).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass
class Source:
    kind: str  # "adapter" or "model"
    path: Path
    base: str | None = None  # the adapter's base model (folder or Hub id)


def describe(path: str | Path, base: str | None = None) -> Source:
    """What ``path`` holds; ``base`` overrides the base an adapter folder names."""
    folder = Path(path).expanduser()
    if (folder / "adapter_config.json").is_file():
        named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        return Source("adapter", folder, base or named)
    if (folder / "config.json").is_file():
        return Source("model", folder, None)
    raise FileNotFoundError(f"{folder} holds neither adapter_config.json (a saved adapter) nor config.json (a model)")


def _config_dict(name: str) -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name).to_dict()


def saved_dtype(name: str) -> torch.dtype:
    """The weights' dtype per the model's config (``dtype`` / ``torch_dtype``); float32 when it names none."""
    config = _config_dict(name)
    value = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    resolved = getattr(torch, str(value).replace("torch.", ""), None) if value else None
    return resolved if isinstance(resolved, torch.dtype) else torch.float32


def load_16bit_base(name: str) -> torch.nn.Module:
    """The base model ``name`` in float32 on the CPU, its original weights (dequantized if it was saved 4-bit)."""
    from transformers import AutoModelForCausalLM

    if _config_dict(name).get("quantization_config"):
        model = AutoModelForCausalLM.from_pretrained(name, device_map={"": "cpu"})
        logger.warning("nbkit export: the base %s is saved quantized; merging into its dequantized weights", name)
        return dequantized_copy(model)
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, device_map={"": "cpu"})


def _plain_key(name: str) -> str | None:
    """A PEFT-wrapped parameter's name in the plain model; None for adapter weights."""
    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts) or "modules_to_save" in parts:
        return None
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))


def dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 CPU model with ``model``'s base weights, each bitsandbytes 4-bit weight dequantized."""
    from transformers import AutoModelForCausalLM

    from ..speedups.ledger import unwrap_model

    base = unwrap_model(model)
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("cpu"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        from bitsandbytes.functional import dequantize_4bit
        from bitsandbytes.nn import Params4bit
    except ImportError:  # no bitsandbytes: nothing can be 4-bit
        Params4bit, dequantize_4bit = (), None
    state: dict[str, torch.Tensor] = {}
    for name, param in list(base.named_parameters()) + list(base.named_buffers()):
        key = _plain_key(name)
        if key is None:
            continue
        if Params4bit and isinstance(param, Params4bit):
            value = dequantize_4bit(param.data, param.quant_state)
        elif param.dtype in (torch.int8, torch.uint8):
            raise ValueError(f"nbkit export: {name} is stored as {param.dtype}; only 4-bit (bitsandbytes) and "
                             "16/32-bit bases can be dequantized")
        else:
            value = param.data
        state[key] = value.detach().to("cpu", torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied and not k.endswith("inv_freq")]
    if missing:
        raise ValueError(f"nbkit export: the dequantized base lacks {missing[:5]}")
    plain.tie_weights()
    return plain.eval()
