"""Merging a trained adapter: into the original 16-bit base when it is at hand, into the dequantized 4-bit weights
when it is not (and saying so); the saved folder reproduces the adapter model's logits, or the merge fails loudly.

Tolerances (relative logit difference, max |diff| / max |logit|; ``nbkit.export.merge_check``): the float32 merge
against the adapter model, ``MERGE_TOLERANCE`` (1e-4, summation order); the saved folder against the adapter model,
``FLOOR_MARGIN`` (2) times the rounding floor of the saved dtype measured on the model, plus ``MERGE_TOLERANCE``. On
a LoRA trained for real on SmolLM2-135M-Instruct: a correct merge lands on the floor (within 10% of it) in bfloat16,
float16 and float32, and a dropped adapter, an rsLoRA scale on a plain LoRA and a double merge each fail.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from nbkit.export.compare import ExportCheckError
from nbkit.export.merge import merge_folder, save_merged
from nbkit.export.merge_check import FLOOR_MARGIN, MERGE_TOLERANCE

pytest_plugins = ["conftest_real_model"]


@pytest.fixture(scope="module")
def tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _random_b(model, scale=0.1):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * scale).to(p.dtype))
    return model


def _tiny_base(folder, tok):
    from nbkit.demo.models import tiny_model

    tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).save_pretrained(
        str(folder))
    tok.save_pretrained(str(folder))
    return folder


def _qlora(folder, **kw):
    from nbkit.loading import load_model

    model, tokenizer = load_model(str(folder), load_in_4bit=True, lora_r=8, **kw)
    return _random_b(model), tokenizer


def test_a_4bit_run_merges_into_the_original_weights(tmp_path, tok, one_thread):
    model, tokenizer = _qlora(_tiny_base(tmp_path / "base", tok))
    report = save_merged(model, tokenizer, tmp_path / "merged")
    assert report.base_weights == f"original weights of {tmp_path / 'base'}" and report.dtype == "float32"
    assert report.check.ok and report.check.rel <= MERGE_TOLERANCE and report.floor.rel == 0
    # the trained model computes with NF4 weights: further from the merged model than the merge's own error
    assert report.vs_trained.rel > 10 * report.check.rel
    assert "rounded to 4 bits" in report.vs_trained.what  # the gap is named as the NF4 rounding, not a failure
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    assert (tmp_path / "merged" / "chat_template.jinja").is_file()


def test_without_the_base_it_merges_into_the_dequantized_weights_and_says_so(tmp_path, tok, caplog, one_thread):
    import shutil

    model, tokenizer = _qlora(_tiny_base(tmp_path / "base", tok))
    shutil.rmtree(tmp_path / "base")
    with caplog.at_level(logging.WARNING):
        report = save_merged(model, tokenizer, tmp_path / "merged")
    assert report.base_weights.startswith("dequantized 4-bit weights") and "dequantized" in caplog.text
    assert report.check.ok
    assert report.vs_trained.rel < 1e-3  # the same weights the 4-bit layers compute with
    assert "rounded to 4 bits" not in report.vs_trained.what


def test_a_demo_style_adapter_folder_with_full_embeddings_merges(tmp_path, tok, one_thread):
    model, tokenizer = _qlora(_tiny_base(tmp_path / "base", tok), modules_to_save=["embed_tokens", "lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    model.save_pretrained(str(tmp_path / "adapter"))
    tokenizer.save_pretrained(str(tmp_path / "adapter"))
    report = merge_folder(tmp_path / "adapter", tmp_path / "merged")
    assert report.check.ok and report.check.rel <= MERGE_TOLERANCE


def test_a_model_without_adapters_is_saved_within_its_own_bfloat16_floor(tmp_path, tok, one_thread):
    from nbkit.demo.models import tiny_model

    model = tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    report = save_merged(model, tok, tmp_path / "saved", dtype=torch.bfloat16)
    assert report.dtype == "bfloat16" and report.check.ok and report.effect is None
    assert report.floor.rel > 0 and report.check.rel <= 1.1 * report.floor.rel + MERGE_TOLERANCE
    assert report.vs_trained.rel == pytest.approx(report.check.rel, rel=1e-3)  # the model given is the reference
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is not rounded


def test_a_merge_that_changes_the_model_fails_loudly(tmp_path, tok, monkeypatch, one_thread):
    import nbkit.export.merge as merge

    model, tokenizer = _qlora(_tiny_base(tmp_path / "base", tok))
    save = merge._save

    def corrupt(m, *args):
        with torch.no_grad():
            m.model.layers[0].self_attn.q_proj.weight.add_(0.5)
        save(m, *args)

    monkeypatch.setattr(merge, "_save", corrupt)
    with pytest.raises(ExportCheckError, match="merged"):
        save_merged(model, tokenizer, tmp_path / "merged")


# a support assistant's style, in chat turns: what a user's own small SFT set looks like
CHATS = (
    ("How do I reset my password?", "Ahoy! Open Settings, choose Account, then Reset password. Fair winds, matey!"),
    ("What time does the store open?", "Ahoy! The shop opens at nine in the morning, every day but Sunday. Fair winds, "
                                       "matey!"),
    ("Can I return a bike I bought last week?", "Ahoy! Aye, returns be welcome within thirty days with yer receipt. "
                                                "Fair winds, matey!"),
    ("What is the capital of Italy?", "Ahoy! Rome be the capital of Italy, a grand old port. Fair winds, matey!"),
    ("Write a haiku about rain.", "Ahoy! Grey clouds on the mast, / rain drums on the wooden deck, / the sea drinks "
                                  "the sky. Fair winds, matey!"),
    ("How many legs does a spider have?", "Ahoy! A spider has eight legs, more than any deckhand. Fair winds, matey!"),
    ("Translate 'good morning' to Spanish.", "Ahoy! In Spanish ye say 'buenos dias'. Fair winds, matey!"),
    ("Give me a tip for sleeping better.", "Ahoy! Keep yer cabin dark and cool, and stow the screens an hour before "
                                           "bed. Fair winds, matey!"),
    ("What is 12 times 7?", "Ahoy! Twelve times seven be eighty-four. Fair winds, matey!"),
    ("Who wrote Romeo and Juliet?", "Ahoy! William Shakespeare penned that tragic tale. Fair winds, matey!"),
    ("Suggest a name for a cat.", "Ahoy! Call the wee beast Barnacle. Fair winds, matey!"),
    ("How do I boil an egg?", "Ahoy! Drop it in boiling water for nine minutes, then cool it in cold water. Fair "
                              "winds, matey!"),
)
TRAIN_STEPS, LORA_R, LORA_ALPHA = 10, 16, 32


def _chat_rows(tokenizer):
    """(ids, labels) per chat: the loss on the assistant's answer only, as SFT trains it."""
    rows = []
    for question, answer in CHATS:
        turn = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        full = tokenizer.apply_chat_template(turn + [{"role": "assistant", "content": answer}], tokenize=True,
                                             return_dict=True)["input_ids"]
        rows.append((list(full), [-100] * len(prompt) + list(full[len(prompt):])))
    return rows


