"""``nbkit.decode.dense`` on a CUDA GPU: the captured step is the eager step, and its tokens are ``generate``'s up to
near-ties.

Tolerance, stated: the dense path rounds differently from the model's own step (adapters merged, projections fused,
dense instead of 4-bit matmuls), so its greedy tokens are held to the model's own logits, teacher-forced on the dense
path's tokens: at every step the dense token's logit is the best one, or within ``GAP`` (bf16: 3% of the step's
largest |logit|; float32: 1e-3 of it) of it, and at most 10% of the steps may be such near-ties. A wrong rotary angle,
mask or merge fails this at almost every step. The captured graph must give the eager step's tokens and logits.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4)
QUESTIONS = ["hi", "Reverse the words: red fox moon and the sea", "Tell me about the sea and the wind at night."]
GAP = {torch.bfloat16: 3e-2, torch.float32: 1e-3}


@pytest.fixture(scope="module")
def tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _model(tok, family, dtype):
    from nbkit.demo.models import tiny_model

    model = tiny_model(family, len(tok), dtype=dtype, pad_token_id=tok.pad_token_id, eos_token_id=None, **SHAPE)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.cuda().eval()


def _lora(model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    return model.eval()


def _four_bit(tok):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = _model(tok, "qwen3", torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(folder)
        q = AutoModelForCausalLM.from_pretrained(
            folder, device_map={"": 0}, dtype=torch.bfloat16,
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True,
                                                   bnb_4bit_compute_dtype=torch.bfloat16))
    q.generation_config.eos_token_id = None
    q.generation_config.pad_token_id = tok.pad_token_id
    return _lora(q)


def _batch(tok, questions):
    side, tok.padding_side = tok.padding_side, "left"
    try:
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                 for q in questions]
        return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
    finally:
        tok.padding_side = side


def _config(model, tok, n):
    from nbkit.chat import greedy_config

    return greedy_config(model, tok, n)


def _held_to_the_models_logits(model, ids, mask, rows, gap):
    """Teacher-force the model on each row's prompt + dense tokens; check every dense token against its logits."""
    n = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (n - len(r)) for r in rows], device=ids.device)
    full = torch.cat([ids, tokens], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(tokens)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask).logits.float()
    ties = steps = 0
    for b, row in enumerate(rows):
        for t, token in enumerate(row):
            step = logits[b, ids.shape[1] - 1 + t]
            best = step.max()
            steps += 1
            if step[token] < best:
                ties += 1
                assert best - step[token] <= gap * step.abs().max(), (b, t, float(best - step[token]))
    assert ties <= 0.1 * steps, f"{ties} near-ties in {steps} steps"


@pytest.mark.parametrize("family,dtype", [("qwen3", torch.bfloat16), ("qwen3", torch.float32),
                                          ("llama", torch.bfloat16), ("qwen2", torch.bfloat16), ("4bit", None)])
def test_tokens_are_the_models_up_to_near_ties_single_and_batched(tok, family, dtype):
    from nbkit.decode.dense import DenseDecoder

    model = _four_bit(tok) if family == "4bit" else _lora(_model(tok, family, dtype))
    dtype = dtype or torch.bfloat16
    decoder = DenseDecoder()
    for questions in (QUESTIONS[1:2], QUESTIONS):
        batch = _batch(tok, questions)
        assert decoder.check(model, batch["input_ids"].shape[1] + 64, len(questions)) is None
        rows = decoder.generate(model, batch["input_ids"], _config(model, tok, 64), batch["attention_mask"])
        assert [len(r) for r in rows] == [64] * len(questions)
        _held_to_the_models_logits(model, batch["input_ids"], batch["attention_mask"], rows, GAP[dtype])
    assert decoder.captures == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_captured_step_is_the_eager_step(tok, dtype):
    from nbkit.decode.dense import DenseDecoder

    model = _lora(_model(tok, "qwen3", dtype))
    batch = _batch(tok, QUESTIONS)
    graphed, eager = DenseDecoder(), DenseDecoder(graphs=False)
    args = (model, batch["input_ids"], _config(model, tok, 48), batch["attention_mask"])
    assert graphed.generate(*args) == eager.generate(*args)
    torch.testing.assert_close(graphed._states[3][0].logits, eager._states[3][0].logits)
    assert graphed.captures == 1 and eager.captures == 0


