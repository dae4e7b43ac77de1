"""Unsloth's saving methods on the model ``FastLanguageModel`` returns: merged weights, GGUF files, the Hub.

Why: Unsloth's recipes end with ``model.save_pretrained_merged(dir, tokenizer, save_method="merged_16bit")`` and
``model.save_pretrained_gguf(dir, tokenizer, quantization_method="q4_k_m")``; these run nbkit's export under them.

Contract (``attach(model)`` binds the four methods on that one model object):

- ``save_pretrained_merged(save_directory, tokenizer, save_method="merged_16bit")``: ``"merged_16bit"``:
  ``nbkit.save_merged`` (the adapter merged into the original base, saved in the base's dtype, checked by logits);
  ``"merged_4bit"`` / ``"merged_4bit_forced"``: that merged model quantized to bitsandbytes NF4 and saved (for
  transformers inference; GGUF and llama.cpp want the 16-bit one); ``"lora"``: the adapter and the tokenizer.
  Returns the ``MergeReport`` (None for ``"lora"``).
- ``save_pretrained_gguf(save_directory, tokenizer, quantization_method="fast_quantized")``: the 16-bit merge into
  ``save_directory``, then one GGUF file per type (a name or a list: Unsloth's ``"not_quantized"`` = f16,
  ``"fast_quantized"`` = q8_0, ``"quantized"`` = q4_k_m, or any of ``nbkit.export.QUANT_TYPES``, any case) written
  beside it as ``<folder name>.<TYPE>.gguf`` by ``nbkit.export_gguf`` (round-trip checked). Returns the paths.
  Types nbkit cannot write are refused before anything is merged.
- ``push_to_hub_merged(repo_id, tokenizer, save_method=..., token=None, private=True)`` and
  ``push_to_hub_gguf(repo_id, tokenizer, quantization_method=..., token=None, private=True)``: the same into a
  temporary folder, uploaded by ``nbkit.export.push.push_to_hub``. Offline (``HF_HUB_OFFLINE`` or no network) they
  raise ``HubOfflineError`` at once, before any work, saying to save locally and upload later.
"""

from __future__ import annotations

import logging
import tempfile
import types
from pathlib import Path
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

SAVE_METHODS = ("merged_16bit", "merged_4bit", "merged_4bit_forced", "lora")
QUANT_NAMES = {"not_quantized": "f16", "fast_quantized": "q8_0", "quantized": "q4_k_m"}


def _quant_types(quantization_method: str | Sequence[str]) -> list[str]:
    from ..export.gguf import QUANT_TYPES

    methods = [quantization_method] if isinstance(quantization_method, str) else list(quantization_method)
    chosen = [QUANT_NAMES.get(m.lower(), m.lower()) for m in methods]
    unknown = [m for m, q in zip(methods, chosen) if q not in QUANT_TYPES]
    if unknown or not chosen:
        raise ValueError(f"quantization_method {unknown or methods!r}: nbkit writes {', '.join(QUANT_TYPES)} (and "
                         f"Unsloth's names {', '.join(QUANT_NAMES)}); other K mixes and i-quants need llama.cpp's "
                         "llama-quantize, run on the f16 file")
    return list(dict.fromkeys(chosen))


def _need_tokenizer(tokenizer: Any, method: str) -> None:
    if tokenizer is None:
        raise TypeError(f"{method}() needs the tokenizer: model.{method}(directory, tokenizer, ...)")


def save_pretrained_merged(model: Any, save_directory: str | Path, tokenizer: Any = None,
                           save_method: str = "merged_16bit", **unused: Any) -> Any:
    """Save ``model`` merged (or its adapter) to ``save_directory`` (module docstring)."""
    from ..export.merge import save_merged

    _need_tokenizer(tokenizer, "save_pretrained_merged")
    _ignore(unused, "save_pretrained_merged")
    if save_method not in SAVE_METHODS:
        raise ValueError(f"save_method={save_method!r}: choose one of {', '.join(SAVE_METHODS)}")
    out = Path(save_directory)
    if save_method == "lora":
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        return None
    if save_method == "merged_16bit":
        return save_merged(model, tokenizer, out)
    with tempfile.TemporaryDirectory(prefix="nbkit-merged-") as merged:
        report = save_merged(model, tokenizer, merged)
        _save_4bit(Path(merged), tokenizer, out)
    report.out_dir = out
    report.notes.append("saved as bitsandbytes NF4 (for transformers inference; export GGUF from merged_16bit)")
    return report


