"""Merging a trained adapter: into the original 16-bit base when it is at hand, into the dequantized 4-bit weights
when it is not (and saying so); the saved folder reproduces the adapter model's logits, or the merge fails loudly.

Tolerances (relative logit difference, max |diff| / max |logit|): ``nbkit.export.merge.TOLERANCE`` -- 1e-4 for a
float32 save, 5e-2 for bfloat16 (every merged weight rounded to 8 bits of mantissa).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from nbkit.export.compare import ExportCheckError
from nbkit.export.merge import TOLERANCE, merge_folder, save_merged

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
    assert report.check.ok and report.check.rel <= TOLERANCE[torch.float32]
    # the trained model computes with NF4 weights: further from the merged model than the merge's own error
    assert report.vs_trained.rel > 10 * report.check.rel
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


def test_a_demo_style_adapter_folder_with_full_embeddings_merges(tmp_path, tok, one_thread):
    model, tokenizer = _qlora(_tiny_base(tmp_path / "base", tok), modules_to_save=["embed_tokens", "lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    model.save_pretrained(str(tmp_path / "adapter"))
    tokenizer.save_pretrained(str(tmp_path / "adapter"))
    report = merge_folder(tmp_path / "adapter", tmp_path / "merged")
    assert report.check.ok and report.check.rel <= TOLERANCE[torch.float32]


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


def test_the_real_model_merges_in_bfloat16_within_its_tolerance(tmp_path, smollm2_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbkit.export.compare import compare, logits_of, prompt_batches

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    rows = prompt_batches(tokenizer)
    before = logits_of(base, rows)
    model = _random_b(get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")), 0.02)
    report = save_merged(model, tokenizer, tmp_path / "merged")
    assert report.dtype == "bfloat16" and report.check.ok and report.check.rel <= TOLERANCE[torch.bfloat16]
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    changed = compare("base vs merged", before, logits_of(merged, rows), None).rel
    # the merge did something: a merge that dropped the adapter would change the logits by no more than bf16 rounding
    # while its check (merged vs adapter model) would show the whole adapter effect
    assert changed > 3 * report.check.rel, (changed, report.check.rel)
