"""GGUF export: every writable type and every covered family read back by transformers' GGUF reader with the
source's logits and token ids; the real SmolLM2-135M-Instruct in f16 and q8_0; what llama.cpp needs in the file.

Bounds (relative logit difference, max |diff| / max |logit|, over every position of the check prompts): the file
read back against the source rounded as stored, 1e-4 for every type (``FILE_TOLERANCE``); against the unquantized
source, ``nbkit.export.gguf.BOUND`` per type; the real model in q8_0 within 0.1 with >= 90% top-1 agreement.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbkit.export.compare import ExportCheckError
from nbkit.export.gguf import BOUND, FILE_TOLERANCE, K_FILE_TYPES, QUANT_TYPES, export_gguf

pytest_plugins = ["conftest_real_model"]

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def demo_tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def spm_tokenizer():
    """A small SentencePiece-style BPE tokenizer (byte fallback, "▁" for spaces), Gemma's kind."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    chars = ["\u2581"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,?!:")
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("\u2581", "a"), ("r", "e"), ("\u2581", "w"),
              ("o", "r"), ("\u2581w", "or"), ("l", "d"), ("\u2581wor", "ld"), ("\u2581", "s"), ("e", "a")]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{i:02X}>" for i in range(256)] + chars)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=merges, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                         pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_TEMPLATE
    return tok