def test_chat_takes_the_dense_path_and_falls_back_when_memory_is_short(tok, monkeypatch):
    import nbkit.decode.dense as dense
    from nbkit.chat import answer, release_decoders

    model = _lora(_model(tok, "qwen3", torch.bfloat16))
    pieces: list[str] = []
    got = answer(model, tok, QUESTIONS[2], max_new_tokens=40, stream=pieces.append)
    assert got.path == "dense", got.reason
    assert "".join(pieces) == got.text
    again = answer(model, tok, QUESTIONS[2], max_new_tokens=40, stream=False)
    assert again.token_ids == got.token_ids
    release_decoders(model)
    monkeypatch.setattr(dense.memory, "room_for", lambda device, nbytes: False)
    model2 = _lora(_model(tok, "qwen3", torch.bfloat16))
    short = answer(model2, tok, QUESTIONS[2], max_new_tokens=40, stream=False)
    assert short.path == "graphed" and "not enough free GPU memory" in short.reason


def test_generate_answers_fast_and_plain_agree_on_most_answers(tok):
    from nbkit.generation import generate_answers

    model = _lora(_model(tok, "qwen3", torch.float32))
    questions = [f"Reverse the words: {a} {b} {c}" for a, b, c in zip("abcdefgh", "ijklmnop", "qrstuvwx")]
    fast = generate_answers(model, tok, questions, max_new_tokens=24, batch_size=4)
    plain = generate_answers(model, tok, questions, max_new_tokens=24, batch_size=4, fast=False)
    from nbkit.chat import decoders_of

    assert decoders_of(model).dense.captures == 1
    assert sum(a == b for a, b in zip(fast, plain)) >= len(questions) - 1, (fast, plain)


def test_the_captured_sampling_step_is_the_eager_one_and_a_seed_repeats(tok):
    """Sampling (``nbkit.ops.sampling`` inside the graph, the noise refilled before each replay): the captured step
    draws the eager step's tokens for a seed (float32: the same kernels, the same noise), a seed repeats, and top-k 1
    is greedy decoding."""
    from nbkit.decode.config import GenerationSettings
    from nbkit.decode.dense import DenseDecoder

    model = _lora(_model(tok, "qwen3", torch.float32))
    batch = _batch(tok, QUESTIONS)
    args = (model, batch["input_ids"], _config(model, tok, 48), batch["attention_mask"])
    graphed = DenseDecoder()
    greedy = graphed.generate(*args)
    for settings in (GenerationSettings(max_new_tokens=48, temperature=1.5, min_p=0.1, seed=0),
                     GenerationSettings(max_new_tokens=48, temperature=0.8, top_p=0.9, top_k=40, seed=1)):
        got = graphed.generate(*args, settings=settings)
        assert got == DenseDecoder(graphs=False).generate(*args, settings=settings)
        assert graphed.generate(*args, settings=settings) == got
        assert got != greedy
    one = GenerationSettings(max_new_tokens=48, temperature=1.0, top_k=1, seed=2)
    assert graphed.generate(*args, settings=one) == greedy
    assert graphed.captures == 3  # greedy, sampling, sampling with top-k/top-p: one graph each, one set of buffers


def test_chat_samples_on_the_dense_path(tok):
    from nbkit.chat import answer

    model = _lora(_model(tok, "qwen3", torch.bfloat16))
    pieces: list[str] = []
    got = answer(model, tok, QUESTIONS[2], max_new_tokens=40, stream=pieces.append, temperature=1.5, min_p=0.1,
                 seed=0)
    assert got.path == "dense", got.reason
    assert "".join(pieces) == got.text
    again = answer(model, tok, QUESTIONS[2], max_new_tokens=40, stream=False, temperature=1.5, min_p=0.1, seed=0)
    assert again.token_ids == got.token_ids