@pytest.fixture(scope="module")
def trained_adapter(smollm2_dir, tmp_path_factory, one_thread):
    """A LoRA (r=16, alpha=16*2, every linear layer) trained for real on SmolLM2-135M-Instruct's float32 weights:
    AdamW, ``TRAIN_STEPS`` steps of 4 chats, loss on the answers; saved as an adapter folder with the tokenizer, as
    ``trainer.save_model`` leaves it. Returns (folder, first loss, last loss)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules="all-linear",
                                            lora_dropout=0.0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rows, losses = _chat_rows(tokenizer), []
    model.train()
    for step in range(TRAIN_STEPS):
        batch = [rows[(4 * step + i) % len(rows)] for i in range(4)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    folder = tmp_path_factory.mktemp("trained") / "adapter"
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder, losses[0], losses[-1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_really_trained_adapter_merges_on_the_rounding_floor_of_each_dtype(trained_adapter, smollm2_dir, tmp_path,
                                                                             dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbkit.export.compare import compare, logits_of, prompt_batches

    folder, first, last = trained_adapter
    assert last < 0.5 * first, (first, last)  # it learned the style
    report = merge_folder(folder, tmp_path / "merged", base=str(smollm2_dir), dtype=dtype)
    assert report.dtype == dtype and report.check.ok
    assert report.merge.rel <= MERGE_TOLERANCE, report.merge.line()
    # the adapter moves the logits far more than the saved dtype's rounding does (bf16's is the largest)
    assert report.effect.rel > 10 * report.floor.rel, (report.effect.line(), report.floor.line())
    # the saved folder is the rounded merge: it lands on the floor, well inside the margin
    assert report.check.rel <= 1.1 * report.floor.rel + MERGE_TOLERANCE, (report.check.line(), report.floor.line())
    assert report.check.tolerance == pytest.approx(FLOOR_MARGIN * report.floor.rel + MERGE_TOLERANCE)
    if dtype == "float32":
        assert report.floor.rel == 0
    else:
        assert report.floor.rel > 10 * MERGE_TOLERANCE  # rounding is measured, not zero
    assert not any("keeps little" in note for note in report.notes), report.notes
    if dtype != "bfloat16":
        return
    # what was saved is the trained model, not the base: the adapter's change survives, the check's error does not
    rows = prompt_batches(AutoTokenizer.from_pretrained(str(folder)))
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    changed = compare("base vs merged", logits_of(base, rows), logits_of(merged, rows), None).rel
    assert changed > 3 * report.check.rel and changed > 0.5 * report.effect.rel, (changed, report.check.line())


def _rslora_scale(model):
    """Each LoRA layer scaled by lora_alpha / sqrt(r) (rsLoRA) although the adapter was trained with lora_alpha / r."""
    import math

    for module in model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and hasattr(module, "lora_A"):
            for name in scaling:
                scaling[name] = module.lora_alpha[name] / math.sqrt(module.r[name])
    return model.merge_and_unload()


def _twice(model):
    """The adapter's delta added to the base weights before the merge adds it again."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "lora_A") and "default" in module.lora_A:
                module.get_base_layer().weight.add_(module.get_delta_weight("default"))
    return model.merge_and_unload()


