"""``nbkit.decode.dense`` on a CPU, its step run eagerly (``graphs=False``): the arithmetic the GPU captures.

In float32 the dense step (merged adapters, fused projections, rotary as a matmul, attention over masked buffers)
must give ``generate``'s greedy tokens exactly and its logits to 1e-4, for single prompts and left-padded batches, on
every family it takes and on a real model (SmolLM2); the model is never modified; the copy follows training; what it
cannot take is refused with a reason. The captured step's GPU twin is tests/gpu/test_dense_decode_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from nbkit.chat import answer, decoders_of, dense_decoder, greedy_config, prompt_ids, release_decoders
from nbkit.decode.dense import DenseDecoder
from nbkit.generation import generate_answers

pytest_plugins = ["conftest_real_model"]
QUESTIONS = ["hi", "Reverse the words: red fox moon and the sea", "one two three four"]


@pytest.fixture(scope="module")
def tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _tiny(tok, family, seed=0, **extra):
    from nbkit.demo.models import tiny_model

    if family == "mistral":
        extra.setdefault("sliding_window", None)
    model = tiny_model(family, len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=None, **extra)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = None
    return model


def _lora(model, seed=0, scale=0.2, **extra):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, **extra)
    with torch.random.fork_rng(devices=[]):  # lora_A's init: the same whatever ran before
        torch.manual_seed(seed)
        model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def _ids(tok, question):
    return prompt_ids(tok, [{"role": "user", "content": question}], torch.device("cpu"))


def _reference(model, tok, ids, n, mask=None):
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy_config(model, tok, n))
    return out[:, ids.shape[1]:].tolist()


def _batch(tok, questions):
    side, tok.padding_side = tok.padding_side, "left"
    try:
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                 for q in questions]
        return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tok.padding_side = side


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral"])
def test_tokens_and_logits_equal_generate_in_float32(tok, family, one_thread):
    model = _lora(_tiny(tok, family))
    decoder = DenseDecoder(graphs=False)
    ids = _ids(tok, QUESTIONS[1])
    assert decoder.check(model, ids.shape[1] + 48) is None
    got = decoder.generate(model, ids, greedy_config(model, tok, 48))
    assert got == _reference(model, tok, ids, 48)
    # the logits of the last step against a full forward over the prompt and the tokens before it
    state = decoder._states[1][0]
    full = torch.cat([ids, torch.tensor([got[0][:-1]])], dim=1)
    with torch.no_grad():
        want = model(input_ids=full).logits[0, -1]
    torch.testing.assert_close(state.logits[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_left_padded_batch_equals_generate_row_for_row(tok, family, one_thread):
    model = _lora(_tiny(tok, family))
    batch = _batch(tok, QUESTIONS)
    assert batch["attention_mask"].min() == 0  # the rows are padded
    decoder = DenseDecoder(graphs=False)
    got = decoder.generate(model, batch["input_ids"], greedy_config(model, tok, 32), batch["attention_mask"])
    assert got == _reference(model, tok, batch["input_ids"], 32, batch["attention_mask"])


def test_rows_stop_at_their_own_stop_id_and_pad_after_it(tok, one_thread):
    model = _lora(_tiny(tok, "llama"))
    batch = _batch(tok, QUESTIONS)
    free = DenseDecoder(graphs=False).generate(model, batch["input_ids"], greedy_config(model, tok, 24),
                                               batch["attention_mask"])
    stop = free[1][5]  # a token row 1 makes: with it as the stop id, row 1 ends there
    config = greedy_config(model, tok, 24)
    config.eos_token_id = [stop]
    got = DenseDecoder(graphs=False).generate(model, batch["input_ids"], config, batch["attention_mask"])
    out = model.generate(**batch, generation_config=config)[:, batch["input_ids"].shape[1]:].tolist()
    for row, ref in zip(got, out):
        end = ref.index(stop) + 1 if stop in ref else len(ref)
        assert row == ref[:end]
    assert got[1][-1] == stop and len(got[1]) <= 6


def test_the_real_model_answers_as_generate(smollm2_dir, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = _lora(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32), scale=0.002)
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}], torch.device("cpu"))
    config = greedy_config(model, tokenizer, 40)
    got = DenseDecoder(graphs=False).generate(model, ids, config)[0]
    want = model.generate(input_ids=ids, generation_config=config)[0, ids.shape[1]:].tolist()
    assert got == want
    assert "Paris" in tokenizer.decode(got)


def test_the_model_is_not_modified_and_the_copy_follows_training(tok, one_thread):
    model = _lora(_tiny(tok, "qwen3"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    decoder = DenseDecoder(graphs=False)
    ids = _ids(tok, QUESTIONS[2])
    first = decoder.generate(model, ids, greedy_config(model, tok, 24))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    weights = decoder.weights
    assert decoder.generate(model, ids, greedy_config(model, tok, 24)) == first and decoder.weights is weights
    with torch.no_grad():  # an optimizer step: in place, same storage
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    after = decoder.generate(model, ids, greedy_config(model, tok, 24))
    assert decoder.weights is not weights
    assert after == _reference(model, tok, ids, 24) != first
    with model.disable_adapter():
        assert decoder.generate(model, ids, greedy_config(model, tok, 24)) == _reference(model, tok, ids, 24)


def test_what_it_cannot_take_is_refused_with_a_reason(tok, one_thread, monkeypatch):
    ids = _ids(tok, QUESTIONS[0])
    assert "no CUDA device" == DenseDecoder().check(_tiny(tok, "qwen3"), 64)
    assert "model family 'gemma2'" in DenseDecoder(graphs=False).check(_tiny(tok, "gemma2"), 64)
    model = _tiny(tok, "qwen3")
    model.generation_config.repetition_penalty = 1.2
    assert "repetition_penalty" in DenseDecoder(graphs=False).check(model, 64)
    windowed = _tiny(tok, "mistral", sliding_window=16)
    assert "sliding-window" in DenseDecoder(graphs=False).check(windowed, 64)
    dora = _lora(_tiny(tok, "llama"), use_dora=True)
    decoder = DenseDecoder(graphs=False)
    assert decoder.check(dora, 64) is None
    with pytest.raises(Exception, match="DoRA"):
        decoder.prepare(dora, 1, 64)
    assert "DoRA" in decoder.check(dora, 64)  # remembered until the model changes
    saved = _lora(_tiny(tok, "qwen3"), modules_to_save=["embed_tokens"])
    decoder = DenseDecoder(graphs=False)
    with pytest.raises(Exception, match="input embeddings of type"):
        decoder.prepare(saved, 1, 64)
    import nbkit.decode.dense as dense

    monkeypatch.setattr(dense.memory, "room_for", lambda device, nbytes: False)
    assert "not enough free GPU memory" in DenseDecoder(graphs=False).check(_tiny(tok, "qwen3"), ids.shape[1] + 8)


def test_chat_and_generate_answers_take_the_dense_path_where_it_applies(tok, one_thread):
    model = _lora(_tiny(tok, "qwen3"))
    decoders_of(model).dense = DenseDecoder(graphs=False)  # what a GPU would make
    pieces: list[str] = []
    got = answer(model, tok, QUESTIONS[1], max_new_tokens=24, stream=pieces.append)
    assert got.path == "dense" and got.reason is None
    assert got.token_ids == _reference(model, tok, _ids(tok, QUESTIONS[1]), 24)[0]
    assert "".join(pieces) == got.text
    exact = answer(model, tok, QUESTIONS[1], max_new_tokens=24, stream=False, exact=True)
    assert exact.path == "generate" and exact.token_ids == got.token_ids
    fast = generate_answers(model, tok, QUESTIONS, max_new_tokens=16, batch_size=2)
    assert fast == generate_answers(model, tok, QUESTIONS, max_new_tokens=16, batch_size=2, fast=False)
    assert set(dense_decoder(model)._states) == {1, 2}  # a step per batch size: 1 (chat), 2 (full batch)
    release_decoders(model)
    assert dense_decoder(model).weights is None
