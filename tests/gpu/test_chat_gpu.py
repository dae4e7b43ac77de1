"""``nbkit.chat``'s fast paths on a CUDA GPU.

The graphed path (``fast="graphed"``): exactness, not a tolerance. It replays the same kernels on the same shapes, so
the token ids must equal ``model.generate(do_sample=False)``'s one for one.

The dense path (the default where the dense copy fits): its logits differ from the slow path's by rounding, so its
tokens must equal ``generate``'s up to the first near-tie: where they first differ, the slow path's two best logits
(teacher-forced on the common prefix) must lie closer together than the two paths' logits differ there.
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


def _4bit_lora(tok):
    import tempfile

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = _model(tok, "qwen3", torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(folder)
        q = AutoModelForCausalLM.from_pretrained(folder, device_map={"": 0}, dtype=torch.bfloat16,
                                                 quantization_config=BitsAndBytesConfig(
                                                     load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                     bnb_4bit_use_double_quant=True,
                                                     bnb_4bit_compute_dtype=torch.bfloat16))
    q.generation_config.eos_token_id = None
    return _lora(q)


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
        got = answer(model, tok, prompt, max_new_tokens=64, stream=False, fast="graphed")
        assert got.path == "graphed", got.reason
        assert got.token_ids == _plain(model, tok, prompt, 64)


def test_graphed_tokens_equal_generate_on_a_4bit_base_with_lora(tok):
    from nbkit.chat import answer

    model = _4bit_lora(tok)
    model.train()
    got = answer(model, tok, PROMPTS[1], max_new_tokens=48, stream=False, fast="graphed")
    assert got.path == "graphed", got.reason
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    assert got.token_ids == _plain(model, tok, PROMPTS[1], 48)
    with model.disable_adapter():  # the adapters' switch changes the step: recaptured, still exact
        off = answer(model, tok, PROMPTS[1], max_new_tokens=48, stream=False, fast="graphed")
        assert off.token_ids == _plain(model, tok, PROMPTS[1], 48)
    assert off.token_ids != got.token_ids


def test_a_second_chat_reuses_the_capture_and_a_weight_update_is_seen(tok):
    from nbkit.chat import answer

    model = _lora(_model(tok, "qwen3", torch.bfloat16))
    first = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False, fast="graphed")
    decoder = model.__dict__["_nbkit_graphed_decoder"]
    answer(model, tok, PROMPTS[1], max_new_tokens=32, stream=False, fast="graphed")
    assert decoder.captures == 1
    with torch.no_grad():  # an optimizer step updates parameters in place: the graphs read them where they are
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    again = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False, fast="graphed")
    assert decoder.captures == 1
    assert again.token_ids == _plain(model, tok, PROMPTS[0], 32) != first.token_ids


def test_streamed_text_is_the_answer_and_it_stops_at_end_of_turn(tok):
    from nbkit.chat import answer

    model = _model(tok, "qwen3", torch.bfloat16)
    plain = _plain(model, tok, PROMPTS[0], 40)
    stop = plain[5]  # a token the model is known to produce: make it the end-of-turn id
    model.generation_config.eos_token_id = stop
    pieces = []
    got = answer(model, tok, PROMPTS[0], max_new_tokens=40, stream=pieces.append, fast="graphed")
    assert got.path == "graphed"
    assert got.token_ids == plain[: plain.index(stop) + 1]
    assert "".join(pieces) == got.text


# ---------------------------------------------------------------------------------------------------------------
# the dense path


def _step_logits(model, tok, prompt, tokens):
    """The model's float32 logits for the token after ``prompt`` + ``tokens`` (teacher-forced, one forward)."""
    from nbkit.chat import prompt_ids

    ids = prompt_ids(tok, [{"role": "user", "content": prompt}], torch.device("cuda"))
    ids = torch.cat([ids, torch.tensor([tokens], dtype=torch.long, device="cuda")], dim=1)
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1].float()


