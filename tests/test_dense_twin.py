"""``nbkit.dense_twin``: the dense decoding copy computes what the (4-bit, LoRA-adapted) model computes, shares what
it does not change, and knows when it is stale. CPU; the decoder that runs on it is tested in
tests/gpu/test_chat_gpu.py."""

from __future__ import annotations

import pytest
import torch

from nbkit import dense_twin

FAMILIES = ["qwen3", "llama", "gemma3"]


@pytest.fixture(scope="module")
def tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _lora(model, seed=0, **extra):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                             **extra))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _ids(tok):
    return torch.tensor([tok("Reverse the words: red fox moon blue owl")["input_ids"]])


def _relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_dense_copy_of_a_lora_model_gives_its_logits(tok, family, one_thread):
    """fp32: the merged weight is W + B A s summed in float32, the adapter path computes B (A x) s: the same numbers
    up to the order of the sums."""
    from nbkit.demo.models import tiny_model

    model = _lora(tiny_model(family, len(tok), pad_token_id=tok.pad_token_id))
    twin = dense_twin.build(model)
    ids = _ids(tok)
    assert _relative(_logits(twin, ids), _logits(model, ids)) < 1e-5
    with model.disable_adapter():
        plain = _logits(model, ids)
    assert _relative(_logits(twin, ids), plain) > 1e-2  # the adapters are in the copy: it is not the bare base


def test_the_copy_shares_what_it_does_not_change_and_counts_what_it_adds(tok, one_thread):
    from nbkit.demo.models import tiny_model

    model = _lora(tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id))
    twin = dense_twin.build(model)
    base = model.get_base_model()
    assert twin.model.embed_tokens.weight.data_ptr() == base.model.embed_tokens.weight.data_ptr()
    assert twin.model.norm.weight.data_ptr() == base.model.norm.weight.data_ptr()
    q = base.model.layers[0].self_attn.q_proj
    assert twin.model.layers[0].self_attn.q_proj.weight.data_ptr() != q.get_base_layer().weight.data_ptr()
    adapted = sum(m.get_base_layer().weight.numel() for m in base.modules() if hasattr(m, "lora_A"))
    assert dense_twin.extra_bytes(model) == adapted * 4  # fp32 model: 4 bytes a merged weight
    assert not any(p.requires_grad for p in twin.parameters()) and not twin.training


def test_a_disabled_adapter_and_an_untouched_16bit_layer_are_the_base_as_it_is(tok, one_thread):
    from nbkit.demo.models import tiny_model

    model = _lora(tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id))
    ids = _ids(tok)
    with model.disable_adapter():
        twin = dense_twin.build(model)
        plain = _logits(model, ids)
    assert _relative(_logits(twin, ids), plain) == 0.0
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    assert twin.model.layers[0].self_attn.q_proj.weight.data_ptr() == q.get_base_layer().weight.data_ptr()
    assert dense_twin.extra_bytes(model) > 0  # enabled again: the adapted layers are merged copies


def test_trained_embeddings_and_head_are_the_ones_that_run(tok, one_thread):
    """``modules_to_save`` (what the tiny demo trains in full): the copy takes the trained copies, not the originals."""
    from nbkit.demo.models import tiny_model

    model = _lora(tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, tie_word_embeddings=False),
                  modules_to_save=["embed_tokens", "lm_head"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.1)
    twin = dense_twin.build(model)
    ids = _ids(tok)
    assert _relative(_logits(twin, ids), _logits(model, ids)) < 1e-5


def test_a_4bit_base_is_dequantized_and_computes_as_bitsandbytes_does(tmp_path, tok, one_thread):
    """bitsandbytes' 4-bit layer computes in bf16 and hands back its input's dtype; norms and embeddings stay fp32
    after ``prepare_model_for_kbit_training``. The copy does the same with the dequantized weight plus the adapters
    merged and rounded once to bf16: bf16-level agreement."""
    from nbkit import load_model
    from nbkit.demo.models import build_base

    build_base(tmp_path / "base", "qwen3", seed=0)
    model, _ = load_model(str(tmp_path / "base"), load_in_4bit=True, lora_r=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    model.eval()
    twin = dense_twin.build(model)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj.get_base_layer()
    compute = layer.weight.quant_state.dtype  # bf16 on a GPU, fp32 on a CPU (load_model's choice)
    assert twin.model.layers[0].self_attn.q_proj.weight.dtype == compute
    assert twin.model.norm.weight.data_ptr() == model.get_base_model().model.norm.weight.data_ptr()
    ids = _ids(tok)
    assert _relative(_logits(twin, ids), _logits(model, ids)) < 2e-2
    assert dense_twin.extra_bytes(model) == sum(m.get_base_layer().weight.quant_state.shape.numel()
                                                for m in model.modules() if hasattr(m, "lora_A")) * compute.itemsize


def test_the_signature_sees_an_optimizer_step_and_an_adapter_switch(tok, one_thread):
    from nbkit.demo.models import tiny_model

    model = _lora(tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id))
    before = dense_twin.signature(model)
    assert dense_twin.signature(model) == before
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).mul_(2.0)  # in place, as an optimizer does
    after_step = dense_twin.signature(model)
    assert after_step != before
    with model.disable_adapter():
        assert dense_twin.signature(model) != after_step


def test_adapters_the_merge_cannot_express_are_named(tok, one_thread):
    from nbkit.demo.models import tiny_model

    model = _lora(tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id), use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        dense_twin.build(model)


def test_no_room_off_a_gpu_is_a_reason_not_an_error(tok):
    from nbkit.demo.models import tiny_model

    model = _lora(tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id))
    assert dense_twin.fits(model) == "the model is on cpu, not a CUDA GPU"
