"""K-quants: nbkit's encoders (``nbkit.export.kquants``) byte for byte against llama.cpp, and the K-quant GGUF
file types (q4_k_m, q5_k_m, q6_k) end to end.

- Golden bytes, on any machine: ``tests/fixtures/kquants/`` holds float32 inputs and the bytes llama.cpp's own
  reference quantizers wrote for them (``tools/make_kquant_fixtures.py``: random normal, heavy tails, all-zero and
  constant blocks, zero sub-blocks, fp16 scales that are subnormal, round to zero or overflow, ties, one sign
  only, real SmolLM2 weights). Every byte must match, and a change of summation order must break that.
- Live, where llama-cpp-python imports (skipped with the reason otherwise): the same through ctypes on more
  seeds and on whole real tensors; gguf's decoder (what transformers reads, what the round trip rounds with)
  against ggml's own, bitwise; and llama.cpp's quantizer (``llama_model_quantize`` from nbkit's f32 file) writes
  the same tensor types, the same bytes and the same ``general.file_type`` as nbkit's export, for each K type, on
  tiny models whose rows do and do not fit 256-value super-blocks.
- The round trip: each K type's file, read back by transformers, reproduces the source rounded as stored within
  ``FILE_TOLERANCE`` and stays within ``BOUND`` of the unquantized source.

Bytes and types are compared exactly. Decoding tolerance (normal input, relative RMS error): below the measured
0.072 / 0.036 / 0.018 (Q4_K / Q5_K / Q6_K) with a margin, 0.09 / 0.045 / 0.023.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest

from nbkit.export import kquants
from nbkit.export.gguf import BOUND, FILE_TOLERANCE, K_FILE_TYPES, KQuantModel, export_gguf, k_quant_type
from tools.make_kquant_fixtures import cases, ggml_base, reference, reference_dequantize

pytest_plugins = ["conftest_real_model"]

FIXTURES = Path(__file__).parent / "fixtures" / "kquants"
KINDS = ("q4_k", "q5_k", "q6_k")
ENCODE = {"q4_k": kquants.quantize_q4_k, "q5_k": kquants.quantize_q5_k, "q6_k": kquants.quantize_q6_k}
RMS_BOUND = {"q4_k": 0.09, "q5_k": 0.045, "q6_k": 0.023}


@pytest.fixture(scope="module")
def lib():
    found = ggml_base()
    if found is None:
        pytest.skip("llama_cpp is not importable (pip install llama-cpp-python): no live llama.cpp reference")
    return found


def golden(kind):
    inputs = np.load(FIXTURES / "inputs.npz")
    expected = np.load(FIXTURES / f"{kind}.npz")
    return {name: (inputs[name], expected[name]) for name in inputs.files if name != "meta"}


def ggml_type(kind):
    import gguf

    return getattr(gguf.GGMLQuantizationType, kind.upper())


@pytest.mark.parametrize("kind", KINDS)
def test_each_encoder_writes_llama_cpps_golden_bytes_for_every_case(kind):
    cases_here = golden(kind)
    assert len(cases_here) >= 16 and {"all_zero", "fp16_overflow", "tinier", "ties", "real_weights"} <= set(cases_here)
    wrong = [name for name, (values, expected) in cases_here.items()
             if not np.array_equal(ENCODE[kind](values).reshape(-1), expected)]
    assert not wrong, f"{kind}: bytes differ from llama.cpp's for {wrong}"


def test_the_golden_files_record_their_llama_cpp_and_cover_fp16_edge_scales():
    meta = json.loads(str(np.load(FIXTURES / "q4_k.npz")["meta"]))
    assert meta["llama_cpp"].startswith("llama-cpp-python") and "normal" in meta["cases"]
    q4 = np.load(FIXTURES / "q4_k.npz")
    d_bits = {name: q4[name].reshape(-1, 144)[:, :2].copy().view(np.uint16).ravel() for name in q4.files
              if name != "meta"}
    assert (d_bits["fp16_overflow"] == 0x7C00).any()  # fp16 infinity
    assert (d_bits["tinier"] == 0).all()  # rounds to zero
    assert ((d_bits["tiny"] > 0) & (d_bits["tiny"] < 0x0400)).all()  # subnormal


def test_numpys_pairwise_sum_in_place_of_ggmls_order_breaks_the_golden_bytes(monkeypatch):
    monkeypatch.setattr(kquants, "_sum", lambda terms: np.ascontiguousarray(terms.T).sum(axis=1))
    changed = [name for name, (values, expected) in golden("q4_k").items()
               if not np.array_equal(ENCODE["q4_k"](values).reshape(-1), expected)]
    assert changed


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_decodes_the_blocks_close_to_the_input(kind):
    import gguf

    values, _ = golden(kind)["normal"]
    back = gguf.quants.dequantize(ENCODE[kind](values), ggml_type(kind))
    rel = float(np.sqrt(np.mean((back - values) ** 2)) / np.sqrt(np.mean(values ** 2)))
    assert rel < RMS_BOUND[kind], rel
    zero = gguf.quants.dequantize(ENCODE[kind](np.zeros((2, 512), np.float32)), ggml_type(kind))
    assert np.array_equal(zero, np.zeros((2, 512), np.float32))


def test_any_leading_shape_is_blocks_along_the_last_axis():
    rng = np.random.default_rng(3)
    stacked = rng.standard_normal((3, 4, 512)).astype(np.float32)  # e.g. experts x rows x columns
    for kind in KINDS:
        out = ENCODE[kind](stacked)
        assert out.shape == (3, 4, 2 * kquants.BLOCK_BYTES[kind])
        assert np.array_equal(out[1, 2], ENCODE[kind](stacked[1, 2]))
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize_q4_k(np.zeros((4, 320), np.float32))
    with pytest.raises(ValueError, match="finite"):
        kquants.quantize_q6_k(np.full((1, 256), np.nan, np.float32))


MORE_BITS_OF_32 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}  # llama.cpp's use_more_bits(i, 32)


def test_tensor_types_follow_llama_cpps_rules_for_a_32_layer_model():
    model = KQuantModel(n_layer=32, tied=False)
    for i in range(32):
        more = i in MORE_BITS_OF_32
        for name in (f"blk.{i}.attn_v.weight", f"blk.{i}.ffn_down.weight"):
            assert k_quant_type(name, (4096, 4096), "q4_k_m", model) == ("Q6_K" if more else "Q4_K"), name
            assert k_quant_type(name, (4096, 4096), "q5_k_m", model) == ("Q6_K" if more else "Q5_K"), name
            assert k_quant_type(name, (4096, 4096), "q6_k", model) == "Q6_K"
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert k_quant_type(f"blk.{i}.{name}.weight", (4096, 4096), "q4_k_m", model) == "Q4_K"
    for quant in K_FILE_TYPES:
        assert k_quant_type("output.weight", (32000, 4096), quant, model) == "Q6_K"
        assert k_quant_type("token_embd.weight", (32000, 4096), quant, model) == K_FILE_TYPES[quant]
    tied = KQuantModel(n_layer=32, tied=True)
    assert k_quant_type("token_embd.weight", (32000, 4096), "q4_k_m", tied) == "Q6_K"


def test_rows_that_are_not_super_blocks_fall_back_as_llama_cpp_does():
    model = KQuantModel(n_layer=30, tied=True)
    assert k_quant_type("blk.5.attn_q.weight", (576, 576), "q4_k_m", model) == "Q5_0"
    assert k_quant_type("blk.5.attn_q.weight", (576, 576), "q5_k_m", model) == "Q5_1"
    assert k_quant_type("blk.5.attn_q.weight", (576, 576), "q6_k", model) == "Q8_0"
    assert k_quant_type("blk.0.attn_v.weight", (192, 576), "q4_k_m", model) == "Q8_0"  # Q6_K, then its fallback
    assert k_quant_type("token_embd.weight", (49152, 576), "q4_k_m", model) == "Q8_0"  # the tied output
    assert k_quant_type("blk.5.attn_q.weight", (144, 144), "q4_k_m", model) == "F16"  # not even 32-value blocks
    assert k_quant_type("blk.3.ffn_down.weight", (8, 576, 1536), "q4_k_m", model) == "Q4_K"  # stacked experts


def test_seventy_b_and_eight_expert_models_get_llama_cpps_extra_bits():
    big = KQuantModel(n_layer=80, tied=False, is_70b=True)
    assert k_quant_type("blk.40.attn_v.weight", (1024, 8192), "q4_k_m", big) == "Q5_K"  # not a more-bits layer
    assert k_quant_type("blk.42.attn_v.weight", (1024, 8192), "q4_k_m", big) == "Q6_K"  # (42 - 10) % 3 == 2
    moe = KQuantModel(n_layer=32, tied=False, n_expert=8)
    assert k_quant_type("blk.5.attn_v.weight", (1024, 4096), "q5_k_m", moe) == "Q8_0"
    assert k_quant_type("blk.5.attn_k.weight", (1024, 4096), "q4_k_m", moe) == "Q8_0"
    assert k_quant_type("blk.5.attn_output.weight", (4096, 4096), "q4_k_m", moe) == "Q5_K"
    assert k_quant_type("blk.4.ffn_down_exps.weight", (8, 4096, 14336), "q4_k_m", moe) == "Q4_K"
    assert k_quant_type("blk.6.ffn_down_exps.weight", (8, 4096, 14336), "q4_k_m", moe) == "Q6_K"


@pytest.fixture(scope="module")
def demo_tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


# hidden 256 / MLP 512: every weight is whole super-blocks; hidden 144 / MLP 352, tied: the fallbacks (144 is not
# even 32-value blocks: f16)
SHAPES = {"fits": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=16),
          "short_rows": dict(hidden_size=144, intermediate_size=352, num_hidden_layers=8, tie_word_embeddings=True)}


def save_tiny(folder, tokenizer, shape):
    from nbkit.demo.models import tiny_model

    model = tiny_model("llama", len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **SHAPES[shape])
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def tensors_of(path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("quant", list(K_FILE_TYPES))
def test_each_k_type_round_trips_through_transformers(tmp_path, demo_tok, quant, one_thread):
    import gguf

    src = save_tiny(tmp_path / "src", demo_tok, "fits")
    report = export_gguf(src, tmp_path / f"m-{quant}.gguf", quant=quant, modelfile=False)
    assert report.check.rel <= FILE_TOLERANCE, report.check.line()
    assert report.quantization.rel <= BOUND[quant], report.quantization.line()
    assert report.tokenizer_round_trip
    reader, tensors = tensors_of(report.path)
    assert reader.fields["general.file_type"].contents() == int(
        getattr(gguf.LlamaFileType, f"MOSTLY_{quant.upper()}"))
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert tensors["output.weight"].tensor_type.name == "Q6_K"
    assert tensors["blk.5.attn_q.weight"].tensor_type.name == K_FILE_TYPES[quant]
    more = "Q6_K" if quant != "q6_k" else K_FILE_TYPES[quant]
    assert tensors["blk.4.ffn_down.weight"].tensor_type.name == more  # (4 - 16/8) % 3 == 2
    assert tensors["blk.5.ffn_down.weight"].tensor_type.name == K_FILE_TYPES[quant]


def test_short_rows_fall_back_and_still_round_trip(tmp_path, demo_tok, one_thread):
    src = save_tiny(tmp_path / "src", demo_tok, "short_rows")
    report = export_gguf(src, tmp_path / "m.gguf", quant="q4_k_m", modelfile=False)
    assert report.check.rel <= FILE_TOLERANCE, report.check.line()
    _, tensors = tensors_of(report.path)
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "F16"  # 144 columns
    assert tensors["blk.1.attn_output.weight"].tensor_type.name == "Q5_0"  # 128 columns
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q8_0"  # Q6_K (more bits), 352 columns
    assert any("as llama.cpp does" in note for note in report.notes)


# ---- live: llama.cpp itself ----

@pytest.mark.parametrize("kind", KINDS)
def test_encoders_match_llama_cpp_live_on_more_seeds(lib, kind):
    for seed in range(6):
        for name, values in cases(seed=100 + seed, blocks=24, real=False).items():
            assert np.array_equal(ENCODE[kind](values).reshape(-1), reference(lib, kind, values)), (seed, name)


def test_encoders_match_llama_cpp_live_on_whole_real_tensors(lib, smollm2_dir):
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        down = f.get_tensor("model.layers.3.mlp.down_proj.weight").float().numpy()  # (576, 1536)
        embed = f.get_tensor("model.embed_tokens.weight").float().numpy()[:2048].reshape(-1, 256)
    for kind in KINDS:
        for values in (down, embed):
            assert np.array_equal(ENCODE[kind](values).reshape(-1), reference(lib, kind, values)), kind


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_decodes_exactly_as_ggml_does(lib, kind):
    import gguf

    for _, blocks in golden(kind).values():
        with np.errstate(invalid="ignore", over="ignore"):  # the fp16_overflow case decodes to inf and NaN
            ours = gguf.quants.dequantize(blocks.reshape(-1, kquants.BLOCK_BYTES[kind]), ggml_type(kind)).reshape(-1)
        np.testing.assert_array_equal(ours, reference_dequantize(lib, kind, blocks))  # NaN where ggml has NaN


@pytest.mark.parametrize("shape", list(SHAPES))
def test_llama_cpps_quantizer_writes_the_same_file_from_nbkits_f32_export(lib, tmp_path, demo_tok, shape, one_thread):
    import gguf
    import llama_cpp

    src = save_tiny(tmp_path / "src", demo_tok, shape)
    f32 = export_gguf(src, tmp_path / "f32.gguf", quant="f32", modelfile=False, check_logits=False).path
    for quant in K_FILE_TYPES:
        ours = export_gguf(src, tmp_path / f"{quant}.gguf", quant=quant, modelfile=False, check_logits=False).path
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = int(getattr(gguf.LlamaFileType, f"MOSTLY_{quant.upper()}"))
        theirs = tmp_path / f"{quant}-llama.gguf"
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
        (our_reader, a), (their_reader, b) = tensors_of(ours), tensors_of(theirs)
        assert a.keys() == b.keys()
        types = {n: (a[n].tensor_type.name, b[n].tensor_type.name) for n in a}
        assert all(x == y for x, y in types.values()), {n: t for n, t in types.items() if t[0] != t[1]}
        differ = [n for n in a if not np.array_equal(np.asarray(a[n].data).view(np.uint8),
                                                    np.asarray(b[n].data).view(np.uint8))]
        assert not differ, f"{quant}: tensors whose bytes differ from llama.cpp's: {differ}"
        assert (our_reader.fields["general.file_type"].contents()
                == their_reader.fields["general.file_type"].contents())
        assert len({t for t, _ in types.values()}) >= 3  # several types in one file: the rules were exercised
