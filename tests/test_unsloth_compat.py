"""``nbkit.unsloth`` and Unsloth's names in ``load_model``, on tiny models from configs (CPU, 16-bit bases).

- ``load_model`` reads Unsloth's arguments (``model_name``, ``r``, ``bias``, ``use_gradient_checkpointing="unsloth"``,
  ``random_state``, ``use_rslora``, ``dtype=None``); an unknown one is nbkit's ``TypeError`` naming the one meant;
  ``load_in_8bit=True`` says it is not supported.
- A saved adapter folder loads back onto its base: the same logits (bitwise: the same fp32 weights and ops).
- ``train_on_responses_only`` gives the labels a character-level masking of the rendered chats gives (through the
  trainer's own collator, with and without packing).
- The trainer words, the chat templates by name, ShareGPT standardising, and the saving methods' refusals.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset

from nbkit.demo.models import tiny_model
from nbkit.demo.tokenizer import load_demo_tokenizer
from nbkit.loading import load_model
from nbkit.unsloth import (
    FastLanguageModel,
    SFTConfig,
    SFTTrainer,
    get_chat_template,
    is_bfloat16_supported,
    standardize_sharegpt,
    train_on_responses_only,
)
from nbkit.unsloth.chat_templates import TEMPLATES
from nbkit.unsloth.training import IGNORE

CHATS = [
    [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}],
    [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Two plus two?"},
     {"from": "gpt", "value": "Four."}, {"from": "human", "value": "And three plus three?"},
     {"from": "gpt", "value": "Six, as it happens."}],
] * 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = load_demo_tokenizer()
    model = tiny_model("llama", len(tokenizer), seed=5, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _ids() -> torch.Tensor:
    return torch.randint(3, 1000, (1, 24), generator=torch.Generator().manual_seed(0))


# --- load_model in Unsloth's words -----------------------------------------------------------------------------------


def test_load_model_reads_unsloths_argument_names(saved):
    model, _ = load_model(model_name=str(saved), load_in_4bit=False, dtype=None, r=8, lora_alpha=32, bias="none",
                          lora_dropout=0, use_gradient_checkpointing="unsloth", random_state=3407, use_rslora=True,
                          loftq_config=None, max_seq_length=128)
    config = model.peft_config["default"]
    assert config.r == 8 and config.lora_alpha == 32 and config.use_rslora
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(32 / 8 ** 0.5)  # rsLoRA: alpha / sqrt(r)
    assert model.base_model.model.is_gradient_checkpointing
    again, _ = load_model(model_name=str(saved), load_in_4bit=False, r=8, random_state=3407)
    other, _ = load_model(model_name=str(saved), load_in_4bit=False, r=8, random_state=1)
    a = lambda m: m.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight  # noqa: E731
    assert torch.equal(a(model), a(again)) and not torch.equal(a(model), a(other))
    off, _ = load_model(str(saved), load_in_4bit=False, r=8, use_gradient_checkpointing=False)
    assert not off.base_model.model.is_gradient_checkpointing


@pytest.mark.parametrize("given, meant", [("lora_rank", "r"), ("lora_aplha", "lora_alpha"), ("torch_dtype", "dtype"),
                                          ("random_stat", "random_state")])
def test_an_unknown_argument_is_nbkits_error_naming_the_one_meant(saved, given, meant):
    with pytest.raises(TypeError, match=rf"load_model\(\) got an unexpected keyword argument '{given}'; did you "
                                        rf"mean {meant}="):
        load_model(str(saved), load_in_4bit=False, **{given: 8})


def test_unsupported_unsloth_arguments_say_so_by_name(saved):
    with pytest.raises(TypeError, match="load_in_8bit= is not supported"):
        load_model(str(saved), load_in_8bit=True)
    with pytest.raises(TypeError, match="load_in_8bit=True is not supported"):
        FastLanguageModel.from_pretrained(model_name=str(saved), load_in_4bit=False, load_in_8bit=True)
    with pytest.raises(TypeError, match="finetune_vision_layers=True is not supported"):
        model, _ = FastLanguageModel.from_pretrained(model_name=str(saved), load_in_4bit=False)
        FastLanguageModel.get_peft_model(model, finetune_vision_layers=True)


def test_a_saved_adapter_folder_loads_back_on_its_base(saved, tmp_path):
    model, tokenizer = load_model(str(saved), load_in_4bit=False, r=8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        expected = model(input_ids=_ids()).logits
    model.save_pretrained(tmp_path / "lora")
    tokenizer.save_pretrained(tmp_path / "lora")
    again, tokenizer2 = load_model(str(tmp_path / "lora"), load_in_4bit=False)
    with torch.no_grad():
        got = again(input_ids=_ids()).logits
    assert torch.equal(got, expected)
    assert any(p.requires_grad for n, p in again.named_parameters() if "lora_" in n)
    assert not any(p.requires_grad for n, p in again.named_parameters() if "lora_" not in n)
    assert tokenizer2.chat_template == tokenizer.chat_template
    base, _ = load_model(str(saved), load_in_4bit=False, r=8)  # the adapter is what moved the logits
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=_ids()).logits, expected)


# --- FastLanguageModel ---------------------------------------------------------------------------------------------


def test_fast_language_model_loads_then_adds_lora_and_only_its_models_get_saving_methods(saved):
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=str(saved), max_seq_length=64, dtype=None,
                                                         load_in_4bit=False)
    assert not any(p.requires_grad for p in model.parameters())
    assert tokenizer.model_max_length == 64 and hasattr(model, "save_pretrained_gguf")
    model = FastLanguageModel.get_peft_model(model, r=4, target_modules=["q_proj", "v_proj"], lora_alpha=4,
                                             lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth",
                                             random_state=3407, use_rslora=False, loftq_config=None)
    targets = {n.split(".")[-2] for n, _ in model.named_modules() if n.endswith(".lora_A")}
    assert targets == {"q_proj", "v_proj"}
    assert all(hasattr(model, m) for m in ("save_pretrained_merged", "save_pretrained_gguf", "push_to_hub_merged",
                                           "push_to_hub_gguf"))
    FastLanguageModel.for_inference(model)
    assert not model.training and model.config.use_cache
    FastLanguageModel.for_training(model)
    assert model.training and not model.config.use_cache
    plain, _ = load_model(str(saved), load_in_4bit=False, r=4)
    assert not hasattr(plain, "save_pretrained_merged")
    mlp_only, _ = FastLanguageModel.from_pretrained(model_name=str(saved), load_in_4bit=False)
    mlp_only = FastLanguageModel.get_peft_model(mlp_only, r=4, finetune_attention_modules=False)
    assert {n.split(".")[-2] for n, _ in mlp_only.named_modules() if n.endswith(".lora_A")} == {
        "gate_proj", "up_proj", "down_proj"}
    assert is_bfloat16_supported() is (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0))


def test_saving_methods_refuse_unknown_methods_and_types_before_any_work(saved, tmp_path, monkeypatch):
    from nbkit.export.push import HubOfflineError

    model, tokenizer = FastLanguageModel.from_pretrained(model_name=str(saved), load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=4)
    with pytest.raises(ValueError, match="save_method='merged_8bit': choose one of merged_16bit"):
        model.save_pretrained_merged(tmp_path / "m", tokenizer, save_method="merged_8bit")
    with pytest.raises(ValueError, match=r"\['iq2_xs'\]"):
        model.save_pretrained_gguf(tmp_path / "g", tokenizer, quantization_method=["q4_k_m", "iq2_xs"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubOfflineError, match="Nothing was merged or written") as offline:
        model.push_to_hub_gguf("someone/model", tokenizer, quantization_method=["q4_k_m", "Q8_0"])
    assert "`hf upload`" in str(offline.value)  # huggingface_hub's current CLI (`huggingface-cli` is gone)
    with pytest.raises(HubOfflineError, match="HF_HUB_OFFLINE is set"):
        model.push_to_hub_merged("someone/model", tokenizer, save_method="merged_16bit")
    assert not (tmp_path / "m").exists() and not (tmp_path / "g").exists()
    model.save_pretrained_merged(tmp_path / "lora", tokenizer, save_method="lora")
    assert (tmp_path / "lora" / "adapter_config.json").is_file()


# --- chat templates and data -----------------------------------------------------------------------------------------


def test_chat_templates_render_each_family():
    tokenizer = load_demo_tokenizer()
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant",
                                                                                    "content": "A"}]
    expected = {
        "chatml": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>"
                  "\n<|im_start|>assistant\n",
        "llama-3": "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>"
                   "\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "gemma-3": "<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
                   "<start_of_turn>model\n",
        "phi-3": "<|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\nA<|end|>\n<|assistant|>\n",
        "mistral": "[INST] S\n\nU [/INST]A<|im_end|>",
    }
    for name, text in expected.items():
        assert get_chat_template(tokenizer, chat_template=name).apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True) == text, name
    get_chat_template(tokenizer, chat_template="llama-3.1")
    dated = tokenizer.apply_chat_template(chat[1:], tokenize=False)
    assert dated.startswith("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023")
    get_chat_template(tokenizer, chat_template="gemma-3")
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<start_of_turn>user\nhi<end_of_turn>\n"
    get_chat_template(tokenizer, chat_template="qwen3")
    assert tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    get_chat_template(tokenizer, "chatml", mapping={"role": "from", "content": "value", "user": "human",
                                                    "assistant": "gpt"})
    assert tokenizer.apply_chat_template(CHATS[0], tokenize=False) == (
        "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nBlue.<|im_end|>\n")
    for name in TEMPLATES:  # every name renders a chat
        assert "U" in get_chat_template(tokenizer, name).apply_chat_template(chat, tokenize=False)
    with pytest.raises(ValueError, match="chat_template='llama-9': nbkit knows"):
        get_chat_template(tokenizer, "llama-9")


def test_standardize_sharegpt_keeps_the_column_with_trls_role_names():
    data = standardize_sharegpt(Dataset.from_list([{"conversations": c, "id": i} for i, c in enumerate(CHATS)]))
    assert sorted(data.column_names) == ["conversations", "id"]
    assert [m["role"] for m in data[1]["conversations"]] == ["system", "user", "assistant", "user", "assistant"]
    assert data[1]["conversations"][2] == {"role": "assistant", "content": "Four."}


# --- the trainer words and train_on_responses_only ------------------------------------------------------------------


def _manual_labels(tokenizer, text: str, user: str, assistant: str) -> list[int]:
    """Labels by characters, from the tokenizer's offsets: a token is kept when it starts after an ``assistant``
    marker and before the next ``user`` marker."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, start = [], 0
    while (found := text.find(assistant, start)) >= 0:
        begin = found + len(assistant)
        end = text.find(user, begin)
        spans.append((begin, len(text) if end < 0 else end))
        start = begin
    return [i if any(b <= s < e for b, e in spans) else IGNORE for i, (s, _) in zip(enc["input_ids"],
                                                                                      enc["offset_mapping"])]


