"""GGUF export of the MoE families: Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral written as llama.cpp's
converter writes them, read back and run; gpt-oss and dense-layer Qwen MoE configs refused by name.

What proves a file: for qwen3moe and qwen2moe, transformers' own GGUF reader; it has no llama with experts, so a
Mixtral file is read back by ``nbkit.export.gguf_readback``, whose inverse is checked here against transformers'
reader tensor for tensor on the files both read. Independently of either reader, every tensor's name, ggml shape,
type and values and every expert key is compared with what llama.cpp's loader asks for (its ``create_tensor`` dims,
restated below). Where llama-cpp-python is importable, llama.cpp itself runs the files.

Bounds (relative logit difference, max |diff| / max |logit|): the file read back against the source rounded as
stored, ``FILE_TOLERANCE`` (1e-4) for every type; against the unquantized source, ``BOUND`` per type; llama.cpp on
an f32 file (f32 KV cache) against transformers on the source, ``LLAMA_CPP_TOLERANCE`` (float32 summation order
only), with the same greedy tokens; llama.cpp on a q4_0 file against its weights read back,
``LLAMA_CPP_QUANT_BOUND``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbkit.export.compare import ExportCheckError
from nbkit.export.gguf import BOUND, FILE_TOLERANCE, export_gguf

LLAMA_CPP_TOLERANCE = 1e-3
# llama.cpp on a q4_0 file against the same file's weights in transformers: llama.cpp rounds activations to 8 bits
# in its q4_0 dot products, and a random tiny model's routing amplifies that; a wrong block layout lands near 1
LLAMA_CPP_QUANT_BOUND = 0.1
HIDDEN, EXPERTS, USED = 128, 4, 2
# one expert's intermediate size, chosen unlike HIDDEN so that a transposed or swapped tensor changes shape
EXPERT_FF = {"qwen3_moe": 64, "qwen2_moe": 64, "mixtral": 96}
SHARED_FF = 96
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


@pytest.fixture(scope="module")
def demo_tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def tiny_moe(family, tokenizer, **overrides):
    """A 2-layer random model of ``family`` (qwen2_moe is not among nbkit.demo's families: built here alike)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nbkit.demo.models import tiny_model

    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if family == "qwen2_moe":
        config = AutoConfig.for_model(
            "qwen2_moe", vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, num_experts=EXPERTS,
            num_experts_per_tok=USED, moe_intermediate_size=EXPERT_FF[family],
            shared_expert_intermediate_size=SHARED_FF, tie_word_embeddings=False, **ids, **overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(config).eval()
    if family == "mixtral":
        overrides = {"intermediate_size": EXPERT_FF[family], **overrides}
    return tiny_model(family, len(tokenizer), num_hidden_layers=2, **ids, **overrides)


def save_tiny(folder, family, tokenizer, **overrides):
    tiny_moe(family, tokenizer, **overrides).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def _reader(path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _saved(folder):
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


# head_dim 48: heads * head_dim != hidden, as in Qwen3-30B-A3B (32 heads of 128 in a hidden size of 2048)
@pytest.mark.parametrize("family, quant, overrides", [("qwen3_moe", "f16", {}), ("qwen3_moe", "q4_0", {"head_dim": 48}),
                                                      ("qwen2_moe", "q8_0", {}), ("mixtral", "f16", {}),
                                                      ("mixtral", "q4_0", {})])
def test_each_moe_family_round_trips_through_its_reader(tmp_path, demo_tok, family, quant, overrides, one_thread):
    src = save_tiny(tmp_path / "src", family, demo_tok, **overrides)
    report = export_gguf(src, tmp_path / f"{family}.gguf", quant=quant, modelfile=False)
    assert report.arch == ARCH[family]
    assert report.check.rel <= FILE_TOLERANCE and report.check.top1 == 1.0, report.check.line()
    assert report.quantization.rel <= BOUND[quant], report.quantization.line()
    assert report.tokenizer_round_trip
    # transformers reads qwen2moe / qwen3moe; it has no llama with experts, so nbkit reads Mixtral back
    assert report.check.what.startswith(f"GGUF {quant} read back by {'nbkit' if family == 'mixtral' else 'transformers'}")
    types = {t.name: t.tensor_type.name for t in _reader(report.path).tensors}
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        assert types[f"blk.1.{name}.weight"] == quant.upper()
    assert types["blk.1.ffn_gate_inp.weight"] == "F32"  # the router, as llama.cpp's converter keeps it


def _expected_tensors(family, layers=2):
    """llama.cpp's loader (src/models/<arch>.cpp, create_tensor): name -> ggml dims (ne), for this test's sizes."""
    ff, kv = EXPERT_FF[family], 2 * 32
    want = {"token_embd.weight": None, "output_norm.weight": [HIDDEN], "output.weight": None}
    for i in range(layers):
        blk = f"blk.{i}."
        want.update({blk + "attn_norm.weight": [HIDDEN], blk + "attn_q.weight": [HIDDEN, HIDDEN],
                     blk + "attn_k.weight": [HIDDEN, kv], blk + "attn_v.weight": [HIDDEN, kv],
                     blk + "attn_output.weight": [HIDDEN, HIDDEN], blk + "ffn_norm.weight": [HIDDEN],
                     blk + "ffn_gate_inp.weight": [HIDDEN, EXPERTS],
                     blk + "ffn_gate_exps.weight": [HIDDEN, ff, EXPERTS],
                     blk + "ffn_up_exps.weight": [HIDDEN, ff, EXPERTS],
                     blk + "ffn_down_exps.weight": [ff, HIDDEN, EXPERTS]})
        if family == "qwen3_moe":
            want.update({blk + "attn_q_norm.weight": [32], blk + "attn_k_norm.weight": [32]})
        if family == "qwen2_moe":
            want.update({blk + "attn_q.bias": [HIDDEN], blk + "attn_k.bias": [kv], blk + "attn_v.bias": [kv],
                         blk + "ffn_gate_inp_shexp.weight": [HIDDEN],
                         blk + "ffn_gate_shexp.weight": [HIDDEN, SHARED_FF],
                         blk + "ffn_up_shexp.weight": [HIDDEN, SHARED_FF],
                         blk + "ffn_down_shexp.weight": [SHARED_FF, HIDDEN]})
    return want


def _interleave(w, heads):
    """llama.cpp's rope layout of q/k rows (its converter's permute), restated."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_file_holds_what_llama_cpp_reads(tmp_path, demo_tok, family):
    src = save_tiny(tmp_path / "src", family, demo_tok)
    report = export_gguf(src, tmp_path / "m.gguf", quant="f32", modelfile=False, check_logits=False)
    reader = _reader(report.path)
    tensors = {t.name: t for t in reader.tensors}
    want = _expected_tensors(family)
    assert set(tensors) == set(want)
    for name, dims in want.items():
        if dims is not None:
            assert [int(d) for d in tensors[name].shape] == dims, name
        if len(dims or [0, 0]) == 1 or "ffn_gate_inp" in name:
            assert tensors[name].tensor_type.name == "F32", name

    saved = _saved(src)
    experts = "block_sparse_moe" if family == "mixtral" else "mlp"
    roles = {"gate": "w1", "up": "w3", "down": "w2"} if family == "mixtral" else {r: f"{r}_proj" for r in
                                                                                   ("gate", "up", "down")}

    def data(name):
        t = tensors[name]
        return np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])

    for i in range(2):
        layer = f"model.layers.{i}"
        for role, weight in roles.items():
            stacked = np.stack([saved[f"{layer}.{experts}.experts.{x}.{weight}.weight"] for x in range(EXPERTS)])
            assert np.array_equal(data(f"blk.{i}.ffn_{role}_exps.weight"), stacked), (i, role)
        assert np.array_equal(data(f"blk.{i}.ffn_gate_inp.weight"), saved[f"{layer}.{experts}.gate.weight"])
        q = saved[f"{layer}.self_attn.q_proj.weight"]
        assert np.array_equal(data(f"blk.{i}.attn_q.weight"), _interleave(q, 4) if family == "mixtral" else q)
        if family == "qwen2_moe":
            assert np.array_equal(data(f"blk.{i}.ffn_gate_inp_shexp.weight"),
                                  saved[f"{layer}.mlp.shared_expert_gate.weight"].reshape(-1))
            assert np.array_equal(data(f"blk.{i}.ffn_up_shexp.weight"), saved[f"{layer}.mlp.shared_expert.up_proj.weight"])

    arch = ARCH[family]
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(arch + ".")}
    assert fields[f"{arch}.expert_count"] == EXPERTS and fields[f"{arch}.expert_used_count"] == USED
    assert fields[f"{arch}.embedding_length"] == HIDDEN and fields[f"{arch}.block_count"] == 2
    if family == "mixtral":  # llama sizes its experts with feed_forward_length and writes no expert length
        assert fields["llama.feed_forward_length"] == EXPERT_FF[family]
        assert "llama.expert_feed_forward_length" not in fields
        assert fields["llama.rope.dimension_count"] == 32 and fields["llama.vocab_size"] == len(demo_tok)
    else:
        assert fields[f"{arch}.expert_feed_forward_length"] == EXPERT_FF[family]
        assert fields[f"{arch}.feed_forward_length"] == 256
    if family == "qwen2_moe":
        assert fields["qwen2moe.expert_shared_feed_forward_length"] == SHARED_FF
    else:
        assert f"{arch}.expert_shared_feed_forward_length" not in fields


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gate_and_up_swapped_fail_the_check(tmp_path, demo_tok, family, monkeypatch, one_thread):
    import nbkit.export.gguf_moe as moe

    src = save_tiny(tmp_path / "src", family, demo_tok)
    swapped = {"gate_proj": "up", "w1": "up", "up_proj": "gate", "w3": "gate"}
    for key, role in swapped.items():
        monkeypatch.setitem(moe._ROLE, key, role)
    with pytest.raises(ExportCheckError, match="does not reproduce"):
        export_gguf(src, tmp_path / "m.gguf", quant="f32", modelfile=False)


@pytest.mark.parametrize("family, quant", [("llama", "q4_0"), ("qwen3_moe", "q8_0"), ("qwen2_moe", "f16")])
def test_nbkits_reader_agrees_with_transformers_reader(tmp_path, demo_tok, family, quant, one_thread):
    """The inverse Mixtral files are read back with, held to transformers' reader where both read: llama's
    permuted q/k and qwen's stacked experts are the parts a Mixtral file is made of."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nbkit.demo.models import tiny_model
    from nbkit.export.gguf_readback import read_with_nbkit

    if family == "llama":
        src = tmp_path / "src"
        tiny_model("llama", len(demo_tok), num_hidden_layers=2, pad_token_id=demo_tok.pad_token_id,
                   eos_token_id=demo_tok.eos_token_id, bos_token_id=None).save_pretrained(str(src))
        demo_tok.save_pretrained(str(src))
    else:
        src = save_tiny(tmp_path / "src", family, demo_tok)
    report = export_gguf(src, tmp_path / "m.gguf", quant=quant, modelfile=False, check_logits=False)
    config = AutoConfig.from_pretrained(str(src))
    ours = read_with_nbkit(report.path, config).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", config=config,
                                                  dtype=torch.float32).state_dict()
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_transformers_reader_has_no_mixtral(tmp_path, demo_tok):
    """Why a Mixtral file is read back by nbkit: transformers' reader refuses the Mixtral model, and on its own
    builds a dense llama (it drops the experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = save_tiny(tmp_path / "src", "mixtral", demo_tok)
    export_gguf(src, tmp_path / "m.gguf", quant="f32", modelfile=False, check_logits=False)
    assert not AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf").to_dict().get("num_local_experts")
    with pytest.raises(NotImplementedError, match="mixtral"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                             config=AutoConfig.from_pretrained(str(src)))


def test_expert_metadata_that_differs_from_the_model_fails(tmp_path, demo_tok):
    from transformers import AutoConfig

    from nbkit.export.gguf_moe import check_metadata

    src = save_tiny(tmp_path / "src", "qwen3_moe", demo_tok)
    report = export_gguf(src, tmp_path / "m.gguf", quant="f32", modelfile=False, check_logits=False)
    config = AutoConfig.from_pretrained(str(src))
    check_metadata(report.path, config)
    config.num_experts_per_tok = 3
    with pytest.raises(ExportCheckError, match="qwen3moe.expert_used_count: file 2, model 3"):
        check_metadata(report.path, config)


def test_gpt_oss_is_refused_naming_what_is_missing(tmp_path, demo_tok):
    from nbkit.demo.models import tiny_model

    src = tmp_path / "src"
    tiny_model("gpt_oss", len(demo_tok), num_hidden_layers=2).save_pretrained(str(src))
    demo_tok.save_pretrained(str(src))
    with pytest.raises(NotImplementedError, match="gpt_oss is not covered") as refused:
        export_gguf(src, tmp_path / "x.gguf")
    for missing in ("attention sinks", "MXFP4", "biases", "YaRN", "convert_hf_to_gguf.py"):
        assert missing in str(refused.value)
    assert not (tmp_path / "x.gguf").exists()


def test_qwen_moe_with_dense_layers_is_refused():
    from nbkit.demo.models import tiny_config
    from nbkit.export.gguf_arch import family_of

    assert family_of(tiny_config("qwen3_moe", 64)).arch == "QWEN3MOE"
    with pytest.raises(NotImplementedError, match="experts in every layer"):
        family_of(tiny_config("qwen3_moe", 64, mlp_only_layers=[1]))
    with pytest.raises(NotImplementedError, match="decoder_sparse_step=2"):
        family_of(tiny_config("qwen3_moe", 64, decoder_sparse_step=2))


@pytest.mark.parametrize("family, overrides, note", [
    ("qwen3_moe", {"norm_topk_prob": False}, "llama.cpp's qwen3moe renormalizes"),
    ("qwen3_moe", {"norm_topk_prob": True}, None),
    ("qwen2_moe", {"norm_topk_prob": True}, "llama.cpp's qwen2moe does not renormalize"),
    ("qwen2_moe", {}, None),
    ("mixtral", {"sliding_window": 4}, "Mixtral's sliding window (4)"),
    ("mixtral", {}, None),
])
def test_what_llama_cpp_computes_otherwise_is_noted(tmp_path, demo_tok, family, overrides, note):
    src = save_tiny(tmp_path / "src", family, demo_tok, **overrides)
    report = export_gguf(src, tmp_path / "m.gguf", quant="f32", modelfile=False, check_logits=False)
    if note is None:
        assert report.notes == []
    else:
        assert any(note in n for n in report.notes), report.notes


def test_experts_are_stacked_from_either_checkpoint_layout_and_a_missing_one_is_refused(demo_tok):
    from nbkit.demo.models import tiny_config
    from nbkit.export.gguf_moe import fuse_experts, split_experts

    config = tiny_config("qwen3_moe", 64, num_hidden_layers=1)
    rng = np.random.default_rng(0)
    ff = config.moe_intermediate_size
    per_expert = {f"model.layers.0.mlp.experts.{x}.{w}.weight": rng.standard_normal(shape, dtype=np.float32)
                  for x in range(EXPERTS) for w, shape in (("gate_proj", (ff, HIDDEN)), ("up_proj", (ff, HIDDEN)),
                                                           ("down_proj", (HIDDEN, ff)))}
    fused = dict(fuse_experts(iter(per_expert.items()), config))
    assert {k: v.shape for k, v in fused.items()} == {"model.layers.0.mlp.experts.gate_up_proj": (EXPERTS, 2 * ff, HIDDEN),
                                                      "model.layers.0.mlp.experts.down_proj": (EXPERTS, HIDDEN, ff)}
    again = dict(fuse_experts(iter(fused.items()), config))  # an already fused checkpoint passes through
    parts = dict(split_experts("model.layers.0.mlp.experts.gate_up_proj", again["model.layers.0.mlp.experts.gate_up_proj"],
                               config))
    assert np.array_equal(parts["blk.0.ffn_up_exps.weight"][2], per_expert["model.layers.0.mlp.experts.2.up_proj.weight"])
    with pytest.raises(ValueError, match="shape"):
        split_experts("model.layers.0.mlp.experts.down_proj", fused["model.layers.0.mlp.experts.gate_up_proj"], config)
    del per_expert["model.layers.0.mlp.experts.3.down_proj.weight"]
    with pytest.raises(ValueError, match="lacks 1 of 12"):
        list(fuse_experts(iter(per_expert.items()), config))


@pytest.mark.parametrize("family, quant", [("qwen3_moe", "f32"), ("qwen2_moe", "f32"), ("mixtral", "f32"),
                                           ("qwen3_moe", "q4_0")])
def test_llama_cpp_runs_the_file_like_transformers(tmp_path, demo_tok, family, quant, one_thread):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: the files are held to "
                                                        "llama.cpp's layout by test_the_file_holds_what_llama_cpp_reads")
    from transformers import AutoConfig, AutoModelForCausalLM

    from nbkit.export.compare import prompt_batches
    from nbkit.export.gguf_readback import read_with_nbkit

    src = save_tiny(tmp_path / "src", family, demo_tok)
    report = export_gguf(src, tmp_path / "m.gguf", quant=quant, modelfile=False, check_logits=False)
    f32 = 0  # GGML_TYPE_F32: an f32 KV cache
    llm = llama_cpp.Llama(model_path=str(report.path), n_ctx=256, logits_all=True, n_threads=1, verbose=False,
                          type_k=f32, type_v=f32)
    if quant == "f32":  # only summation order separates llama.cpp from transformers on the source
        reference, bound = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval(), LLAMA_CPP_TOLERANCE
    else:  # the file's own weights; llama.cpp also rounds activations to 8 bits in its q4_0 dot products
        reference, bound = read_with_nbkit(report.path, AutoConfig.from_pretrained(str(src))), LLAMA_CPP_QUANT_BOUND
    for ids in prompt_batches(demo_tok, ["Reverse the words: red fox moon", "What is the capital of France?"]):
        llm.reset()
        llm.eval(ids)
        got = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
        with torch.no_grad():
            ref = reference(input_ids=torch.tensor([ids])).logits[0]
        rel = float((got - ref).abs().max() / ref.abs().max())
        assert rel <= bound, f"llama.cpp vs transformers: relative {rel:.2e}"
        if quant != "f32":
            continue
        theirs = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # greedy; endless unless stopped
            theirs.append(token)
            if len(theirs) == 8 or token == llm.token_eos():
                break
        ours = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        assert theirs == ours
