"""FastSFT decides once, before anything changes, which speedups a run takes (``nbkit.speedups.fast_path``), and
what it hands the user stays SFTTrainer's.

- A model the speedups were not built for (conv/SSM hybrids) trains exactly as SFTTrainer: the same collator type
  and output, the same batches, the same losses (bitwise: the same code runs), no speedup attached, one line saying
  why (PEFT prompt learning: ``test_prompt_learning.py``).
- A family whose packed attention is not validated keeps TRL's collator and batches (no half-applied packing, no
  warning from packed attention at attach); the other speedups still apply (losses within 1e-5 relative, fp32).
- ``trainer.data_collator`` is TRL's; nbkit's packed batches come from FastSFT's own data loaders only, and user code
  that moves such a batch to a device or feeds it to the model works on it.
- Trainable weights never sit below the run's compute precision.

CPU, fp32, tiny models built from configs in code, the demo tokenizer.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from parity import Tol, assert_same_batches, assert_same_series, fast_sft, first_batch, tiny_lm, train
from trl import SFTTrainer

from nbkit.demo.tokenizer import load_demo_tokenizer
from nbkit.speedups.fast_path import decide, sequence_mixer

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


def _tiny(model_type: str, tok, **overrides):
    """A randomly initialised model of ``model_type`` from its config, shrunk, sized to the demo tokenizer (the
    same weights each call: its own seeded RNG)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**SIZES, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                                                 "eos_token_id": tok.eos_token_id, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)


def _both(tmp_path, make_model, **settings):
    """SFTTrainer, then FastSFT, on the same model weights, data and settings (each built, not yet trained)."""
    from nbkit import FastSFT

    return [fast_sft(tmp_path / cls.__name__, trainer_cls=cls, model=make_model(), **settings)
            for cls in (SFTTrainer, FastSFT)]


# ---------------------------------------------------------------------------------------------------------------
# models and adapters that keep TRL's own path


@pytest.mark.parametrize("packing", [False, True])
def test_a_conv_hybrid_trains_exactly_as_sfttrainer_with_one_line_saying_why(tok, tmp_path, caplog, packing):
    """packing=True: TRL's padding-free batches, the same as SFTTrainer's (whose short convolutions need the
    causal_conv1d kernel to keep packed documents apart: not trained here, on a CPU)."""
    make = lambda: _tiny("lfm2", tok, layer_types=["conv", "full_attention"])  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="nbkit.trainer"):
        plain, fast = _both(tmp_path, make, packing=packing, lora=None)
    lines = [r.getMessage() for r in caplog.records if r.name == "nbkit.trainer"]
    assert len(lines) == 1 and "conv" in lines[0] and "exactly as SFTTrainer" in lines[0], lines
    assert fast.nbkit_path.plain and fast.nbkit_collator is None
    assert_same_batches(plain, fast)
    if packing:
        return
    want, got = train(plain), train(fast)
    assert fast.nbkit_attached == []
    assert_same_series(got.losses, want.losses)  # bitwise: the same code path


@pytest.mark.parametrize("model_type,overrides", [
    ("lfm2", {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}),
    ("lfm2", {}),  # its default layer kinds name no conv layer: the conv settings and the modules still tell
    ("nemotron_h", {}),
    ("falcon_mamba", {}),
    ("mamba", {}),
    ("jamba", {}),
    ("bamba", {}),
    ("granitemoehybrid", {}),
    ("zamba", {}),
    ("qwen3_next", {}),
])
def test_sequence_mixers_other_than_attention_are_found_from_the_config(model_type, overrides):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **overrides)
    assert sequence_mixer(SimpleNamespace(config=config)) is not None


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "gpt_oss", "cohere2", "olmo3", "gpt_neox",
                                        "mixtral", "glm4_moe"])
def test_attention_only_families_are_not_taken_for_hybrids(model_type, tok):
    from transformers import AutoConfig

    assert sequence_mixer(SimpleNamespace(config=AutoConfig.for_model(model_type))) is None


def test_a_one_d_convolution_in_the_layers_marks_a_model_the_config_does_not_describe(tok):
    model = tiny_lm("llama", tokenizer=tok)
    assert sequence_mixer(model) is None
    model.model.layers[0].mixer = torch.nn.Conv1d(8, 8, 3, groups=8)  # e.g. a remote-code short convolution
    assert "convolution" in sequence_mixer(model)


# ---------------------------------------------------------------------------------------------------------------
# cached_packing decided with the model: TRL's collator kept where packed attention cannot run