MARKERS = {"chatml": ("<|im_start|>user\n", "<|im_start|>assistant\n"),
           "llama-3.1": ("<|start_header_id|>user<|end_header_id|>\n\n",
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")}


@pytest.mark.parametrize("template, packing", [("chatml", False), ("chatml", True), ("llama-3.1", False)])
def test_train_on_responses_only_masks_as_a_character_level_masking_does(saved, tmp_path, template, packing):
    """chatml: markers that are tokens (matched by ids); llama-3.1 on this vocabulary: markers as text (by chars)."""
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=str(saved), load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=4)
    tokenizer = get_chat_template(tokenizer, chat_template=template)
    data = standardize_sharegpt(Dataset.from_list([{"conversations": c} for c in CHATS]))
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in data["conversations"]]
    data = data.map(lambda rows: {"text": [tokenizer.apply_chat_template(c, tokenize=False)
                                           for c in rows["conversations"]]}, batched=True)
    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=data, dataset_text_field="text",
                         max_seq_length=512, packing=packing, dataset_num_proc=1,
                         args=SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                        report_to="none", live_dashboard=False))
    assert trainer.processing_class is tokenizer and trainer.args.max_length == 512
    assert trainer.args.packing is packing and trainer.args.dataset_text_field == "text"
    trainer = train_on_responses_only(trainer)  # parts from the template
    got = [list(r["labels"]) for r in trainer.train_dataset]
    eos = tokenizer.eos_token  # TRL appends eos to plain text; ChatML's already ends in it
    manual = [_manual_labels(tokenizer, t if t.endswith(eos) else t + eos, *MARKERS[template]) for t in texts]
    if packing:  # TRL packs best-fit: sequences in another order; each is masked on its own
        lengths = [n for r in trainer.train_dataset for n in r["seq_lengths"]]
        flat = sum(got, [])
        got = sorted(flat[sum(lengths[:i]):sum(lengths[:i + 1])] for i in range(len(lengths)))
        manual = sorted(manual)
        assert len(lengths) == len(CHATS)
    assert got == manual
    kept = tokenizer.decode([i for row in got for i in row if i != IGNORE])
    assert "Blue." in kept and "Six, as it happens." in kept and "Name a colour" not in kept and "Be brief" not in kept
    batch = next(iter(trainer.get_train_dataloader()))  # the collator passes the labels on
    first = list(trainer.train_dataset[0]["labels"])
    assert batch["labels"][0].tolist()[:len(first)] == first
    assert trainer.train().global_step == 1