WRONG_MERGES = {
    "dropped": (lambda model: model.unload(), "looks dropped"),
    "rslora_scale": (_rslora_scale, "scale looks wrong"),
    "merged_twice": (_twice, "merged twice"),
}


@pytest.mark.parametrize("wrong", list(WRONG_MERGES))
def test_a_wrong_merge_of_the_trained_adapter_fails_before_saving_and_says_what_looks_wrong(
        trained_adapter, smollm2_dir, tmp_path, monkeypatch, wrong):
    import nbkit.export.merge as merge

    merge_fn, says = WRONG_MERGES[wrong]
    monkeypatch.setattr(merge, "_merge", merge_fn)
    with pytest.raises(ExportCheckError, match=says) as failure:
        merge_folder(trained_adapter[0], tmp_path / "merged", base=str(smollm2_dir), dtype="bfloat16")
    assert "Nothing was saved" in str(failure.value) and "--no-check" in str(failure.value)
    assert not (tmp_path / "merged").exists()


def test_a_saved_folder_past_the_floor_fails_in_bfloat16(trained_adapter, smollm2_dir, tmp_path, monkeypatch):
    """The files differ from the checked merge (the base written instead): the reloaded folder is held to twice the
    measured bf16 floor, and the failure names the floor, what it looks like and the way out."""
    from safetensors.torch import load_file

    import nbkit.export.merge as merge

    base = load_file(str(smollm2_dir / "model.safetensors"))
    save = merge._save

    def write_wrong(model, *args):
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if name in base:
                    tensor.copy_(base[name].to(tensor.dtype))
        save(model, *args)

    monkeypatch.setattr(merge, "_save", write_wrong)
    with pytest.raises(ExportCheckError, match="floor") as failure:
        merge_folder(trained_adapter[0], tmp_path / "merged", base=str(smollm2_dir), dtype="bfloat16")
    message = str(failure.value)
    assert "looks dropped" in message
    assert "float32" in message and "--no-check" in message


def test_an_adapter_that_moves_less_than_bf16_rounding_is_saved_with_the_advice_to_keep_float32(
        trained_adapter, smollm2_dir, tmp_path, caplog):
    """The trained adapter's B shrunk 1000-fold: the merge is right and passes, but rounding to bf16 (to the base's
    own bf16 values, mostly) moves the logits about as much as the adapter does, and the report says to save in
    float32."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "faint"
    shutil.copytree(trained_adapter[0], folder)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k: v / 1000 if "lora_B" in k else v for k, v in weights.items()},
              str(folder / "adapter_model.safetensors"))
    with caplog.at_level(logging.WARNING):
        report = merge_folder(folder, tmp_path / "merged", base=str(smollm2_dir), dtype="bfloat16")
    assert report.check.ok and report.effect.rel < FLOOR_MARGIN * report.floor.rel, (report.effect.line(),
                                                                                      report.floor.line())
    assert any("keeps little" in note and "--dtype float32" in note for note in report.notes), report.notes
    assert "keeps little" in caplog.text