def assert_same_up_to_a_near_tie(model, twin, tok, prompt, got, plain):
    """``got`` equals ``plain`` up to the first token where the slow path's choice is a near-tie: its two best
    logits there lie closer than the two models' logits differ. Returns the common length."""
    same = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), None)
    if same is None:
        assert len(got) == len(plain)
        return len(got)
    slow = _step_logits(model, tok, prompt, plain[:same])
    fast = _step_logits(twin, tok, prompt, plain[:same])
    top = slow.topk(2).values
    gap, error = float(top[0] - top[1]), float((slow - fast).abs().max())
    # the step rounds otherwise than a teacher-forced forward (graph, fused kernels): at least 1% of the logit scale
    bound = max(2 * error, 0.01 * float(slow.abs().max()))
    assert gap <= bound, f"token {same}: the slow path's margin {gap:.3g} is no near-tie (bound {bound:.3g})"
    return same


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_dense_tokens_equal_generate_up_to_a_near_tie(tok, family):
    from nbkit.chat import answer

    model = _lora(_model(tok, family, torch.bfloat16)).eval()
    for prompt in PROMPTS:
        got = answer(model, tok, prompt, max_new_tokens=64, stream=False)
        assert got.path == "dense", got.reason
        twin = model.__dict__["_nbkit_fast_decoder"].twin
        assert_same_up_to_a_near_tie(model, twin, tok, prompt, got.token_ids, _plain(model, tok, prompt, 64))


def test_dense_path_on_a_4bit_base_with_lora_a_weight_update_and_release(tok):
    from nbkit.chat import answer, release_decoders

    model = _4bit_lora(tok).eval()
    first = answer(model, tok, PROMPTS[1], max_new_tokens=48, stream=False)
    assert first.path == "dense", first.reason
    decoder = model.__dict__["_nbkit_fast_decoder"]
    assert_same_up_to_a_near_tie(model, decoder.twin, tok, PROMPTS[1], first.token_ids, _plain(model, tok, PROMPTS[1], 48))
    answer(model, tok, PROMPTS[0], max_new_tokens=48, stream=False)
    assert decoder.captures == 1  # same weights, room enough: the copy and the graph are reused
    with torch.no_grad():  # an optimizer step: in place
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    again = answer(model, tok, PROMPTS[1], max_new_tokens=48, stream=False)
    assert decoder.captures == 2 and again.path == "dense"
    assert_same_up_to_a_near_tie(model, decoder.twin, tok, PROMPTS[1], again.token_ids,
                                 _plain(model, tok, PROMPTS[1], 48))
    assert again.token_ids != first.token_ids
    held = torch.cuda.memory_allocated()
    release_decoders(model)
    assert "_nbkit_fast_decoder" not in model.__dict__
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < held


def test_dense_path_stops_at_end_of_turn_and_streams_the_answer(tok):
    from nbkit.chat import answer

    model = _lora(_model(tok, "qwen3", torch.bfloat16)).eval()
    plain = answer(model, tok, PROMPTS[0], max_new_tokens=40, stream=False).token_ids
    stop = plain[20]  # past the first chunk of replays: the stop is found inside a later chunk
    model.get_base_model().generation_config.eos_token_id = stop
    pieces = []
    got = answer(model, tok, PROMPTS[0], max_new_tokens=40, stream=pieces.append)
    assert got.path == "dense"
    assert got.token_ids == plain[: plain.index(stop) + 1]
    assert "".join(pieces) == got.text


def test_no_room_for_the_dense_copy_takes_the_graphed_path(tok, monkeypatch):
    from nbkit import dense_twin
    from nbkit.chat import answer

    model = _lora(_model(tok, "qwen3", torch.bfloat16)).eval()
    monkeypatch.setattr(dense_twin, "FILL", 0.0)
    got = answer(model, tok, PROMPTS[0], max_new_tokens=32, stream=False)
    assert got.path == "graphed" and "a dense copy for decoding needs" in got.reason
    assert got.token_ids == _plain(model, tok, PROMPTS[0], 32)
