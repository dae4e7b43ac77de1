"""Wrapping a model with LoRA prints no warning that does not apply to it: PEFT's ``ensure_weight_tying`` is asked for
only where a tied embedding is trained (asked on every tied-embedding model, PEFT warned that nothing was tied), and
PEFT's warning that the rank/alpha pattern of a fused expert weight matched no module (its own MoE conversion's
key, which applies to that weight as a parameter target) is kept out of ``quiet_peft_wrap`` blocks, while a user's
own unmatched key still warns."""

from __future__ import annotations

import re
import warnings

import pytest

from nbkit.demo.models import build_base


def _messages(caught: list[warnings.WarningMessage], *words: str) -> list[str]:
    return [str(w.message) for w in caught if any(word in str(w.message) for word in words)]


@pytest.fixture(scope="module")
def tied_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3") / "base"
    build_base(folder, "gemma3", seed=0)  # Gemma ties its embedding and head, as SmolLM2 and Qwen3-1.7B do
    return folder


@pytest.mark.parametrize("modules_to_save", [None, ["embed_tokens", "lm_head"]])
def test_load_model_asks_peft_to_tie_only_where_a_tied_embedding_is_trained(tied_base, modules_to_save, one_thread):
    from nbkit import load_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_model(str(tied_base), load_in_4bit=False, lora_r=4, modules_to_save=modules_to_save)
    assert _messages(caught, "ensure_weight_tying", "tie_word_embeddings") == []
    assert model.peft_config["default"].ensure_weight_tying is bool(modules_to_save)
    if modules_to_save:  # trained in full, the two stay one matrix
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        assert head.weight.data_ptr() == embedding.weight.data_ptr()


def test_an_untied_model_is_not_asked_to_tie(tmp_path, one_thread):
    from nbkit import load_model

    build_base(tmp_path / "base", "qwen3", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_model(str(tmp_path / "base"), load_in_4bit=False, lora_r=4,
                              modules_to_save=["embed_tokens", "lm_head"])
    assert _messages(caught, "ensure_weight_tying", "tie_word_embeddings") == []
    assert model.peft_config["default"].ensure_weight_tying is False


def test_a_fused_expert_weight_gets_its_doubled_rank_without_peft_s_pattern_warning(tmp_path, one_thread):
    """qwen3_moe: PEFT fuses LoRA on gate/up into ``gate_up_proj`` at twice the rank (its rank_pattern); that applies,
    so PEFT's warning that the pattern matched no module is not shown. A key the user wrote that matches nothing
    still warns inside the block."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import ParamWrapper
    from transformers import AutoModelForCausalLM

    from nbkit import load_model
    from nbkit.compat import quiet_peft_wrap

    build_base(tmp_path / "moe", "qwen3_moe", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_model(str(tmp_path / "moe"), load_in_4bit=False, lora_r=4)
    assert _messages(caught, "rank_pattern", "alpha_pattern") == []
    fused = [m for name, m in model.named_modules() if isinstance(m, ParamWrapper)
             and m.parameter_name == "gate_up_proj"]
    assert fused and all(m.r["default"] == 8 and m.scaling["default"] == 1.0 for m in fused)

    lora = LoraConfig(r=4, target_modules=["q_proj"], rank_pattern={"no_such_module": 8}, task_type="CAUSAL_LM")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_peft_wrap():
            get_peft_model(AutoModelForCausalLM.from_pretrained(str(tmp_path / "moe")), lora)
    unmatched = _messages(caught, "rank_pattern")  # PEFT 0.22 says "any targeted module or parameter"
    assert len(unmatched) == 1 and re.fullmatch(
        r"The following rank_pattern keys did not match any targeted module( or parameter)? and were ignored: "
        r"\['no_such_module'\]\.", unmatched[0]), unmatched
