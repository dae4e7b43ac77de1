"""What the three Unsloth recipe tests share: the real SmolLM2 as a float32 folder, synthetic rows in the notebooks'
data formats, and llama.cpp answering from an exported GGUF file.

Why float32: the recipes end in ``save_pretrained_merged``, which saves in the base's own dtype and holds the reloaded
merge to that dtype's rounding; the stored SmolLM2 folder is bfloat16, whose rounding of a trained merge can pass the
current bfloat16 tolerance by a hair or not. A float32 base makes the merge exact up to summation order, so the
recipes check the steps after training, not bfloat16's rounding.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest_plugins = ["conftest_real_model"]

TOPICS = ["the sea", "a mountain", "rain", "a city at night", "a small cat", "the moon", "bread", "a river",
          "winter", "a library"]
ROWS = 200


@pytest.fixture(scope="session")
def smollm2_fp32_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct saved as float32 weights with its tokenizer (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.getbasetemp() / "smollm2-135m-instruct-fp32"
    if not (folder / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
        model.config.dtype = torch.float32
        model.save_pretrained(str(folder))
        AutoTokenizer.from_pretrained(str(smollm2_dir)).save_pretrained(str(folder))
    return folder


def _pair(rng: random.Random) -> tuple[str, str]:
    topic = rng.choice(TOPICS)
    words = rng.randint(3, 6)
    return f"Describe {topic} in {words} words.", " ".join([topic.split()[-1].capitalize()] + ["calm"] * (words - 1)) + "."


def sharegpt_rows(n: int = ROWS, seed: int = 0) -> list[dict]:
    """ShareGPT chats (FineTome's form): ``conversations`` of ``from``/``value`` turns, some two turns long."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for _ in range(1 + (i % 3 == 0)):
            question, answer = _pair(rng)
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        rows.append({"conversations": turns, "source": "synthetic", "score": 1.0})
    return rows


def alpaca_rows(n: int = ROWS, seed: int = 0) -> list[dict]:
    """Alpaca rows (alpaca-cleaned's form): ``instruction``, ``input``, ``output``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        if i % 2:
            rows.append({"instruction": "Add the two numbers.", "input": f"{a}, {b}", "output": f"{a + b}"})
        else:
            question, answer = _pair(rng)
            rows.append({"instruction": question, "input": "", "output": answer})
    return rows


def llama_cpp_answers(path: Path, prompt_ids: list[int], tokens: int = 8) -> list[int]:
    """The first ``tokens`` greedy tokens llama.cpp generates from ``prompt_ids`` with the GGUF file at ``path``."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: no llama.cpp runtime")
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, verbose=False)
    try:
        out = []
        for token in llm.generate(prompt_ids, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if token == llm.token_eos() or len(out) == tokens:
                break
    finally:
        llm.close()
    return out
