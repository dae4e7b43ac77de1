"""What an export starts from: a saved adapter folder or a model folder, and the 16-bit base weights.

- ``describe(path)``: a ``Source`` -- ``kind`` "adapter" (an ``adapter_config.json`` is there; ``base`` is its
  ``base_model_name_or_path``, found by ``resolve_base``) or "model" (a ``config.json``).
- ``resolve_base(name, adapter_dir)``: the base as ``from_pretrained`` should get it -- a local folder when one
  matches (a relative name is tried against the working directory, then the adapter's folder and those above it),
  else the name as a Hub id; ``BaseModelNotFoundError`` at once when it is no local folder and the Hub cannot give
  it (offline or unreachable, not cached), naming the base, the places looked in and ``--base``.
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
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .push import hub_reachable

logger = logging.getLogger(__name__)


class BaseModelNotFoundError(FileNotFoundError):
    """The base model an adapter needs is neither a local folder nor something the Hub can give here."""


@dataclass
class Source:
    kind: str  # "adapter" or "model"
    path: Path
    base: str | None = None  # the adapter's base model (folder or Hub id)


def describe(path: str | Path, base: str | None = None) -> Source:
    """What ``path`` holds; ``base`` overrides the base an adapter folder names. Either is found by
    ``resolve_base`` (``base`` against the working directory only: it was typed there)."""
    folder = Path(path).expanduser()
    if (folder / "adapter_config.json").is_file():
        named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        name = base or named
        return Source("adapter", folder, resolve_base(name, folder, given=bool(base)) if name else None)
    if (folder / "config.json").is_file():
        return Source("model", folder, None)
    raise FileNotFoundError(f"{folder} holds neither adapter_config.json (a saved adapter) nor config.json (a model)")


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def resolve_base(name: str, adapter_dir: str | Path, *, given: bool = False) -> str:
    """The base model ``name`` as ``from_pretrained`` should get it: a local model folder if one matches, else
    ``name`` itself (a Hub id).

    Why: ``adapter_config.json`` records the base as training was given it, often a path relative to that run's
    working directory (the demo's ``nbkit-demo-out/base``); from any other directory transformers takes it for a Hub
    id and retries the network before failing. A relative ``name`` is tried against the working directory (what
    ``from_pretrained`` alone does), then, unless ``given`` (a ``--base`` typed here), against ``adapter_dir`` and
    each folder above it; the first holding a ``config.json`` wins, returned absolute. A name that is no local folder
    goes on unchanged when it can be a Hub id and the Hub can give it (the cache holds it, or the Hub is reachable);
    otherwise ``BaseModelNotFoundError``, before any download is tried.
    """
    adapter = Path(os.path.abspath(Path(adapter_dir).expanduser()))
    wanted = Path(name).expanduser()
    if wanted.is_absolute():
        places = [wanted]
    else:
        roots = [Path.cwd()] + ([] if given else [adapter, *adapter.parents])
        places = list(dict.fromkeys(Path(os.path.abspath(root / wanted)) for root in roots))
    for place in places:
        if (place / "config.json").is_file():
            return str(place)
    if _is_hub_id(name):
        if _in_hub_cache(name):
            return name
        why = hub_reachable()
        if why is None:
            return name
        hub = f"cannot be read from the Hub ({why}) and the Hugging Face cache does not hold it"
    else:
        hub = "is not a Hub id either"
    what = (f"the --base given, {name!r}," if given
            else f"{adapter / 'adapter_config.json'} records the base model {name!r}, which")
    raise BaseModelNotFoundError(
        f"{what} is not a local model folder (looked for config.json in {', '.join(map(str, places))}) and {hub}. "
        "Pass --base <folder or hub id> (base= from Python): the folder the base model was saved to (the demo's "
        "is <output-dir>/base), or its Hub id."
    )


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

    from ..model_parts import unwrap_model

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
