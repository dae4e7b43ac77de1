"""llama.cpp itself runs nbkit's GGUF files of a real model, SmolLM2-135M-Instruct: f16, q8_0 and q4_k_m.

Skipped, with the reason, where llama-cpp-python (``llama_cpp``) is not importable. Each file is loaded by
``llama_cpp.Llama`` (CPU, one thread) and:
- its tokenizer turns the chat prompt, rendered from the file's own chat template, into the ids transformers'
  tokenizer gives (the template applied the same way on both sides);
- it answers that prompt by greedy decoding (temperature 0), and its next-token logits over the prompt stay within
  the exporter's ``BOUND`` for the type (relative: max |diff| / max |logit|) of transformers' on the source model;
- f16: its first ``TOKENS`` greedy tokens are nbkit's own greedy answer (``nbkit.chat.answer``, transformers'
  ``generate`` on the source in float32) and its prompt logits within ``F16_TOLERANCE`` of the source's, top-1
  on every position (measured: 0.0019, fp16 weights and llama.cpp's fp16 KV cache);
- q8_0 and q4_k_m: the answer starts with the same ``QUANT_PREFIX`` tokens as nbkit's (measured: 5 and 9 of 16).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbkit.export.gguf import BOUND, export_gguf

pytest_plugins = ["conftest_real_model"]

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: no llama.cpp runtime")

PROMPT = "Write one sentence about the sea."
TOKENS = 16
F16_TOLERANCE = 0.01
QUANT_PREFIX = 3
QUANTS = ("f16", "q8_0", "q4_k_m")


@pytest.fixture(scope="module")
def source(smollm2_dir):
    """(tokenizer, float32 model, prompt ids, nbkit's greedy answer ids, the model's prompt logits)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbkit.chat import answer, prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    ids = prompt_ids(tokenizer, [{"role": "user", "content": PROMPT}], torch.device("cpu"))
    ours = answer(model, tokenizer, PROMPT, max_new_tokens=TOKENS, stream=False, fast=False).token_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].numpy()
    return tokenizer, ids[0].tolist(), ours, logits


@pytest.fixture(scope="module")
def files(smollm2_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-cpp-runtime")
    return {q: export_gguf(smollm2_dir, folder / f"smollm2-{q}.gguf", quant=q, check_logits=False,
                           modelfile=False).path for q in QUANTS}


def run(path, ids):
    """(llama.cpp's ids for the chat prompt rendered from the file's template, its prompt logits, greedy ids)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    try:
        template = llm.metadata["tokenizer.chat_template"]
        eos = llm.detokenize([llm.token_eos()], special=True).decode()
        rendered = Jinja2ChatFormatter(template, eos_token=eos, bos_token="")(
            messages=[{"role": "user", "content": PROMPT}]).prompt
        own_ids = llm.tokenize(rendered.encode(), add_bos=False, special=True)
        llm.eval(ids)
        logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
        greedy = []
        for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            greedy.append(token)
            if token == llm.token_eos() or len(greedy) == TOKENS:
                break
    finally:
        llm.close()
    return own_ids, logits, greedy


@pytest.mark.parametrize("quant", QUANTS)
def test_llama_cpp_loads_the_file_and_answers_the_chat_prompt(files, source, quant):
    tokenizer, ids, ours, reference = source
    own_ids, logits, greedy = run(files[quant], ids)
    assert own_ids == ids  # llama.cpp's tokenizer and the file's chat template give transformers' prompt
    rel = float(np.abs(logits - reference).max() / np.abs(reference).max())
    top1 = float((logits.argmax(-1) == reference.argmax(-1)).mean())
    print(f"{quant}: llama.cpp vs the source over the prompt: relative {rel:.4f}, top-1 {top1:.1%}; "
          f"answer {tokenizer.decode(greedy)!r}")
    assert rel <= BOUND[quant], rel
    assert greedy and tokenizer.decode(greedy, skip_special_tokens=True).strip()
    if quant == "f16":
        assert rel <= F16_TOLERANCE and top1 == 1.0, (rel, top1)
        assert len(greedy) == TOKENS and greedy == ours[:TOKENS], (tokenizer.decode(greedy), tokenizer.decode(ours))
    else:
        assert greedy[:QUANT_PREFIX] == ours[:QUANT_PREFIX], (tokenizer.decode(greedy), tokenizer.decode(ours))
