"""``nbkit.load_model`` on local folders: 4-bit (NF4, CPU) and 16-bit, LoRA placement, checkpointing, pad tokens,
a clear error for a model that cannot be found offline, and 4-bit layers that stay trainable after an eval."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from parity import Tol, assert_same_tensors

from nbkit.demo.models import tiny_model
from nbkit.demo.tokenizer import load_demo_tokenizer
from nbkit.loading import (
    ModelNotFoundError,
    keep_4bit_trainable,
    load_model,
    load_tokenizer,
    pick_compute_dtype,
    set_pad_token,
)

bnb = pytest.importorskip("bitsandbytes")

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
LAYERS = 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny qwen3 saved with save_pretrained beside the demo tokenizer, and the fp32 original."""
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tokenizer), seed=3, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model


def _ids(n: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 1024, (1, n), generator=torch.Generator().manual_seed(seed))


def _lora_targets(model) -> set[str]:
    return {name.split(".")[-2] for name, _ in model.named_modules() if name.endswith(".lora_A")}


# --- compute dtype -------------------------------------------------------------------------------------------------


def test_compute_dtype_cpu_is_fp32():
    assert pick_compute_dtype("cpu") == torch.float32
    if not torch.cuda.is_available():
        assert pick_compute_dtype() == torch.float32


@pytest.mark.parametrize("capability, expected", [((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                                  ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16),
                                                  ((6, 1), torch.float16)])
def test_compute_dtype_follows_compute_capability(monkeypatch, capability, expected):
    # a T4 (sm75) reports is_bf16_supported() == True (emulated): only the capability must decide
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert pick_compute_dtype("cuda:0") == expected
    assert pick_compute_dtype(0) == expected


# --- 4-bit ---------------------------------------------------------------------------------------------------------


def test_4bit_load_is_nf4_double_quant_with_lora_on_all_projections(saved):
    folder, original = saved
    model, tokenizer = load_model(str(folder), load_in_4bit=True, lora_r=8)
    linear4 = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 7 * LAYERS
    state = linear4[0].weight.quant_state
    assert state.quant_type == "nf4" and state.nested, "NF4 with double quantization"
    assert linear4[0].compute_dtype == torch.float32  # CPU
    assert _lora_targets(model) == PROJECTIONS
    lm_head = model.get_output_embeddings()
    assert type(lm_head) is torch.nn.Linear, "lm_head must stay a plain, unadapted Linear"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 7 * LAYERS
    assert tokenizer.pad_token == "<|endoftext|>"
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_4bit_weights_are_the_saved_ones(saved):
    """The 4-bit model computes what the saved fp32 model does, up to NF4 rounding (and not what another does)."""
    folder, original = saved
    model, _ = load_model(str(folder), load_in_4bit=True, lora_r=8)
    model.eval()
    ids = _ids()
    with torch.no_grad():
        got = model(input_ids=ids).logits.flatten()
        want = original(input_ids=ids).logits.flatten()
        other = tiny_model("qwen3", 1024, seed=4)(input_ids=ids).logits.flatten()
    corr = torch.corrcoef(torch.stack([got, want, other]))
    assert corr[0, 1] > 0.9, f"4-bit vs saved model: correlation {corr[0, 1]:.3f}"
    assert corr[0, 2] < 0.5, f"4-bit vs an unrelated model: correlation {corr[0, 2]:.3f}"


def test_gradient_checkpointing_on_and_non_reentrant(saved):
    folder, _ = saved
    model, _ = load_model(str(folder), load_in_4bit=True, lora_r=8)
    base = model.get_base_model()
    assert base.is_gradient_checkpointing
    assert base.model.gradient_checkpointing
    assert base.model.layers[0]._gradient_checkpointing_func.keywords.get("use_reentrant") is False
    assert base.config.use_cache is False
    model_off, _ = load_model(str(folder), load_in_4bit=True, lora_r=8, gradient_checkpointing=False)
    assert not model_off.get_base_model().is_gradient_checkpointing


def test_4bit_lora_trains(saved):
    """Every LoRA matrix gets a finite, non-zero gradient, and a few steps lower the loss."""
    folder, _ = saved
    torch.manual_seed(0)
    model, _ = load_model(str(folder), load_in_4bit=True, lora_r=8)
    model.train()
    ids = _ids(64)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 1:  # B is zero at init: from the 2nd step on, A has a gradient too
            named = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in named.values())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_4bit_stays_trainable_after_an_eval_pass(saved):
    """bitsandbytes repacks 4-bit weights for inference on AVX512-BF16 CPUs after an eval-mode forward, after which
    its matmul has no backward. Gradients after an eval pass must equal those of a fresh model.

    (On CPUs without AVX512-BF16 bitsandbytes never repacks and this holds trivially; the second half checks that
    keep_4bit_trainable undoes a repacking that already happened.)"""
    folder, _ = saved
    ids = _ids(40)

    def lora_grads(do_eval: bool, fix_after_eval: bool = False):
        torch.manual_seed(0)
        model, _ = load_model(str(folder), load_in_4bit=True, lora_r=8)
        with torch.no_grad():  # non-zero B, so that the A gradients depend on the base layers' backward
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
        if do_eval:
            model.eval()
            if fix_after_eval:  # simulate a model loaded elsewhere: repacking allowed, then undone
                for module in model.modules():
                    if isinstance(module, bnb.nn.Linear4bit):
                        module.support_avx512bf16_for_cpu = bnb.functional.has_avx512bf16()
            with torch.no_grad():
                model(input_ids=ids[:, :5])
            if fix_after_eval:
                keep_4bit_trainable(model)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    fresh = lora_grads(do_eval=False)
    prevented = lora_grads(do_eval=True)
    assert_same_tensors(prevented, fresh, Tol(rtol=1e-5, atol=1e-7), where="LoRA gradient after an eval pass")
    # undoing a repacking is slightly lossy (bitsandbytes rounds the block scales to bf16 when it repacks), so
    # the gradients agree to about 1%; without the undo they are off by the order of the gradients themselves
    undone = lora_grads(do_eval=True, fix_after_eval=True)
    worst = max((undone[n] - g).abs().max() / g.abs().max() for n, g in fresh.items())
    assert worst < 0.03, f"largest relative gradient error after undoing the repacking: {worst:.3g}"


