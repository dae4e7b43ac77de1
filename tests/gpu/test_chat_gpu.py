"""``nbkit.chat``'s graphed path on a CUDA GPU (``exact=True``): the captured decode step gives generate's greedy
tokens exactly. (The dense path, taken first without ``exact``, is tests/gpu/test_dense_decode_gpu.py's.)

Exactness, not a tolerance: the fast path replays the same kernels on the same shapes, so the token ids must equal
``model.generate(do_sample=False)``'s one for one (and the logits of a step bit for bit).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4)
PROMPTS = ["Reverse the words: red fox moon", "Tell me about the sea and the wind at night."]


@pytest.fixture(scope="module")
def tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _model(tok, family, dtype, **extra):
    from nbkit.demo.models import tiny_model

    kw = dict(SHAPE, **extra)
    if family in ("gemma2", "gemma3"):
        kw["sliding_window"] = 4096  # longer than the test's chats
    model = tiny_model(family, len(tok), dtype=dtype, pad_token_id=tok.pad_token_id, eos_token_id=None, **kw)
    model.generation_config.eos_token_id = None
    return model.cuda().eval()


def _lora(model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    return model


def _plain(model, tok, prompt, n):
    from nbkit.chat import greedy_config, prompt_ids

    ids = prompt_ids(tok, [{"role": "user", "content": prompt}], torch.device("cuda"))
    out = model.generate(input_ids=ids, generation_config=greedy_config(model, tok, n))
    return [int(t) for t in out[0, ids.shape[1]:].tolist()]


@pytest.mark.parametrize("family,dtype", [("qwen3", torch.bfloat16), ("qwen3", torch.float32),
                                          ("llama", torch.bfloat16), ("qwen2", torch.bfloat16),
                                          ("gemma2", torch.bfloat16), ("gemma3", torch.bfloat16)])
def test_graphed_tokens_equal_generate(tok, family, dtype):
    from nbkit.chat import answer

    model = _model(tok, family, dtype)
    for prompt in PROMPTS:
        got = answer(model, tok, prompt, max_new_tokens=64, stream=False, exact=True)
        assert got.path == "graphed", got.reason
        assert got.token_ids == _plain(model, tok, prompt, 64)


def test_graphed_tokens_equal_generate_on_a_4bit_base_with_lora(tok):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from nbkit.chat import answer

    base = _model(tok, "qwen3", torch.bfloat16)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(folder)
        q = AutoModelForCausalLM.from_pretrained(folder, device_map={"": 0}, dtype=torch.bfloat16,
                                                 quantization_config=BitsAndBytesConfig(
                                                     load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                     bnb_4bit_use_double_quant=True,
                                                     bnb_4bit_compute_dtype=torch.bfloat16))
    q.generation_config.eos_token_id = None
    model = _lora(q)
    model.train()
    got = answer(model, tok, PROMPTS[1], max_new_tokens=48, stream=False, exact=True)
    assert got.path == "graphed", got.reason
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    assert got.token_ids == _plain(model, tok, PROMPTS[1], 48)
    with model.disable_adapter():  # the adapters' switch changes the step: recaptured, still exact
        off = answer(model, tok, PROMPTS[1], max_new_tokens=48, stream=False, exact=True)
        assert off.token_ids == _plain(model, tok, PROMPTS[1], 48)
    assert off.token_ids != got.token_ids


def test_a_second_chat_reuses_the_capture_and_a_weight_update_is_seen(tok):
    from nbkit.chat import answer, decoders_of

    model = _lora(_model(tok, "qwen3", torch.bfloat16))
    first = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False, exact=True)
    decoder = decoders_of(model).graphed
    answer(model, tok, PROMPTS[1], max_new_tokens=32, stream=False, exact=True)
    assert decoder.captures == 1
    with torch.no_grad():  # an optimizer step updates parameters in place: the graphs read them where they are
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    again = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False, exact=True)
    assert decoder.captures == 1
    assert again.token_ids == _plain(model, tok, PROMPTS[0], 32) != first.token_ids


def test_streamed_text_is_the_answer_and_it_stops_at_end_of_turn(tok):
    from nbkit.chat import answer

    model = _model(tok, "qwen3", torch.bfloat16)
    plain = _plain(model, tok, PROMPTS[0], 40)
    stop = plain[5]  # a token the model is known to produce: make it the end-of-turn id
    model.generation_config.eos_token_id = stop
    pieces = []
    got = answer(model, tok, PROMPTS[0], max_new_tokens=40, stream=pieces.append, exact=True)
    assert got.path == "graphed"
    assert got.token_ids == plain[: plain.index(stop) + 1]
    assert "".join(pieces) == got.text


def test_graphed_sampling_is_seeded_and_top_k_one_is_greedy(tok):
    """The graphed path samples from its replayed step's logits on the device: top-k 1 gives generate's greedy
    tokens, a seed repeats its tokens, another seed draws others, and sampling reuses the greedy capture."""
    from nbkit.chat import answer, decoders_of

    model = _model(tok, "qwen3", torch.bfloat16)
    greedy = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False, exact=True)
    one = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False, exact=True, top_k=1, temperature=1.0,
                 seed=0)
    assert one.path == "graphed" and one.token_ids == greedy.token_ids == _plain(model, tok, PROMPTS[0], 32)
    a = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False, exact=True, temperature=1.5, min_p=0.1,
               seed=3)
    b = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False, exact=True, temperature=1.5, min_p=0.1,
               seed=3)
    c = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False, exact=True, temperature=1.5, min_p=0.1,
               seed=4)
    assert a.path == "graphed" and a.token_ids == b.token_ids != c.token_ids
    assert a.token_ids != greedy.token_ids
    assert decoders_of(model).graphed.captures == 1
