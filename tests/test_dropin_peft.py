"""The drop-in contract, PEFT side: LoRA, DoRA, prompt tuning, P-tuning and prefix tuning, passed as ``peft_config=``
or as a model already wrapped by ``get_peft_model``, and LoRA over a 4-bit (bitsandbytes NF4) base, behave under
FastSFT as under SFTTrainer.

What TRL's tests check of a PEFT run, each trainer is held to: it trains, the adapter's parameters change, the base
model's stay (``dropin.assert_trains``), and FastSFT's per-step losses equal SFTTrainer's within ``dropin.LOSS_TOL``
(1e-5 relative, fp32 on a CPU). Prompt learning runs with gradient checkpointing off, as TRL's tests run it (PEFT's
P-tuning does not support it).

The 4-bit base: bitsandbytes quantizes NF4 on a CPU (tests/test_loading.py trains such a model), so it runs here;
without bitsandbytes the test skips. TRL casts the adapter of a quantized model to bf16 (its QLoRA recipe); where
FastSFT keeps it in the compute dtype instead (trainable weights never below it), the step losses part by bf16's
rounding of the adapter, hence that test's tolerance, ``QLORA_TOL`` (2e-2 relative, the 4-bit bound of the GPU
parity matrix), and the README's table of differences must name the difference.
"""

from __future__ import annotations

import pytest
import torch
from dropin import (
    LOSS_TOL,
    assert_documented,
    assert_same_outcome,
    assert_trains,
    both,
    save_tiny,
    tiny,
)
from parity import Tol

QLORA_TOL = Tol(rtol=2e-2, atol=1e-4)


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", **kw)


def _prompt_learning(kind: str, hidden: int = 128):
    from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, TaskType

    if kind == "prompt_tuning":
        return PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    if kind == "p_tuning":
        return PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4, encoder_hidden_size=hidden)
    return PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)


def _wrapped(peft_config):
    """A model already wrapped by ``get_peft_model`` (the adapter drawn from a fixed seed)."""
    from peft import get_peft_model

    def build(tok):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return get_peft_model(tiny("qwen3", tok), peft_config())
    return build


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_lora_and_dora_from_peft_config_train_alike(one_thread, tmp_path, variant, packing):
    config = (lambda: _lora(use_dora=True)) if variant == "dora" else _lora
    plain, fast = both(tmp_path, extra=lambda tok: {"peft_config": config()}, packing=packing)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_lora_on_an_already_wrapped_peft_model_trains_alike(one_thread, tmp_path):
    plain, fast = both(tmp_path, model=_wrapped(_lora))
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_lora_with_modules_to_save_trains_alike(one_thread, tmp_path):
    """The demo's recipe for a random base: embeddings and head trained in full beside LoRA."""
    plain, fast = both(tmp_path, extra=lambda tok: {"peft_config": _lora(modules_to_save=["embed_tokens", "lm_head"])},
                       packing=True)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning", "prefix_tuning"])
def test_prompt_learning_from_peft_config_trains_alike(one_thread, tmp_path, kind):
    plain, fast = both(tmp_path, extra=lambda tok: {"peft_config": _prompt_learning(kind)},
                       gradient_checkpointing=False)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning"])
def test_prompt_learning_on_an_already_wrapped_peft_model_trains_alike(one_thread, tmp_path, kind):
    plain, fast = both(tmp_path, model=_wrapped(lambda: _prompt_learning(kind)), gradient_checkpointing=False)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_p_tuning_with_default_settings_trains_alike(one_thread, tmp_path):
    """TRL's own P-tuning test keeps SFTConfig's gradient checkpointing (on by default) and packs nothing."""
    from peft import PromptEncoderConfig, TaskType

    plain, fast = both(tmp_path, extra=lambda tok: {
        "peft_config": PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8)})
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_peft_config_with_a_peft_model_fails_alike(tmp_path):
    plain, fast = both(tmp_path, model=_wrapped(_lora), extra=lambda tok: {"peft_config": _lora()}, train=False)
    assert_same_outcome(plain, fast, names=("PeftModel", "peft_config"))


def test_lora_on_the_lm_head_fails_alike(tmp_path):
    plain, fast = both(tmp_path, extra=lambda tok: {"peft_config": _lora().__class__(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])}, train=False)
    assert_same_outcome(plain, fast, names=("lm_head",))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen3"))


def test_lora_on_a_4bit_base_trains_alike(one_thread, tmp_path, tiny_folder):
    """A bitsandbytes NF4 base (double quant, fp32 compute) with ``peft_config=LoraConfig``, as TRL's own QLoRA
    test builds it; the base stays, the adapter trains, the losses agree within ``QLORA_TOL``."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def model(tok):
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(tiny_folder, quantization_config=quant, dtype=torch.float32)

    plain, fast = both(tmp_path, model=model, extra=lambda tok: {"peft_config": _lora()}, learning_rate=1e-2)
    assert_trains(plain)
    assert_same_outcome(plain, fast, tol=QLORA_TOL)
    dtypes = [{p.dtype for p in o.trainer.model.parameters() if p.requires_grad} for o in (plain, fast)]
    if dtypes[0] != dtypes[1]:
        assert_documented("adapter", "trainable", why=f"the adapter's dtype on a 4-bit base ({dtypes[1]} against TRL's "
                                                        f"{dtypes[0]})")
    else:  # the same recipe: the fp32 tolerance holds
        assert_same_outcome(plain, fast, tol=LOSS_TOL)


def test_4bit_adapter_trains_in_the_compute_dtype_or_says_so(one_thread, tmp_path, tiny_folder):
    """FastSFT's own rule (issue: "trainable weights never sit in a lower precision than the compute dtype"): in an
    fp32 run on a 4-bit base the adapter is fp32 after construction and after training, where TRL casts it to
    bf16; that difference is a row of the README's table."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    plain, fast = both(tmp_path, model=lambda tok: AutoModelForCausalLM.from_pretrained(
        tiny_folder, quantization_config=quant, dtype=torch.float32), extra=lambda tok: {"peft_config": _lora()},
        max_steps=1)
    assert plain.error is None and fast.error is None, (plain.why(), fast.why())
    low = sorted(n for n, p in fast.trainer.model.named_parameters() if p.requires_grad and p.dtype != torch.float32)
    assert not low, f"FastSFT trains {len(low)} weights below the fp32 compute dtype, e.g. {low[:2]}"
    if any(p.dtype != torch.float32 for p in plain.trainer.model.parameters() if p.requires_grad):
        assert_documented("adapter", "trainable", why="the adapter's dtype on a 4-bit base (TRL casts it to bf16)")


def test_lora_on_a_4bit_base_given_by_name_trains_alike(one_thread, tmp_path, tiny_folder):
    """The model named by its folder, ``model_init_kwargs`` carrying the quantization (TRL loads it)."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    plain, fast = both(tmp_path, model=lambda tok: str(tiny_folder), extra=lambda tok: {"peft_config": _lora()},
                       model_init_kwargs={"quantization_config": quant, "dtype": torch.float32}, learning_rate=1e-2)
    assert_trains(plain)
    assert_same_outcome(plain, fast, tol=QLORA_TOL)