def test_modules_to_save_trains_embeddings_and_head(saved):
    folder, _ = saved
    model, _ = load_model(str(folder), load_in_4bit=True, lora_r=8, modules_to_save=["embed_tokens", "lm_head"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("embed_tokens.modules_to_save" in n for n in trainable)
    assert any("lm_head.modules_to_save" in n for n in trainable)
    assert _lora_targets(model) == PROJECTIONS


def test_tied_embeddings_stay_tied_when_trained(tmp_path):
    tokenizer = load_demo_tokenizer()
    tiny_model("gemma2", len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), load_in_4bit=True, lora_r=4, modules_to_save=["embed_tokens", "lm_head"])
    base = model.get_base_model()
    embed = base.model.embed_tokens.modules_to_save["default"].weight
    assert base.get_output_embeddings().weight.data_ptr() == embed.data_ptr()


# --- 16-bit --------------------------------------------------------------------------------------------------------


def test_16bit_load(saved):
    folder, original = saved
    model, _ = load_model(str(folder), load_in_4bit=False, dtype=torch.bfloat16, lora_r=4, lora_alpha=8)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    base = model.get_base_model()
    assert base.model.embed_tokens.weight.dtype == torch.bfloat16
    q = base.model.layers[1].self_attn.q_proj
    torch.testing.assert_close(q.base_layer.weight.float(), original.model.layers[1].self_attn.q_proj.weight,
                               rtol=1e-2, atol=1e-3)
    assert q.scaling["default"] == 2.0  # alpha / r
    assert _lora_targets(model) == PROJECTIONS
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(folder), load_in_4bit=False, dtype="float12")


def test_full_finetuning_without_lora(saved):
    folder, _ = saved
    model, _ = load_model(str(folder), load_in_4bit=False, lora_r=None, gradient_checkpointing=False)
    assert not hasattr(model, "peft_config")
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="4-bit"):
        load_model(str(folder), load_in_4bit=True, lora_r=0)


def test_moe_lora_covers_attention_and_experts(tmp_path):
    """A MoE family: "all-linear" keeps PEFT's meaning (what was nn.Linear in transformers 4): attention, the fused
    experts (as LoRA on the 3-D expert parameters) and the router; every adapter gets a gradient."""
    tokenizer = load_demo_tokenizer()
    tiny_model("qwen3_moe", len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), load_in_4bit=True, lora_r=4)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    for part in ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts", "mlp.gate"):
        assert any(f"layers.0.{part}." in n for n in names), part
    assert all("lora_" in n for n in names)
    ids = _ids(24)
    model.train()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    model(input_ids=ids, labels=ids).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not missing, missing[:5]