@pytest.mark.parametrize("model_type", ["olmo3", "gpt_neox"])
def test_a_family_packed_attention_does_not_cover_keeps_trls_batches_without_warnings(tok, tmp_path, caplog,
                                                                                      model_type):
    make = lambda: _tiny(model_type, tok)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="nbkit"):
        plain, fast = _both(tmp_path, make, packing=False, lora=None)
        assert not fast.nbkit_path.plain and not fast.nbkit_path.packed
        assert "cached_packing" in fast.nbkit_path.off and fast.nbkit_collator is None
        assert_same_batches(plain, fast)
        want, got = train(plain), train(fast)
    assert "not validated" not in "".join(r.getMessage() for r in caplog.records
                                          if r.name.startswith("nbkit.speedups"))
    said = [r for r in caplog.records if r.name == "nbkit.trainer" and "cached_packing off" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO  # said once, and no warning a TRL user does not get
    assert not any(s.startswith("cached_packing") for s in fast.nbkit_attached)
    assert_same_series(got.losses, want.losses, Tol(rtol=1e-5, atol=1e-6))


def test_a_model_without_attention_dispatch_keeps_trls_collator(tok):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from nbkit import FastSFTConfig

    model = tiny_lm("qwen3", tokenizer=tok)
    model._can_set_attn_implementation = lambda: False
    args = FastSFTConfig(output_dir="unused", use_cpu=True, bf16=False, live_dashboard=False)
    path = decide(model, args, DataCollatorForLanguageModeling(pad_token_id=0))
    assert not path.packed and "AttentionInterface" in path.off["cached_packing"]
    assert "cached_packing off" in path.reason


def test_trls_own_liger_kernels_turn_nbkits_fused_kernels_off():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    model = tiny_lm("qwen3")
    args = SimpleNamespace(use_liger_kernel=True)
    path = decide(model, args, DataCollatorForLanguageModeling(pad_token_id=0))
    assert not path.allows("fused_kernels") and path.allows("fused_lora") and path.packed
    assert decide(model, SimpleNamespace(), DataCollatorForLanguageModeling(pad_token_id=0)).allows("fused_kernels")


def test_a_vision_collator_keeps_trls_path():
    path = decide(tiny_lm("qwen3"), SimpleNamespace(), collator=object())
    assert not path.packed and "language-modeling" in path.off["cached_packing"]


# ---------------------------------------------------------------------------------------------------------------
# what the user's code sees


@pytest.mark.parametrize("packing", [False, True])
def test_data_collator_is_sfttrainers_and_nbkits_batches_come_from_its_loaders(tok, tmp_path, packing):
    plain, fast = _both(tmp_path, lambda: tiny_lm("qwen3", tokenizer=tok), packing=packing, lora=None)
    assert fast.nbkit_path.packed
    examples = [plain.train_dataset[i] for i in range(4)]
    assert type(fast.data_collator) is type(plain.data_collator)
    ours, theirs = fast.data_collator(examples), plain.data_collator(examples)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value
    packed = first_batch(fast)
    assert packed["input_ids"].shape[0] == 1 and "nbkit_cu_seqlens_host" in packed
    assert type(fast.data_collator) is type(plain.data_collator)  # the loader's collator was a scoped swap
    fast.data_collator = plain.data_collator  # one the user sets later builds the batches
    assert "nbkit_cu_seqlens_host" not in first_batch(fast)


def test_user_code_moves_nbkits_batch_to_a_device_and_feeds_it_to_the_model(tok, tmp_path):
    from accelerate.utils import send_to_device

    fast = fast_sft(tmp_path, model=tiny_lm("qwen3", tokenizer=tok), lora=None)
    batch = first_batch(fast)
    moved = {k: v.to("cpu") for k, v in batch.items()}
    assert moved.keys() == batch.keys()
    assert send_to_device(batch, "cpu")["nbkit_cu_seqlens_host"] == batch["nbkit_cu_seqlens_host"]
    with torch.no_grad():
        loss = fast.model(**moved).loss
    assert torch.isfinite(loss)


def test_packed_metadata_travels_inside_the_batch_from_a_worker_process(tok, tmp_path):
    fast = fast_sft(tmp_path, model=tiny_lm("qwen3", tokenizer=tok), lora=None, dataloader_num_workers=1)
    batch = first_batch(fast)
    host = batch["nbkit_cu_seqlens_host"]
    assert host[-1] == batch["input_ids"].shape[1] and host.to("cpu") is host
    assert list(host) == batch["cu_seq_lens_q"].tolist()
    assert batch["max_length_q"].to("cpu") == int(batch["cu_seq_lens_q"].diff().max())


def test_metrics_that_read_logits_get_trls_eval_batches(tok, tmp_path):
    from nbkit import FastSFT
    from nbkit.demo.data import make_dataset

    data = make_dataset("messages", n=8, split="eval", seed=1)
    trainers = {}
    for name, metrics in (("packed", None), ("reads", lambda prediction: {})):
        built = fast_sft(tmp_path / name, model=tiny_lm("qwen3", tokenizer=tok), lora=None, packing=False)
        trainers[name] = FastSFT(model=built.model, args=built.args, processing_class=tok,
                                 train_dataset=make_dataset("messages", n=8), eval_dataset=data,
                                 compute_metrics=metrics)
    assert trainers["packed"].nbkit_path.packed_eval and not trainers["reads"].nbkit_path.packed_eval
    rows = trainers["packed"].args.per_device_eval_batch_size
    assert next(iter(trainers["packed"].get_eval_dataloader()))["input_ids"].shape[0] == 1
    assert next(iter(trainers["reads"].get_eval_dataloader()))["input_ids"].shape[0] == rows  # TRL's padded rows


def test_a_mamba_hybrid_trains_exactly_as_sfttrainer(tok, tmp_path):
    """Nemotron-H (Mamba-2 mixers beside attention, MoE and MLP layers), padded rows: TRL's path, bitwise."""
    make = lambda: _tiny("nemotron_h", tok, num_hidden_layers=2, layers_block_type=["linear_attention", "full_attention"],  # noqa: E731
                         mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16)
    plain, fast = _both(tmp_path, make, packing=False, lora=None, max_steps=2)
    assert fast.nbkit_path.plain and "linear_attention" in fast.nbkit_path.reason
    assert_same_batches(plain, fast)
    want, got = train(plain), train(fast)
    assert fast.nbkit_attached == [] and len(got.losses) == 2
    assert_same_series(got.losses, want.losses)
