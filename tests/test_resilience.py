"""Out of memory at the step, non-finite losses, atomic directories, and the security promises (CPU).

- OOM: a decoder layer is monkeypatched to raise ``torch.OutOfMemoryError`` at step 2. FastSFT must raise
  ``TrainingOutOfMemoryError`` (still a ``torch.OutOfMemoryError``, still recognised by accelerate's
  ``auto_find_batch_size``) naming the step and the settings that would make it fit, having dropped the gradients
  and the failed step's tensors (a weak reference to a tensor made inside the failing layer must die), and the
  trainer must train again afterwards.
- Non-finite loss: one dataset row carries a token whose embedding is made NaN by a hook, so exactly the batch that
  holds it has a NaN loss. "stop" raises at that step with that row named, before any optimizer step, and the checkpoint
  of the step before holds the weights the model still has; "skip" leaves the weights and optimizer state of that
  step bit-identical (the whole accumulation window) and goes on.
- Masked batch: one chat's prompt is longer than ``max_length``, so packing cuts its answer away and the packed row
  holding it has no label to train on; training goes on (TRL's loss is 0 there) and a warning names that row.
- Atomic directories: publish, swap, merge, failure, and recovery after a kill between the two renames of a swap.
- Security: ``trust_remote_code`` is off unless asked (custom code in a model folder is not executed), weights load
  from safetensors without unpickling, ``colab_setup.sh`` prints no secret from the environment and runs no remote
  script.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from parity import assert_same_tensors, fast_sft, tiny_lm, trainable
from safetensors.torch import save_file

from nbkit import FastSFT, FastSFTConfig
from nbkit.reliability.checkpoints import (
    atomic_directory,
    checkpoint_problem,
    last_complete_checkpoint,
    publish_directory,
    recover_interrupted,
)
from nbkit.reliability.nonfinite import NonFiniteLossError
from nbkit.reliability.oom import TrainingOutOfMemoryError, fit_suggestions

ROOT = Path(__file__).resolve().parents[1]
POISONED = 30  # the dataset row whose marker token gets a NaN embedding


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _trainer(tokenizer, out, dataset=None, nan_token: int | None = None, **overrides) -> FastSFT:
    """FastSFT on the tiny qwen3 with LoRA r4, packed demo conversations, assistant-only loss."""
    model = tiny_lm("qwen3", tokenizer=tokenizer)
    if nan_token is not None:  # the marker token's embedding becomes NaN: only its document goes non-finite
        model.get_input_embeddings().register_forward_hook(
            lambda module, inputs, output: output.masked_fill((inputs[0] == nan_token)[..., None], float("nan")))
    config = dict(max_steps=4, learning_rate=3e-3, max_length=64, assistant_only_loss=True,
                  gradient_checkpointing=False)
    return fast_sft(out, model=model, tokenizer=tokenizer, dataset=dataset, rows=48, **(config | overrides))


def _trainable(trainer) -> dict[str, torch.Tensor]:
    return trainable(trainer.model)


# ---------------------------------------------------------------------------------------------------------------
# out of memory


def test_oom_at_the_step_is_explained_and_freed(tokenizer, tmp_path):
    from accelerate.utils.memory import should_reduce_batch_size

    trainer = _trainer(tokenizer, tmp_path, max_length=256, max_steps=3)
    mlp = trainer.model.get_base_model().model.layers[1].mlp
    calls, held = {"n": 0}, {}

    def failing_forward(x):
        calls["n"] += 1
        if calls["n"] == 2:  # step 2's forward
            activation = torch.ones(4096, 64)  # stands for what the failed step holds
            held["ref"] = weakref.ref(activation)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 1.02 GiB is free.")
        return type(mlp).forward(mlp, x)

    mlp.forward = failing_forward
    with pytest.raises(TrainingOutOfMemoryError) as caught:
        trainer.train()
    error = caught.value
    message = str(error)
    assert isinstance(error, torch.OutOfMemoryError) and should_reduce_batch_size(error)
    assert message.startswith("Step 2 ran out of memory.") and "forward/backward" in message
    assert "per_device_train_batch_size=1 with gradient_accumulation_steps=2" in message
    assert "max_length=128" in message and "gradient_checkpointing=True" in message
    assert "Memory now" in message and "Tried to allocate 20.00 GiB" in message
    assert trainer.state.global_step == 1
    assert all(p.grad is None for p in trainer.model.parameters())
    gc.collect()
    assert held["ref"]() is None, "the failed step's tensors are still referenced"
    del mlp.forward  # the memory is back: the same trainer trains again
    trainer.train()
    assert trainer.state.global_step == 3


def test_oom_outside_the_step_names_it(tokenizer, tmp_path, monkeypatch):
    trainer = _trainer(tokenizer, tmp_path, max_steps=1, optim="adamw_torch")

    def failing_step(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(torch.optim.AdamW, "step", failing_step)
    with pytest.raises(TrainingOutOfMemoryError, match="Step 1 ran out of memory. It failed in the optimizer step"):
        trainer.train()
    assert trainer.nbkit_attached and trainer.model.config._attn_implementation != "nbkit"  # detached all the same


class _Args:
    def __init__(self, **kw):
        defaults = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_length=4096, packing=True,
                        gradient_checkpointing=True, offload_checkpointing="auto")
        self.__dict__.update({**defaults, **kw})


class _Model(torch.nn.Module):
    def __init__(self, n: int, quantized: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16))
        self.is_loaded_in_4bit = quantized


def test_fit_suggestions_pick_what_would_help():
    from nbkit.memory import DeviceMemory

    tips = fit_suggestions(_Args(), _Model(10))
    assert tips[0].startswith("per_device_train_batch_size=4 with gradient_accumulation_steps=2")
    assert tips[1].startswith("max_length=2048") and "packed row" in tips[1]
    assert tips[2].startswith("offload_checkpointing=True")
    assert len(tips) == 3
    # batch 1, short rows, checkpointing off: checkpointing, then 4-bit
    tips = fit_suggestions(_Args(per_device_train_batch_size=1, max_length=64, gradient_checkpointing=False),
                           _Model(10))
    assert tips[0].startswith("gradient_checkpointing=True") and "load_in_4bit=True" in tips[1]
    # weights larger than half the device: 4-bit first; an already 4-bit model never gets that advice
    figures = DeviceMemory(index=0, name="GPU", allocated=0, reserved=0, peak=0, total=30)
    assert "load_in_4bit=True" in fit_suggestions(_Args(), _Model(10), figures)[0]
    assert not any("4bit" in t for t in fit_suggestions(_Args(per_device_train_batch_size=1), _Model(10, True)))


def test_fit_suggestions_name_dequant_cache_first_while_it_keeps_copies():
    """Copies kept by dequant_cache (its attribute on a module) are the first memory to give back; none, no tip."""
    from nbkit.speedups.dequant_cache import DEQUANTIZED

    model = _Model(10, quantized=True)
    assert not any("dequant_cache" in t for t in fit_suggestions(_Args(), model))
    vars(model)[DEQUANTIZED] = torch.empty(3 * 2**20, dtype=torch.bfloat16)  # 6 MiB
    tips = fit_suggestions(_Args(), model)
    assert tips[0] == "dequant_cache=False (gives back the 6 MiB of 4-bit weights it keeps dequantized)", tips
    assert len(tips) == 3


# ---------------------------------------------------------------------------------------------------------------
# non-finite loss


def _poisoned(tokenizer) -> tuple[Dataset, int]:
    from nbkit.demo.data import make_dataset

    rows = make_dataset("messages", n=48).to_list()
    marker = tokenizer.pad_token  # a special token no other row contains (packed batches have no padding)
    rows[POISONED]["messages"][0]["content"] += f" {marker}"
    return Dataset.from_list(rows), tokenizer.pad_token_id


def _batches_with(trainer, token: int) -> list[int]:
    return [i for i, batch in enumerate(trainer.get_train_dataloader()) if (batch["input_ids"] == token).any()]


def test_nonfinite_loss_stops_at_its_step_naming_the_row_and_keeps_the_last_checkpoint(tokenizer, tmp_path):
    from safetensors.torch import load_file

    dataset, marker = _poisoned(tokenizer)
    trainer = _trainer(tokenizer, tmp_path, dataset, nan_token=marker, max_steps=6, save_strategy="steps",
                       save_steps=1)
    [batch] = _batches_with(trainer, marker)
    step = batch + 1
    assert step >= 2  # there is a checkpoint before it
    with pytest.raises(NonFiniteLossError) as caught:
        trainer.train()
    event, message = caught.value.event, str(caught.value)
    assert event.step == step and trainer.state.global_step == step - 1
    assert [r for d in event.culprits for r in event.rows[d]] == [POISONED]
    assert POISONED in {r for rows in event.rows for r in rows} and len(event.spans) > 1
    assert f"loss is nan at step {step}" in message and f"non-finite on its own: train_dataset rows [{POISONED}]" \
        in message and f"checkpoint-{step - 1}" in message
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / f"checkpoint-{step - 1}")
    assert not (tmp_path / f"checkpoint-{step}").exists()
    saved = load_file(tmp_path / f"checkpoint-{step - 1}" / "adapter_model.safetensors")
    from peft import get_peft_model_state_dict

    live = get_peft_model_state_dict(trainer.model)
    assert saved.keys() == live.keys()
    assert all(torch.isfinite(t).all() for t in live.values())
    assert_same_tensors(live, saved, where="adapter held after the stop")  # bitwise: the last good step's weights


@pytest.mark.parametrize("accumulation", [1, 2])
def test_nonfinite_loss_skip_leaves_that_step_untouched(tokenizer, tmp_path, accumulation):
    from transformers import TrainerCallback

    dataset, marker = _poisoned(tokenizer)
    trainer = _trainer(tokenizer, tmp_path, dataset, nan_token=marker, on_nonfinite_loss="skip", max_steps=4,
                       gradient_accumulation_steps=accumulation)
    [batch] = _batches_with(trainer, marker)
    step, micro = batch // accumulation + 1, batch % accumulation + 1
    snapshots = {0: _trainable(trainer)}
    optimizer_steps = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            snapshots[state.global_step] = _trainable(trainer)
            optimizer_steps[state.global_step] = max(float(s["step"]) for s in trainer.optimizer.state.values())

    trainer.add_callback(Snapshot())
    trainer.train()
    assert trainer.state.global_step == 4
    [event] = trainer.nbkit_skipped
    assert (event.step, event.micro_batch, event.accumulation) == (step, micro, accumulation)
    assert [r for d in event.culprits for r in event.rows[d]] == [POISONED]
    for s in range(1, 5):
        same = all(torch.equal(snapshots[s][n], snapshots[s - 1][n]) for n in snapshots[s])
        assert same == (s == step), s
    assert optimizer_steps[4] == 3  # the skipped step left the optimizer state alone too
    assert all(torch.isfinite(t).all() for t in snapshots[4].values())


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_deferred_reads_train_as_the_immediate_check(tokenizer, tmp_path, monkeypatch, optim, accumulation):
    """One process, no scaler: the flags are read after the optimizer step (a fused optimizer is handed the window's
    flag as found_inf; another reads it before its step). Against the check that reads after every backward (and
    transformers' own loss filter): the same weights bit for bit, the same logged losses, the same skipped step."""
    dataset, marker = _poisoned(tokenizer)
    runs = {}
    for deferred in (True, False):
        if not deferred:
            monkeypatch.setattr(FastSFT, "_nbkit_defers_reads", lambda self: False)
        trainer = _trainer(tokenizer, tmp_path / str(deferred), dataset, nan_token=marker, on_nonfinite_loss="skip",
                           max_steps=4, optim=optim, gradient_accumulation_steps=accumulation, logging_steps=1)
        modes = []
        trainer.add_callback(_filter_seen(trainer, modes))
        trainer.train()
        assert modes and all(m == (not deferred) for m in modes)  # transformers' host filter only without deferral
        assert trainer.args.logging_nan_inf_filter  # handed back after train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[deferred] = (_trainable(trainer), losses, [(e.step, e.micro_batch) for e in trainer.nbkit_skipped])
    (weights, losses, skipped), (weights0, losses0, skipped0) = runs[True], runs[False]
    assert skipped == skipped0 and len(skipped) == 1
    assert losses == losses0 and all(map(math.isfinite, losses))
    assert_same_tensors(weights, weights0, where=f"deferred against immediate ({optim}, accumulation {accumulation})")


def _filter_seen(trainer, modes):
    """A callback recording, at each step's end, whether transformers' own (host) loss filter is on."""
    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            modes.append(bool(trainer.args.logging_nan_inf_filter))

    return Seen()


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_deferred_stop_between_saves_keeps_the_weights_of_the_step_before(tokenizer, tmp_path, optim):
    """No log or save at the bad step: the stop comes one micro-batch later, with that step's update not applied,
    the step counter back at the last applied step, and the weights those of that step."""
    from transformers import TrainerCallback

    dataset, marker = _poisoned(tokenizer)
    trainer = _trainer(tokenizer, tmp_path, dataset, nan_token=marker, max_steps=6, save_strategy="no",
                       logging_steps=100, optim=optim)
    [batch] = _batches_with(trainer, marker)
    step = batch + 1
    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots[state.global_step] = _trainable(trainer)

    trainer.add_callback(Snapshot())
    with pytest.raises(NonFiniteLossError) as caught:
        trainer.train()
    assert caught.value.event.step == step and trainer.state.global_step == step - 1
    assert f"the optimizer update of step {step} was not applied" in str(caught.value)
    assert_same_tensors(_trainable(trainer), snapshots[step - 1], where="weights held after a deferred stop")
    assert all(p.grad is None for p in trainer.model.parameters())


def test_filtered_loss_is_transformers_filter():
    from nbkit.reliability.deferred_check import filtered_loss

    running = torch.tensor(6.0)
    assert filtered_loss(torch.tensor(2.5), running, 2).item() == 2.5
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert filtered_loss(torch.tensor(bad), running, 2).item() == 6.0 / 3  # transformers: tr_loss / (1 + steps)


def test_a_batch_with_every_label_masked_is_named(tokenizer, tmp_path, caplog):
    from nbkit.demo.data import make_dataset

    rows = make_dataset("messages", n=6).to_list()
    cut = len(rows)
    rows.append({"messages": [{"role": "user", "content": "red fox " * 60}, {"role": "assistant", "content": "a"}]})
    trainer = _trainer(tokenizer, tmp_path, dataset=Dataset.from_list(rows), per_device_train_batch_size=1)
    trainer.args.max_steps = len(trainer.train_dataset)  # one epoch of packed rows: the cut one among them
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.trainer_mixin"):
        trainer.train()
    assert trainer.state.global_step == len(trainer.train_dataset)  # not stopped: the loss is finite (0)
    assert [event.rows for event in trainer.nbkit_masked] == [[[cut]]]
    step = trainer.nbkit_masked[0].step
    assert f"step {step} has no token to train on: every label of its 1 document(s) is masked (train_dataset rows " \
           f"[{cut}])" in caplog.text
    assert "max_length" in caplog.text and "bfd_split" in caplog.text
    logged = [h for h in trainer.state.log_history if h.get("step") == step and "loss" in h]
    assert logged and logged[0]["loss"] == 0.0


def test_nonfinite_switch_values():
    with pytest.raises(ValueError, match="on_nonfinite_loss"):
        FastSFTConfig(output_dir="x", bf16=False, use_cpu=True, on_nonfinite_loss="ignore")


# ---------------------------------------------------------------------------------------------------------------
# atomic directories


def test_atomic_directory_publishes_swaps_merges_and_cleans_up(tmp_path):
    target = tmp_path / "adapter"
    with atomic_directory(target) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".nbkit-staging-")
        (staging / "a.safetensors").write_text("1")
        assert not target.exists()  # nothing visible until the block ends
    assert (target / "a.safetensors").read_text() == "1"
    with atomic_directory(target) as staging:  # a folder of files: swapped whole
        (staging / "b.json").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["b.json"]
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as staging:
            (staging / "c.json").write_text("3")
            raise RuntimeError("killed")
    assert sorted(p.name for p in target.iterdir()) == ["b.json"]  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # staging removed
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "old.json").write_text("old")
    with atomic_directory(out) as staging:  # holds checkpoints: files replaced one by one, folders kept
        assert staging.parent == out
        (staging / "old.json").write_text("new")
        (staging / "adapter_model.safetensors").write_text("w")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_model.safetensors", "checkpoint-2", "old.json"]
    assert (out / "old.json").read_text() == "new"
    (tmp_path / ".nbkit-staging-dead0-adapter").mkdir()  # left by a save that was killed
    with atomic_directory(target) as staging:  # the next save to the same target tidies it
        (staging / "b.json").write_text("4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "out"]


def test_recover_after_a_kill_between_the_two_renames_of_a_swap(tmp_path, monkeypatch):
    target = tmp_path / "checkpoint-4"
    target.mkdir()
    (target / "trainer_state.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, target / "adapter_model.safetensors")
    staging = tmp_path / ".nbkit-staging-x-checkpoint-4"
    staging.mkdir()
    real_rename = os.rename

    def kill_on_second(src, dst):
        real_rename(src, dst)
        if Path(src) == target:  # the old folder moved aside; the new one never lands
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", kill_on_second)
    with pytest.raises(KeyboardInterrupt):
        publish_directory(staging, target)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not target.exists()
    done = recover_interrupted(tmp_path)
    assert any("restored checkpoint-4" in d for d in done) and any("removed unfinished" in d for d in done)
    assert checkpoint_problem(target) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


def test_checkpoint_problems_are_named(tmp_path):
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    assert "trainer_state.json" in checkpoint_problem(ckpt)
    (ckpt / "trainer_state.json").write_text("{trunc")
    assert "unreadable" in checkpoint_problem(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    assert "no model or adapter weights" in checkpoint_problem(ckpt)
    weights = ckpt / "adapter_model.safetensors"
    weights.write_bytes(b"")
    assert "empty" in checkpoint_problem(ckpt)
    save_file({"a": torch.arange(6.0), "b": torch.ones(2, 3)}, weights)
    assert checkpoint_problem(ckpt) is None
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-1])  # one byte short of the last tensor's data
    assert "adapter_model.safetensors is truncated" in checkpoint_problem(ckpt)
    weights.write_bytes(intact[:20])  # cut inside the header
    assert "adapter_model.safetensors is truncated" in checkpoint_problem(ckpt)
    weights.write_bytes(b"x")
    assert "adapter_model.safetensors is truncated" in checkpoint_problem(ckpt)
    weights.write_bytes(intact)
    torch.save({"state": {0: {"exp_avg": torch.zeros(3)}}}, ckpt / "optimizer.pt")
    assert checkpoint_problem(ckpt) is None
    saved = (ckpt / "optimizer.pt").read_bytes()
    (ckpt / "optimizer.pt").write_bytes(saved[:-1])  # the zip's central directory ends the file
    assert "optimizer.pt is truncated" in checkpoint_problem(ckpt)
    (ckpt / "optimizer.pt").write_bytes(saved)
    (ckpt / "rng_state.pth").write_bytes(saved[: len(saved) // 2])
    assert "rng_state.pth is truncated" in checkpoint_problem(ckpt)


# ---------------------------------------------------------------------------------------------------------------
# security


def test_trust_remote_code_is_off_unless_asked(tmp_path):
    from nbkit.loading import load_model, load_tokenizer

    assert inspect.signature(load_model).parameters["trust_remote_code"].default is False
    assert inspect.signature(load_tokenizer).parameters["trust_remote_code"].default is False
    assert FastSFTConfig(output_dir="x", bf16=False, use_cpu=True).trust_remote_code is False
    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "remote-code-ran"
    (folder / "config.json").write_text(json.dumps({
        "model_type": "nbkit_custom", "architectures": ["CustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                     "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"},
    }))
    (folder / "configuration_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises((OSError, ValueError)):
        load_model(str(folder), load_in_4bit=False, lora_r=None)
    assert not marker.exists(), "a model folder's own code ran without trust_remote_code=True"
    with pytest.raises(AttributeError):  # the control: asked for, the folder's code runs (and defines no class)
        load_model(str(folder), load_in_4bit=False, lora_r=None, trust_remote_code=True)
    assert marker.exists()


def test_weights_load_from_safetensors_without_unpickling(tmp_path, tokenizer, monkeypatch):
    import transformers

    from nbkit.demo.models import tiny_model
    from nbkit.loading import load_model

    folder = tmp_path / "base"
    tiny_model("qwen3", len(tokenizer), pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.bin"))
    seen: list[bool] = []
    for cls in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _original=original, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))

    def no_pickles(*args, **kwargs):
        raise AssertionError("torch.load (pickle) called while loading a model")

    monkeypatch.setattr(torch, "load", no_pickles)
    model, _ = load_model(str(folder), load_in_4bit=False, lora_r=4)
    assert seen and all(value is False for value in seen), seen
    assert any("lora" in n for n, _ in model.named_parameters())


SECRETS = {
    "HF_TOKEN": "hf_nbkitSecretToken000000000000000",
    "HUGGING_FACE_HUB_TOKEN": "hf_nbkitSecretToken111111111111111",
    "WANDB_API_KEY": "nbkitwandbsecret0123456789abcdef012345",
    "KAGGLE_KEY": "nbkitkagglesecret0123456789",
    "PIP_EXTRA_INDEX_URL": "https://user:nbkitPipSecret@example.invalid/simple",
}


def test_colab_setup_prints_no_secret_and_fetches_no_script(tmp_path):
    script = ROOT / "colab_setup.sh"
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'Tesla T4, 7.5'\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLAB_", "KAGGLE_", "PIP_"))}
    env.update(SECRETS, PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHON=sys.executable,
               COLAB_GPU="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([bash, str(script), "--dry-run", "--flash"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "platform: colab" in result.stdout  # it ran through to the report
    for secret in SECRETS.values():
        assert secret not in result.stdout and secret not in result.stderr
    assert "nbkitPipSecret" not in result.stdout + result.stderr
    text = script.read_text()
    for word in ("set -x", "xtrace", "printenv", "HF_TOKEN", "curl ", "wget ", "| bash", "| sh", "eval "):
        assert word not in text, word