def test_train_on_responses_only_says_when_the_parts_are_not_in_the_data(saved, tmp_path):
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=str(saved), load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=4)
    data = Dataset.from_list([{"text": "plain text without turns"}] * 4)
    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=data,
                         args=SFTConfig(output_dir=str(tmp_path), max_seq_length=32, report_to="none",
                                        live_dashboard=False))
    assert trainer.args.max_length == 32
    with pytest.raises(ValueError, match="no row of the train_dataset holds the response part"):
        train_on_responses_only(trainer, instruction_part="<|im_start|>user\n",
                                response_part="<|im_start|>assistant\n")


def test_merged_16bit_and_4bit_folders_are_written_from_the_adapter_model(saved, tmp_path):
    import json

    model, tokenizer = FastLanguageModel.from_pretrained(model_name=str(saved), load_in_4bit=False)
    model = FastLanguageModel.get_peft_model(model, r=4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    report = model.save_pretrained_merged(tmp_path / "m16", tokenizer, save_method="merged_16bit")
    assert report.check is not None and report.check.ok
    report4 = model.save_pretrained_merged(tmp_path / "m4", tokenizer, save_method="merged_4bit")
    config = json.loads((tmp_path / "m4" / "config.json").read_text())
    assert config["quantization_config"]["bnb_4bit_quant_type"] == "nf4" and report4.out_dir == tmp_path / "m4"
    assert (tmp_path / "m4" / "tokenizer_config.json").is_file()
    assert not (tmp_path / "m16" / "adapter_config.json").exists()
