"""nbkit's own calls raise no deprecation warnings on the newest transformers the requirements allow (5.2x renamed
gradient checkpointing to activation checkpointing; nbkit uses whichever name the installed version has)."""

from __future__ import annotations

import warnings

import pytest

from nbkit.demo.models import build_base


def _deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))
            and "checkpointing" in str(w.message)]


def test_fastsft_config_hands_the_checkpointing_switch_over_without_a_warning(tmp_path):
    from nbkit import FastSFTConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on = FastSFTConfig(output_dir=str(tmp_path), use_cpu=True)
        off = FastSFTConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=False)
    assert _deprecations(caught) == []
    assert on.gradient_checkpointing is True and off.gradient_checkpointing is False
    if hasattr(on, "activation_checkpointing"):
        assert on.activation_checkpointing is True and off.activation_checkpointing is False


def _callers_of_deprecated_names(monkeypatch) -> list[str]:
    """Record the module that calls each deprecated checkpointing entry point (PEFT and TRL still call some: those
    are theirs, not nbkit's)."""
    import inspect

    from transformers import PreTrainedModel

    callers: list[str] = []
    for name in ("gradient_checkpointing_enable", "gradient_checkpointing_disable"):
        original = getattr(PreTrainedModel, name, None)
        if original is None:
            continue

        def spy(self, *args, _original=original, _name=name, **kwargs):
            callers.append(f"{inspect.stack()[1].frame.f_globals.get('__name__')}:{_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(PreTrainedModel, name, spy)
    return callers


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_load_model_enables_checkpointing_under_the_installed_name(tmp_path, load_in_4bit, one_thread, monkeypatch):
    from transformers import PreTrainedModel

    from nbkit import load_model

    folder = tmp_path / "base"
    build_base(folder, "qwen3", seed=0)
    callers = _callers_of_deprecated_names(monkeypatch)
    model, _ = load_model(str(folder), load_in_4bit=load_in_4bit)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    if hasattr(PreTrainedModel, "activation_checkpointing_enable"):  # the new name exists: nbkit must not use the old
        assert [c for c in callers if c.startswith("nbkit")] == [], callers


def _deprecated_probe() -> bool:
    """Whether reading ``is_gradient_checkpointing`` warns here (transformers with the new name deprecates it)."""
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "is_activation_checkpointing")


def _peft_reads_the_old_name() -> bool:
    """Whether this PEFT reads ``is_gradient_checkpointing`` of the model it wraps (0.21 does; 0.22 has its own
    ``is_activation_checkpointing`` helper, which reads the new name where the model has it)."""
    import peft.utils

    return not hasattr(peft.utils, "is_activation_checkpointing")


def test_quiet_peft_wrap_hides_only_the_read_peft_makes_of_the_deprecated_name(tmp_path, one_thread):
    """PEFT 0.21 reads ``is_gradient_checkpointing`` of every model it wraps (the FutureWarning a notebook printed);
    inside ``quiet_peft_wrap`` that one warning is gone, whoever reads the name, any other warning passes, and the same
    read after the block warns."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from nbkit.compat import quiet_peft_wrap

    folder = tmp_path / "base"
    build_base(folder, "qwen3", seed=0)
    lora = LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(AutoModelForCausalLM.from_pretrained(str(folder)), lora)
    # what the block is for: PEFT 0.21 warns without it
    assert bool(_deprecations(caught)) == (_deprecated_probe() and _peft_reads_the_old_name())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_peft_wrap():
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(folder)), lora)
            assert model.get_base_model().is_gradient_checkpointing is False  # the read PEFT 0.21 makes
            warnings.warn("another FutureWarning", FutureWarning, stacklevel=1)
        inside = list(caught)
        assert model.get_base_model().is_gradient_checkpointing is False
    assert _deprecations(inside) == [] and [str(w.message) for w in inside] == ["another FutureWarning"]
    assert len(_deprecations(caught)) == int(_deprecated_probe())


def test_load_model_with_lora_raises_no_checkpointing_deprecation(tmp_path, one_thread):
    """``load_model`` wraps the model with PEFT, which reads the deprecated name: the warning every notebook run
    printed, in its first training cell."""
    from nbkit import load_model

    folder = tmp_path / "base"
    build_base(folder, "qwen3", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(str(folder), load_in_4bit=False)
    assert _deprecations(caught) == []


def test_save_merged_raises_no_checkpointing_deprecation(tmp_path, one_thread):
    """``save_merged`` puts the adapter on a 16-bit copy of the base with PEFT, which reads the deprecated name."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbkit.compat import quiet_peft_wrap
    from nbkit.export import save_merged

    folder = tmp_path / "base"
    build_base(folder, "qwen3", seed=0)
    with quiet_peft_wrap():
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(folder)),
                               LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_merged(model, AutoTokenizer.from_pretrained(str(folder)), tmp_path / "merged", check_prompts=[])
    assert _deprecations(caught) == []