def _save_4bit(merged: Path, tokenizer: Any, out: Path) -> None:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from ..settings import pick_compute_dtype

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=pick_compute_dtype())
    device = {"": torch.cuda.current_device()} if torch.cuda.is_available() else {"": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(str(merged), quantization_config=quant, device_map=device)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def save_pretrained_gguf(model: Any, save_directory: str | Path, tokenizer: Any = None,
                         quantization_method: str | Sequence[str] = "fast_quantized", **unused: Any) -> list[Path]:
    """The 16-bit merge into ``save_directory`` and a GGUF file per type beside it (module docstring)."""
    from ..export.gguf import export_gguf
    from ..export.merge import save_merged

    _need_tokenizer(tokenizer, "save_pretrained_gguf")
    _ignore(unused, "save_pretrained_gguf")
    quants = _quant_types(quantization_method)
    out = Path(save_directory)
    save_merged(model, tokenizer, out)
    paths = []
    for quant in quants:
        report = export_gguf(out, out / f"{out.resolve().name}.{quant.upper()}.gguf", quant=quant, tokenizer=tokenizer)
        paths.append(report.path)
    return paths


def _offline_first(repo_id: str) -> None:
    from ..export.push import HubOfflineError, hub_reachable

    why = hub_reachable()
    if why:
        raise HubOfflineError(
            f"cannot upload to {repo_id}: {why}. Nothing was merged or written: save locally with "
            "model.save_pretrained_merged / model.save_pretrained_gguf, then upload the folder from a machine that "
            "is online (nbkit.export.push.push_to_hub or `hf upload`) after unsetting HF_HUB_OFFLINE "
            "and logging in."
        )


def push_to_hub_merged(model: Any, repo_id: str, tokenizer: Any = None, save_method: str = "merged_16bit",
                       token: str | None = None, private: bool = True, **unused: Any) -> str:
    """Merge as ``save_pretrained_merged`` does and upload the folder to ``repo_id``; returns its URL."""
    from ..export.push import push_to_hub

    _need_tokenizer(tokenizer, "push_to_hub_merged")
    _offline_first(repo_id)
    with tempfile.TemporaryDirectory(prefix="nbkit-push-") as folder:
        save_pretrained_merged(model, folder, tokenizer, save_method=save_method, **unused)
        return push_to_hub(folder, repo_id, token=token, private=private)


def push_to_hub_gguf(model: Any, repo_id: str, tokenizer: Any = None,
                     quantization_method: str | Sequence[str] = "fast_quantized", token: str | None = None,
                     private: bool = True, **unused: Any) -> str:
    """Write the GGUF file(s) as ``save_pretrained_gguf`` does and upload them to ``repo_id``; returns its URL."""
    from ..export.push import push_to_hub

    _need_tokenizer(tokenizer, "push_to_hub_gguf")
    _quant_types(quantization_method)
    _offline_first(repo_id)
    with tempfile.TemporaryDirectory(prefix="nbkit-push-") as folder:
        paths = save_pretrained_gguf(model, Path(folder) / repo_id.split("/")[-1], tokenizer,
                                     quantization_method=quantization_method, **unused)
        url = ""
        for path in paths:
            url = push_to_hub(path, repo_id, token=token, private=private)
        return url


# Unsloth's keywords for its own llama.cpp build and memory planning: nbkit's export needs neither
_IGNORED = {"maximum_memory_usage", "safe_serialization", "temporary_location", "first_conversion",
            "is_main_process", "state_dict", "save_function", "max_shard_size", "push_to_hub", "token"}


def _ignore(unused: dict[str, Any], method: str) -> None:
    unknown = sorted(set(unused) - _IGNORED)
    if unknown:
        raise TypeError(f"{method}() got unexpected keyword argument(s) {unknown}")


METHODS = {"save_pretrained_merged": save_pretrained_merged, "save_pretrained_gguf": save_pretrained_gguf,
           "push_to_hub_merged": push_to_hub_merged, "push_to_hub_gguf": push_to_hub_gguf}


def attach(model: Any) -> Any:
    """Bind the four saving methods on ``model`` (this object only); returns it."""
    for name, function in METHODS.items():
        setattr(model, name, types.MethodType(function, model))
    return model