def save_tiny(folder, family, tokenizer, **overrides):
    from nbkit.demo.models import tiny_model

    kw = {"sliding_window": None} if family == "mistral" else {}
    kw.update(overrides)
    model = tiny_model(family, len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **kw)
    if family.startswith("gemma"):  # untrained norms are zeros there (x * (1 + w)): give them values to check
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(-0.5, 0.5)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def _reader(path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _field(reader, key):
    field = reader.fields[key]
    return field.contents()


def test_every_quant_type_the_package_writes_is_exported_and_read_back(tmp_path, demo_tok, one_thread):
    src = save_tiny(tmp_path / "src", "llama", demo_tok)
    figures = {}
    for quant in QUANT_TYPES:
        report = export_gguf(src, tmp_path / f"m-{quant}.gguf", quant=quant, modelfile=False)
        figures[quant] = report.quantization.rel
        assert report.check.rel <= FILE_TOLERANCE, report.check.line()
        assert report.tokenizer_round_trip
        types = {t.name: t.tensor_type.name for t in _reader(report.path).tensors}
        assert types["blk.0.attn_norm.weight"] == "F32"
        # rows of 256: every type's blocks fit (a K mix's own type: layer 0 of 4 gets no extra bits)
        assert types["blk.0.ffn_down.weight"] == K_FILE_TYPES.get(quant, quant.upper()), quant
        if quant.startswith("tq"):  # rows of 128 are not ternary blocks (256): f16, and the report says so
            assert types["blk.0.attn_output.weight"] == "F16" and any("f16" in n for n in report.notes)
        if BOUND[quant] is not None:
            assert report.quantization.rel <= BOUND[quant], report.quantization.line()
    assert figures["f32"] < 1e-5 < figures["f16"] < figures["q8_0"] < figures["q5_1"] < figures["q4_0"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quant", ["f16", "q4_0"])
def test_each_family_round_trips_through_transformers_gguf_reader(tmp_path, demo_tok, family, quant, one_thread):
    tokenizer = spm_tokenizer() if family.startswith("gemma") else demo_tok
    src = save_tiny(tmp_path / "src", family, tokenizer)
    report = export_gguf(src, tmp_path / f"{family}.gguf", quant=quant)
    assert report.check.rel <= FILE_TOLERANCE and report.check.top1 == 1.0, report.check.line()
    assert report.quantization.rel <= BOUND[quant], report.quantization.line()
    assert report.tokenizer_round_trip
    assert report.vocab["model"] == ("llama" if family.startswith("gemma") else "gpt2")


def test_llama_q_and_k_rows_are_permuted_and_the_check_fails_without_it(tmp_path, demo_tok, monkeypatch, one_thread):
    from safetensors.torch import load_file

    import nbkit.export.gguf_arch as arch

    src = save_tiny(tmp_path / "src", "llama", demo_tok)
    report = export_gguf(src, tmp_path / "ok.gguf", quant="f32", modelfile=False)
    q = load_file(str(src / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"].numpy()
    stored = next(t for t in _reader(report.path).tensors if t.name == "blk.0.attn_q.weight")
    heads = 4
    expected = q.reshape(heads, 2, q.shape[0] // heads // 2, q.shape[1]).swapaxes(1, 2).reshape(q.shape)
    assert np.array_equal(np.asarray(stored.data).reshape(q.shape), expected)
    assert not np.array_equal(expected, q)
    monkeypatch.setitem(arch.FAMILIES, "llama", arch.Family("llama", "LLAMA", permute_qk=False))
    with pytest.raises(ExportCheckError):
        export_gguf(src, tmp_path / "unpermuted.gguf", quant="f32", modelfile=False)


def test_gemma_norms_are_stored_plus_one_and_its_softcaps_are_in_the_metadata(tmp_path, one_thread):
    from safetensors.torch import load_file

    src = save_tiny(tmp_path / "src", "gemma2", spm_tokenizer())
    report = export_gguf(src, tmp_path / "g.gguf", quant="f32", modelfile=False, check_logits=False)
    reader = _reader(report.path)
    norm = load_file(str(src / "model.safetensors"))["model.layers.0.input_layernorm.weight"].numpy()
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    assert np.allclose(np.asarray(stored.data), norm + 1.0)
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied to the embedding
    assert _field(reader, "gemma2.attn_logit_softcapping") == pytest.approx(50.0)
    assert _field(reader, "gemma2.final_logit_softcapping") == pytest.approx(30.0)
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert _field(reader, "tokenizer.ggml.eot_token_id") == spm_tokenizer().convert_tokens_to_ids("<end_of_turn>")


def test_the_metadata_carries_the_chat_template_stop_token_and_pre_tokenizer(tmp_path, demo_tok):
    src = save_tiny(tmp_path / "src", "qwen3", demo_tok)
    report = export_gguf(src, tmp_path / "q.gguf", quant="f16", check_logits=False)
    reader = _reader(report.path)
    assert _field(reader, "tokenizer.chat_template") == demo_tok.chat_template
    assert _field(reader, "tokenizer.ggml.eot_token_id") == demo_tok.convert_tokens_to_ids("<|im_end|>")
    assert _field(reader, "tokenizer.ggml.pre") == "smollm"  # single digits, then GPT-2's split
    assert _field(reader, "general.architecture") == "qwen3"
    assert 'PARAMETER stop "<|im_end|>"' in report.modelfile.read_text()


def test_mistral_with_a_short_sliding_window_is_flagged_and_its_check_fails(tmp_path, demo_tok, one_thread):
    src = save_tiny(tmp_path / "src", "mistral", demo_tok, sliding_window=4)
    with pytest.raises(ExportCheckError):  # llama.cpp's llama architecture attends to the whole context
        export_gguf(src, tmp_path / "m.gguf", quant="f32", modelfile=False)


def test_what_is_not_covered_says_so(tmp_path, demo_tok):
    src = save_tiny(tmp_path / "moe", "gpt_oss", demo_tok)
    with pytest.raises(NotImplementedError, match="gpt_oss is not covered"):
        export_gguf(src, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="llama-quantize"):
        export_gguf(src, tmp_path / "x.gguf", quant="q3_k_m")


def test_the_real_model_round_trips_in_q8_0(tmp_path, smollm2_dir):
    report = export_gguf(smollm2_dir, tmp_path / "smollm2-q8_0.gguf", quant="q8_0")
    assert report.arch == "llama" and report.tokenizer_round_trip and report.vocab["model"] == "gpt2"
    assert report.check.rel <= FILE_TOLERANCE, report.check.line()
    assert report.quantization.rel <= 0.1 and report.quantization.top1 >= 0.9, report.quantization.line()
    assert report.tensor_types.get("F32", 0) == 61  # 30 x 2 block norms + the output norm
    text = report.modelfile.read_text()
    assert "You are a helpful AI assistant named SmolLM" in text  # the template's default system prompt
    assert 'PARAMETER stop "<|im_end|>"' in text


def test_the_pre_tokenizer_probe_says_nothing_about_a_short_model_max_length(capfd):
    """The fingerprint probe is longer than a tokenizer loaded with a short ``max_seq_length``; encoding it must not
    print transformers' "Token indices sequence length is longer than ..." line into the user's export cell."""
    import json

    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.export.gguf_vocab import PROBE, pre_tokenizer_name

    tokenizer = load_demo_tokenizer()
    tokenizer.model_max_length = 8
    assert len(tokenizer.encode(PROBE, verbose=False)) > 8  # the probe is longer: the warning's condition holds
    pre_tokenizer_name(tokenizer, json.loads(tokenizer.backend_tokenizer.to_str()))
    captured = capfd.readouterr()
    assert "Token indices sequence length" not in captured.out + captured.err


def test_a_path_that_is_not_a_model_folder_is_refused_saying_what_to_pass(tmp_path):
    """An adapter folder (what ``trainer.save_model`` writes) is named as one, with the merge to run first; a missing
    or empty folder is named as such, not looked up on the Hub."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="is a saved adapter, not a model folder") as error:
        export_gguf(adapter, tmp_path / "x.gguf")
    assert "merge_folder(" in str(error.value) and "python -m nbkit export" in str(error.value)
    for missing in (tmp_path / "nope", tmp_path / "out" / "mergd"):
        with pytest.raises(FileNotFoundError, match="holds no config.json"):
            export_gguf(missing, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
