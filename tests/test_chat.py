"""``nbkit.chat`` on a CPU: the streamed answer is ``generate``'s greedy answer, it stops at the template's
end-of-turn token, adapters count, and every module's train/eval mode comes back. (The CUDA-graphed fast path is
held to ``generate`` token for token in tests/gpu/test_chat_gpu.py; here ``fast=True`` falls back, saying why.)
"""

from __future__ import annotations

import logging

import pytest
import torch

from nbkit.chat import answer, chat, greedy_config, prompt_ids

pytest_plugins = ["conftest_real_model"]
QUESTION = "Reverse the words: red fox moon"


@pytest.fixture(scope="module")
def tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _tiny(tok, family="qwen3", seed=0):
    from nbkit.demo.models import tiny_model

    model = tiny_model(family, len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def _generate(model, tok, message, n):
    ids = prompt_ids(tok, [{"role": "user", "content": message}], torch.device("cpu"))
    out = model.generate(input_ids=ids, generation_config=greedy_config(model, tok, n))
    return [int(t) for t in out[0, ids.shape[1]:]]


def _lora(model, seed=0):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def test_the_streamed_answer_is_generates_greedy_answer(tok, one_thread, caplog):
    model = _tiny(tok)
    pieces: list[str] = []
    with caplog.at_level(logging.WARNING):
        got = answer(model, tok, QUESTION, max_new_tokens=24, stream=pieces.append)
        again = answer(model, tok, QUESTION, max_new_tokens=24, stream=False)
    assert got.token_ids == _generate(model, tok, QUESTION, 24) == again.token_ids
    assert "".join(pieces) == got.text == tok.decode(got.token_ids, skip_special_tokens=True)
    assert got.path == "generate" and got.reason == "no CUDA device"
    assert caplog.text.count("no CUDA device") == 1  # said once per model


def test_stream_true_prints_the_answer_as_it_comes(tok, one_thread, capsys):
    text = chat(_tiny(tok), tok, QUESTION, max_new_tokens=12)
    assert capsys.readouterr().out == text + "\n"


def test_adapters_change_the_answer_and_are_honoured(tok, one_thread):
    model = _lora(_tiny(tok))
    with_adapters = answer(model, tok, QUESTION, max_new_tokens=16, stream=False).token_ids
    assert with_adapters == _generate(model, tok, QUESTION, 16)
    with model.disable_adapter():
        without = answer(model, tok, QUESTION, max_new_tokens=16, stream=False).token_ids
    assert without != with_adapters


def test_every_module_gets_its_mode_back(tok, one_thread):
    model = _lora(_tiny(tok))
    model.train()
    model.base_model.model.model.layers[1].eval()  # a mixed state, as a user or a trainer may leave it
    before = [m.training for m in model.modules()]
    chat(model, tok, QUESTION, max_new_tokens=4, stream=False)
    assert [m.training for m in model.modules()] == before


def test_messages_and_a_system_prompt_go_through_the_template(tok, one_thread):
    ids = prompt_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                     torch.device("cpu"))
    text = tok.decode(ids[0])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    model = _tiny(tok)
    a = answer(model, tok, "hi", system="Be brief.", max_new_tokens=8, stream=False)
    b = answer(model, tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
               max_new_tokens=8, stream=False)
    assert a.token_ids == b.token_ids
    with pytest.raises(ValueError, match="role"):
        chat(model, tok, [{"content": "no role"}])


def test_right_after_fastsft_train_on_a_4bit_base(tok, tmp_path, one_thread):
    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.loading import load_model

    base = _tiny(tok)
    base.save_pretrained(str(tmp_path / "base"))
    tok.save_pretrained(str(tmp_path / "base"))
    model, tokenizer = load_model(str(tmp_path / "base"), load_in_4bit=True, lora_r=8)
    args = FastSFTConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
                         packing=True, max_length=128, assistant_only_loss=True, learning_rate=1e-2,
                         report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                         live_dashboard=False)
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=32, split="train", seed=0),
                      processing_class=tokenizer)
    trainer.train()
    model = trainer.model
    was = model.training
    got = answer(model, tokenizer, QUESTION, max_new_tokens=12, stream=False)
    assert model.training == was
    model.eval()
    assert got.token_ids == _generate(model, tokenizer, QUESTION, 12)


def test_the_real_model_answers_and_stops_at_end_of_turn(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the stop comes from the chat template's <|im_end|>
    got = answer(model, tokenizer, "What is the capital of France?", max_new_tokens=48, stream=False)
    assert got.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") and len(got.token_ids) < 48
    assert "Paris" in got.text
    assert got.token_ids == _generate(model, tokenizer, "What is the capital of France?", 48)


def test_unsloth_style_sampling_is_generates_own_draws_for_the_seed(tok, one_thread):
    """``chat(..., temperature=1.5, min_p=0.1, seed=...)``, as Unsloth's notebooks sample: on a CPU it is
    ``generate``'s sampling under ``torch.manual_seed(seed)`` (top-k off), streamed, and it repeats for the seed."""
    model = _lora(_tiny(tok))
    pieces: list[str] = []
    got = answer(model, tok, QUESTION, max_new_tokens=24, stream=pieces.append, temperature=1.5, min_p=0.1, seed=7)
    assert got.path == "generate" and "".join(pieces) == got.text
    ids = prompt_ids(tok, [{"role": "user", "content": QUESTION}], torch.device("cpu"))
    config = greedy_config(model, tok, 24)
    torch.manual_seed(7)
    want = model.generate(input_ids=ids, generation_config=config, do_sample=True, temperature=1.5, min_p=0.1,
                          top_k=0)[0, ids.shape[1]:].tolist()
    assert got.token_ids == want != _generate(model, tok, QUESTION, 24)
    assert answer(model, tok, QUESTION, max_new_tokens=24, stream=False, temperature=1.5, min_p=0.1,
                  seed=7).token_ids == want
    assert answer(model, tok, QUESTION, max_new_tokens=24, stream=False, temperature=1.5, min_p=0.1, seed=7,
                  do_sample=False).token_ids == _generate(model, tok, QUESTION, 24)
