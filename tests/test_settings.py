"""The rules of the settings live in ``nbkit.settings``: allowed switch values, incompatible combinations, and the
defaults chosen from the hardware when the user chose none (mixed precision, pinned memory). CPU; the GPU side of
the precision choice is simulated here and checked for real in ``tests/gpu/test_settings_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
import warnings

import pytest
import torch

from nbkit import FastSFTConfig, settings
from nbkit.settings import POSITIVE_INT, SWITCH_VALUES, SettingError, combination_problem, mixed_precision, value_problem

no_accelerator = pytest.mark.skipif(torch.cuda.is_available() or (
    hasattr(torch, "accelerator") and torch.accelerator.is_available()), reason="checks the CPU-only defaults")


# ---------------------------------------------------------------------------------------------------------------
# values and combinations


_BAD = {"attention_kernel": "fast", "offload_checkpointing": "yes", "fused_kernels": 1, "live_dashboard": "on",
        "on_nonfinite_loss": "ignore", "tiled_mlp": 4096, "tiled_mlp_tokens": 0,
        "offload_max_host_bytes": -1, "selective_checkpointing": "yes", "cuda_graphs": "yes",
        "dequant_cache": "yes", "expandable_segments": "on", "cuda_graphs_checkpointed": "auto"}


@pytest.mark.parametrize("name", sorted(SWITCH_VALUES))
def test_every_switch_value_is_checked_by_the_one_rule(tmp_path, name):
    with pytest.raises(SettingError) as caught:
        FastSFTConfig(output_dir=str(tmp_path), bf16=False, **{name: _BAD[name]})
    assert str(caught.value) == value_problem(name, _BAD[name])
    assert str(caught.value).startswith(f"{name}={_BAD[name]!r}: ")
    assert isinstance(caught.value, ValueError)
    for good in SWITCH_VALUES[name]:
        good = 4096 if good == POSITIVE_INT else good  # the marker stands for any positive int
        assert getattr(FastSFTConfig(output_dir=str(tmp_path), bf16=False, **{name: good}), name) == good


def test_transformers_argument_parser_reads_every_switch():
    """TRL's scripts parse their config with transformers' HfArgumentParser (TrlParser): FastSFTConfig must parse."""
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(FastSFTConfig).parse_args_into_dataclasses(
        ["--output_dir", "x", "--report_to", "none", "--bf16", "False", "--offload_checkpointing", "False",
         "--fused_kernels", "True", "--tiled_mlp", "auto", "--tiled_mlp_tokens", "2048",
         "--attention_kernel", "sdpa", "--on_nonfinite_loss", "skip"])
    assert args.offload_checkpointing is False and args.fused_kernels is True and args.tiled_mlp == "auto"
    assert args.tiled_mlp_tokens == 2048 and args.attention_kernel == "sdpa" and args.on_nonfinite_loss == "skip"
    (default,) = HfArgumentParser(FastSFTConfig).parse_args_into_dataclasses(["--output_dir", "x", "--bf16", "False"])
    assert default.live_dashboard == "auto" and default.tiled_mlp_tokens is None


def test_attention_kernels_allowed_are_the_kernels_that_exist():
    from nbkit.ops.varlen_attention import KERNELS

    assert SWITCH_VALUES["attention_kernel"] == ("auto", *KERNELS)
    assert "'sdpa_loop'" in value_problem("attention_kernel", "fast")


def test_guards_raise_the_combination_rule_of_settings(tmp_path):
    from nbkit.demo.data import make_dataset
    from nbkit.reliability.guards import InputError, validate_training_inputs

    args = FastSFTConfig(output_dir=str(tmp_path), bf16=False, offload_checkpointing=True,
                         gradient_checkpointing=False)
    with pytest.raises(InputError) as caught:
        validate_training_inputs(args, make_dataset("text", n=4))
    assert str(caught.value) == combination_problem(args)
    assert combination_problem(FastSFTConfig(output_dir=str(tmp_path), bf16=False)) is None


# ---------------------------------------------------------------------------------------------------------------
# mixed precision


@no_accelerator
def test_the_readme_config_builds_on_a_cpu_in_fp32_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="nbkit.config"):
        args = FastSFTConfig(output_dir=str(tmp_path), packing=True, max_length=4096)  # TRL's default: bf16 fails
    assert (args.bf16, args.fp16) == (False, False)
    lines = [r.getMessage() for r in caplog.records if r.name == "nbkit.config"]
    assert len(lines) == 1 and "fp32 (no mixed precision)" in lines[0] and "bf16 and fp16 were not set" in lines[0]


def test_an_explicit_precision_choice_always_wins(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="nbkit.config"):
        args = FastSFTConfig(output_dir=str(tmp_path), bf16=True, use_cpu=True)  # bf16 autocast on a CPU: asked for
        assert (args.bf16, args.fp16) == (True, False)
        assert FastSFTConfig(output_dir=str(tmp_path), bf16=False).bf16 is False
    assert not [r for r in caplog.records if r.name == "nbkit.config"]
    t4 = ("fp16", "Tesla T4 has no fast bf16")
    assert mixed_precision(True, None, hardware=t4) == (True, False, None)
    assert mixed_precision(None, True, hardware=("bf16", "H200")) == (False, True, None)
    assert mixed_precision(False, False, hardware=t4) == (False, False, None)
    bf16, fp16, line = mixed_precision(None, False, hardware=t4)  # fp16 refused, bf16 open: not fast here
    assert (bf16, fp16) == (False, False) and "bf16 was not set" in line


@pytest.mark.parametrize("kind, expected", [("bf16", (True, False)), ("fp16", (False, True)), ("fp32", (False, False))])
def test_an_open_choice_follows_the_hardware_in_one_line(kind, expected):
    bf16, fp16, line = mixed_precision(None, None, hardware=(kind, "why"))
    assert (bf16, fp16) == expected
    assert line.startswith(f"nbkit: training in {kind}") and "why" in line and "\n" not in line


def test_the_hardware_reading_follows_the_gpus_compute_capability(monkeypatch):
    assert settings.hardware_precision(use_cpu=True)[0] == "fp32"
    if not torch.cuda.is_available():
        assert settings.hardware_precision()[0] == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla T4")
    monkeypatch.setattr(settings, "pick_compute_dtype", lambda device=None: torch.float16)  # sm75
    assert settings.hardware_precision() == ("fp16", "Tesla T4 has no fast bf16")
    monkeypatch.setattr(settings, "pick_compute_dtype", lambda device=None: torch.bfloat16)  # sm80+
    assert settings.hardware_precision()[0] == "bf16"
    assert settings.hardware_precision(use_cpu=True)[0] == "fp32"  # use_cpu: the GPU is not used


# ---------------------------------------------------------------------------------------------------------------
# pinned memory


@no_accelerator
def test_no_pin_memory_warning_on_a_cpu_unless_pinning_was_asked(tmp_path):
    from nbkit import FastSFT
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    assert FastSFTConfig(output_dir=str(tmp_path), bf16=False).dataloader_pin_memory is False
    assert FastSFTConfig(output_dir=str(tmp_path), bf16=False, dataloader_pin_memory=True).dataloader_pin_memory

    tokenizer = load_demo_tokenizer()
    args = FastSFTConfig(output_dir=str(tmp_path), bf16=False, report_to=[], max_length=64, live_dashboard=False,
                         dataloader_num_workers=0, per_device_train_batch_size=2)
    trainer = FastSFT(model=tiny_model("qwen3", len(tokenizer), pad_token_id=tokenizer.pad_token_id), args=args,
                      train_dataset=make_dataset("text", n=8), processing_class=tokenizer)
    for pin, warned in ((None, False), (True, True)):  # the control: pinning asked for, torch warns
        if pin is not None:
            trainer.args.dataloader_pin_memory = pin
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            next(iter(trainer.get_train_dataloader()))
        assert any("pin_memory" in str(w.message) for w in caught) == warned, [str(w.message) for w in caught]


# ---------------------------------------------------------------------------------------------------------------
# numbers (what a YAML file gives) and lengths


def _numeric_fields() -> dict[str, type]:
    """Every field of FastSFTConfig (TrainingArguments', SFTConfig's, nbkit's) typed int or float, alone or with
    None, read here from the dataclass types independently of nbkit.settings."""
    hints = typing.get_type_hints(FastSFTConfig)
    found = {}
    for f in dataclasses.fields(FastSFTConfig):
        members = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        members.discard(type(None))
        if members and members <= {int, float}:
            found[f.name] = float if float in members else int
    return found


NUMERIC = _numeric_fields()


def test_the_numeric_fields_include_the_ones_yaml_configs_set():
    for name in ("learning_rate", "num_train_epochs", "warmup_steps", "weight_decay", "max_grad_norm",
                 "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "max_length",
                 "logging_steps", "save_steps", "seed", "tiled_mlp_tokens", "offload_min_bytes"):
        assert name in NUMERIC, name


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_every_numeric_field_refuses_a_string_that_is_no_number_naming_field_value_and_type(tmp_path, name):
    with pytest.raises(SettingError) as caught:
        FastSFTConfig(output_dir=str(tmp_path), bf16=False, **{name: "fast"})
    message = str(caught.value)
    kind = NUMERIC[name].__name__
    assert message.startswith(f"{name}='fast' (a str) is not a number: pass {name}="), message
    assert f"an {kind}" in message if kind == "int" else f"a {kind}" in message


@pytest.mark.parametrize("name", sorted(n for n in NUMERIC if isinstance(getattr(FastSFTConfig, n, None), (int, float))))
def test_every_numeric_field_reads_its_default_written_as_a_string(tmp_path, name, caplog):
    default = getattr(FastSFTConfig, name)
    plain = getattr(FastSFTConfig(output_dir=str(tmp_path), bf16=False), name)
    with caplog.at_level(logging.WARNING, logger="nbkit.config"):
        given = getattr(FastSFTConfig(output_dir=str(tmp_path), bf16=False, **{name: str(default)}), name)
    assert given == plain
    if NUMERIC[name] is int:
        assert type(given) is int
    assert f"{name}={str(default)!r} (a str) read as " in caplog.text


def test_a_yaml_config_with_numbers_pyyaml_reads_as_strings_builds_with_one_warning(tmp_path, caplog):
    """PyYAML follows YAML 1.1: ``2e-4`` (no dot) is a string. TRL's own YAML path (TrlParser --config) converts it
    through argparse; a config built from ``yaml.safe_load`` directly gets the same numbers, said once."""
    yaml = pytest.importorskip("yaml")
    given = yaml.safe_load("learning_rate: 2e-4\nnum_train_epochs: '3'\nweight_decay: '0.01'\n"
                           "per_device_train_batch_size: '2'\nmax_grad_norm: 1.0\n")
    assert given["learning_rate"] == "2e-4"  # what PyYAML does
    with caplog.at_level(logging.WARNING, logger="nbkit.config"):
        args = FastSFTConfig(output_dir=str(tmp_path), bf16=False, **given)
    assert (args.learning_rate, args.num_train_epochs, args.weight_decay) == (2e-4, 3.0, 0.01)
    assert args.per_device_train_batch_size == 2 and type(args.per_device_train_batch_size) is int
    lines = [r.getMessage() for r in caplog.records if "read as" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "learning_rate='2e-4' (a str) read as 0.0002" in lines[0] and "2.0e-4" in lines[0]
    assert "per_device_train_batch_size='2' (a str) read as 2" in lines[0] and "max_grad_norm" not in lines[0]


@pytest.mark.parametrize("name,value,kind", [("per_device_train_batch_size", "2.5", "int"),
                                             ("per_device_train_batch_size", 2.5, "int"),
                                             ("gradient_accumulation_steps", True, "int"),
                                             ("learning_rate", [2e-4], "float"), ("learning_rate", "", "float")])
def test_a_value_that_is_no_number_of_the_fields_type_is_refused(tmp_path, name, value, kind):
    with pytest.raises(SettingError) as caught:
        FastSFTConfig(output_dir=str(tmp_path), bf16=False, **{name: value})
    message = str(caught.value)
    assert message.startswith(f"{name}={value!r} (a {type(value).__name__}) is not "), message
    assert f"pass {name}=" in message and (f"an {kind}" if kind == "int" else f"a {kind}") in message


def test_parsed_arguments_are_numbers_already_and_say_nothing(tmp_path, caplog):
    from transformers import HfArgumentParser

    with caplog.at_level(logging.WARNING, logger="nbkit.config"):
        (args,) = HfArgumentParser(FastSFTConfig).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--bf16", "False", "--learning_rate", "2e-4", "--max_length", "64"])
    assert args.learning_rate == 2e-4 and args.max_length == 64
    assert "read as" not in caplog.text


@pytest.mark.parametrize("value", [0, -1, -5])
def test_max_length_must_be_a_positive_number_of_tokens(tmp_path, value):
    with pytest.raises(SettingError) as caught:
        FastSFTConfig(output_dir=str(tmp_path), bf16=False, max_length=value)
    assert str(caught.value) == f"max_length={value!r}: use None or a positive int (a number of tokens)"
    assert FastSFTConfig(output_dir=str(tmp_path), bf16=False, max_length=None).max_length is None
    assert FastSFTConfig(output_dir=str(tmp_path), bf16=False, max_length=1).max_length == 1


def test_the_length_rule_is_the_one_the_size_switches_follow():
    for name in ("tiled_mlp_tokens", "offload_max_host_bytes"):
        assert value_problem(name, 0) == settings.length_problem(name, 0)
    assert settings.length_problem("max_seq_length", 8) is None
    assert settings.length_problem("max_seq_length", None) is None
    assert settings.length_problem("max_seq_length", None, optional=False) is not None
    assert "bytes" in settings.length_problem("offload_max_host_bytes", -1)


def _plain_trainer(tmp_path, **numbers):
    """FastSFT handed a plain TRL ``SFTConfig`` (which checks no types) with ``numbers`` as given."""
    from trl import SFTConfig

    from nbkit import FastSFT
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tokenizer = load_demo_tokenizer()
    args = SFTConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to=[], max_length=64, max_steps=1,
                     per_device_train_batch_size=2, save_strategy="no", **numbers)
    model = tiny_model("qwen3", len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    return FastSFT(model=model, args=args, train_dataset=make_dataset("text", n=8), processing_class=tokenizer)


def test_a_plain_sftconfig_with_a_numeric_string_trains_as_with_the_number(tmp_path, caplog, one_thread):
    """TRL's SFTConfig lets ``learning_rate="2e-4"`` through to torch's optimizer (a TypeError after data
    preparation); FastSFT reads it as FastSFTConfig does, said in one warning, and trains."""
    with caplog.at_level(logging.WARNING, logger="nbkit.config"):
        trainer = _plain_trainer(tmp_path, learning_rate="2e-4")
    assert trainer.args.learning_rate == 2e-4 and type(trainer.args.learning_rate) is float
    assert "learning_rate='2e-4' (a str) read as 0.0002" in caplog.text
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_plain_sftconfig_with_no_number_is_refused_before_data_preparation(tmp_path, monkeypatch):
    from trl import SFTTrainer

    def prepared(*args, **kwargs):
        raise AssertionError("the data was prepared before the setting was checked")

    monkeypatch.setattr(SFTTrainer, "__init__", prepared)
    with pytest.raises(SettingError, match=r"^learning_rate='fast' \(a str\) is not a number: pass learning_rate="):
        _plain_trainer(tmp_path, learning_rate="fast")