def test_max_seq_length(saved, caplog):
    folder, _ = saved
    _, tokenizer = load_model(str(folder), load_in_4bit=False, lora_r=4, max_seq_length=512)
    assert tokenizer.model_max_length == 512
    with caplog.at_level(logging.WARNING, logger="nbkit.loading"):
        load_model(str(folder), load_in_4bit=False, lora_r=4, max_seq_length=10_000)
    assert "max_position_embeddings" in caplog.text


@pytest.mark.parametrize("value", [0, -5, 8.0, True])
def test_max_seq_length_must_be_a_positive_int_said_before_loading(saved, value):
    folder, _ = saved
    with pytest.raises(ValueError) as caught:
        load_model(str(folder), load_in_4bit=False, lora_r=4, max_seq_length=value)
    from nbkit.settings import length_problem

    assert str(caught.value) == length_problem("max_seq_length", value)
    assert str(caught.value).startswith(f"max_seq_length={value!r}: use None or a positive int")
    with pytest.raises(ValueError, match=r"^max_seq_length=0: "):
        load_model(str(folder / "missing"), max_seq_length=0)  # before the model is looked for


# --- not found -----------------------------------------------------------------------------------------------------


def test_missing_local_folder_is_a_clear_error(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelNotFoundError, match="no such folder|check the path") as info:
        load_model(str(missing))
    assert str(missing) in str(info.value)
    assert isinstance(info.value, OSError)


def test_folder_without_weights_is_a_clear_error(saved, tmp_path):
    folder, _ = saved
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ModelNotFoundError, match="weights"):
        load_model(str(tmp_path), load_in_4bit=False, lora_r=4)


def test_unknown_repo_offline_fails_fast_and_clearly():
    """HF_HUB_OFFLINE=1 and a repo id that exists nowhere: a ModelNotFoundError naming it, within seconds."""
    code = textwrap.dedent(
        """
        from nbkit.loading import ModelNotFoundError, load_model
        try:
            load_model("nbkit-tests/no-such-model-3141")
        except ModelNotFoundError as error:
            print("MESSAGE:", error)
        else:
            raise SystemExit("no error")
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    message = out.stdout.split("MESSAGE:", 1)[1]
    assert "nbkit-tests/no-such-model-3141" in message
    assert "HF_HUB_OFFLINE" in message and "local folder" in message


# --- tokenizer / pad token -----------------------------------------------------------------------------------------


def _word_tokenizer(tokens: list[str], **special):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["hello", "world", *tokens])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=special.get("unk_token")))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def test_pad_token_prefers_a_dedicated_pad_like_token():
    tok = _word_tokenizer(["<|eot_id|>", "<|finetune_right_pad_id|>"], eos_token="<|eot_id|>")
    set_pad_token(tok)
    assert tok.pad_token == "<|finetune_right_pad_id|>"


def test_pad_token_falls_back_to_unk_then_eos():
    tok = _word_tokenizer(["<unk>", "</s>"], unk_token="<unk>", eos_token="</s>")
    set_pad_token(tok)
    assert tok.pad_token == "<unk>"
    tok = _word_tokenizer(["</s>"], eos_token="</s>")
    set_pad_token(tok)
    assert tok.pad_token == "</s>"
    with pytest.raises(ValueError, match="pad"):
        set_pad_token(_word_tokenizer([]))


def test_existing_pad_token_is_kept():
    tok = _word_tokenizer(["<pad>", "<mypad>", "</s>"], pad_token="<mypad>", eos_token="</s>")
    set_pad_token(tok)
    assert tok.pad_token == "<mypad>"


def test_load_tokenizer_sets_pad_for_a_model_without_one(saved, tmp_path):
    """A checkpoint whose tokenizer declares no pad token: load_tokenizer and load_model both give it one."""
    folder, _ = saved
    tokenizer = load_demo_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token != tok.eos_token
    model, tok2 = load_model(str(tmp_path), load_in_4bit=False, lora_r=4)
    assert tok2.pad_token_id == tok.pad_token_id == model.config.pad_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id


def test_a_mistyped_local_folder_is_named_with_the_one_meant(tmp_path, monkeypatch):
    """A typo of a local folder's name ("tiny-modle") reads as a Hub id; the error names the folder next to it."""
    (tmp_path / "tiny-model").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"no folder 'tiny-modle' here, but there is 'tiny-model'"):
        load_model("tiny-modle")
    with pytest.raises(ModelNotFoundError) as far:
        load_model("something-else-entirely")
    assert "did you mean" not in str(far.value) and "HF_HUB_OFFLINE" in str(far.value)
