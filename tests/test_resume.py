"""Interrupted runs resume and end where an uninterrupted run ends; a kill during a save never leaves a broken
latest checkpoint; checkpoints and adapters are safetensors.

Scenarios (tiny Qwen3 + LoRA r=4, packed conversational demo data, 6 steps, a checkpoint every 2, CPU fp32):
- a child process SIGKILLed between steps 5 and 6 (after checkpoint-4) -> ``train(resume_from_checkpoint=True)``;
- a child process that SIGKILLs itself in the middle of writing checkpoint-4 (model weights written, optimizer not)
  -> no ``checkpoint-4`` appears, the latest is checkpoint-2, and resuming from it ends like the uninterrupted run;
- the same failure in-process with ``atomic_saves=False`` leaves the broken ``checkpoint-4`` that transformers'
  ``get_last_checkpoint`` would resume from: what the staging prevents (so the tests above can fail);
- a finished run resumed (its newest checkpoint is at ``max_steps``) trains no further step and keeps the final
  weights (transformers alone would run step ``max_steps + 1``);
- the newest checkpoint damaged after it was written (its weights or its ``optimizer.pt`` truncated, as a kill or a
  full disk under another writer, or a sync tool, leaves it): ``resume_from_checkpoint=True`` warns once, naming it
  and the file, and resumes from the older intact one; named explicitly, it fails before any step, naming the file
  and the intact older checkpoint; with every checkpoint damaged, the error lists them all;
- ``python -m nbkit demo`` interrupted (KeyboardInterrupt, as a notebook's stop button) then ``--resume``, with an
  ``HF_TOKEN`` in the environment that must appear in no output and no written file; ``--resume`` once more on the
  finished demo trains nothing.

Tolerance: losses and final adapter tensors equal to 1e-5 relative, 1e-7 absolute (same threads, same order of
operations: in practice bit-identical; the margin only covers a different BLAS path after a process restart).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from parity import Tol, assert_same_series, assert_same_tensors, fast_sft
from safetensors.torch import load_file

from nbkit import FastSFT
from nbkit.reliability.checkpoints import STAGING_PREFIX, checkpoint_problem, last_complete_checkpoint

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
MAX_STEPS, SAVE_STEPS = 6, 2
RTOL, ATOL = 1e-5, 1e-7
SAME = Tol(rtol=RTOL, atol=ATOL)


pytestmark = pytest.mark.usefixtures("one_thread")


def build(output_dir: str | os.PathLike, eval_dataset=None, **overrides) -> FastSFT:
    """The run every scenario repeats (also imported by the child processes)."""
    config = dict(
        max_steps=MAX_STEPS, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=1, save_strategy="steps",
        save_steps=SAVE_STEPS, max_length=64, assistant_only_loss=True, gradient_checkpointing=False,
    )
    return fast_sft(output_dir, eval_dataset=eval_dataset, **(config | overrides))


def record_steps(trainer: FastSFT) -> list[int]:
    """The ``global_step`` at the start of each training step ``trainer`` runs, filled in as it trains."""
    steps: list[int] = []
    original = trainer.training_step

    def counting(*args, **kwargs):
        steps.append(trainer.state.global_step)
        return original(*args, **kwargs)

    trainer.training_step = counting
    return steps


def losses(log_history: list[dict]) -> list[float]:
    return [h["loss"] for h in log_history if "loss" in h]


def final_adapter(trainer: FastSFT, folder: Path) -> dict[str, torch.Tensor]:
    trainer.save_model(str(folder))
    return load_file(folder / "adapter_model.safetensors")


def assert_same_run(trainer: FastSFT, reference: dict, folder: Path) -> None:
    got = losses(trainer.state.log_history)
    assert len(got) == MAX_STEPS, got
    assert_same_series(got, reference["losses"], SAME)
    assert_same_tensors(final_adapter(trainer, folder), reference["adapter"], SAME, where="final adapter")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run: its per-step losses and final adapter."""
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = build(out)
    trainer.train()
    return {"losses": losses(trainer.state.log_history), "adapter": final_adapter(trainer, out / "final"), "out": out}


CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    import transformers
    from transformers import TrainerCallback
    from test_resume import build

    mode, out, at = sys.argv[1], sys.argv[2], int(sys.argv[3])

    class Announce(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print(f"STEP {{state.global_step}}", flush=True)
            if mode == "between" and state.global_step == at:
                time.sleep(600)  # the parent SIGKILLs us here, between two steps

    if mode == "save":  # die in the middle of writing checkpoint-<at>: weights written, optimizer not yet
        original = transformers.Trainer._save_optimizer_and_scheduler

        def dying(self, output_dir):
            if self.state.global_step == at:
                print("DYING", sorted(os.listdir(output_dir)), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, output_dir)

        transformers.Trainer._save_optimizer_and_scheduler = dying

    trainer = build(out)
    trainer.add_callback(Announce())
    trainer.train()
    print("FINISHED", flush=True)
    """
)


def run_child(tmp_path: Path, mode: str, at: int) -> list[str]:
    """Train in a child process until it is SIGKILLed (by us in "between" mode, by itself in "save" mode)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(tmp_path / "child.err", "w") as err:
        proc = subprocess.Popen([sys.executable, str(script), mode, str(tmp_path / "out"), str(at)], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=tmp_path)
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line.strip())
                if mode == "between" and line.strip() == f"STEP {at}":
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == -signal.SIGKILL, (lines, (tmp_path / "child.err").read_text()[-3000:])
    assert "FINISHED" not in lines
    return lines


def test_killed_between_steps_resumes_to_the_same_adapter_and_losses(tmp_path, reference):
    lines = run_child(tmp_path, "between", at=5)
    assert lines[-1] == "STEP 5"
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2",
                                                                                           "checkpoint-4"]
    trainer = build(out)
    loads: list[dict] = []
    original_load = torch.load

    def recording_load(*args, **kwargs):
        loads.append(kwargs)
        return original_load(*args, **kwargs)

    torch.load = recording_load
    try:
        trainer.train(resume_from_checkpoint=True)
    finally:
        torch.load = original_load
    assert trainer.state.global_step == MAX_STEPS
    # resumed from checkpoint-4: its optimizer, scheduler and RNG states were read, never as arbitrary pickles
    assert loads and all(kw.get("weights_only") is True for kw in loads), loads
    assert_same_run(trainer, reference, tmp_path / "final")


def test_killed_during_a_save_leaves_the_previous_checkpoint_as_latest(tmp_path, reference):
    from transformers.trainer_utils import get_last_checkpoint

    lines = run_child(tmp_path, "save", at=4)
    assert lines[-1].startswith("DYING") and "adapter_model.safetensors" in lines[-1]  # died mid-save, for real
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert "checkpoint-2" in names and "checkpoint-4" not in names, names
    assert any(n.startswith(STAGING_PREFIX) for n in names), names  # the unfinished save, hidden
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")  # plain transformers agrees
    assert checkpoint_problem(out / "checkpoint-2") is None
    # a broken checkpoint left by some other writer is passed over as well
    foreign = out / "checkpoint-3"
    foreign.mkdir()
    (foreign / "adapter_model.safetensors").write_bytes(b"")

    trainer = build(out)
    trainer.train(resume_from_checkpoint=True)
    assert not any(p.name.startswith(STAGING_PREFIX) for p in out.iterdir())  # tidied at train start
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2", "checkpoint-3", "checkpoint-4", "checkpoint-6"]
    for step in (2, 4, 6):
        assert checkpoint_problem(out / f"checkpoint-{step}") is None
        files = {p.name for p in (out / f"checkpoint-{step}").iterdir()}
        assert "adapter_model.safetensors" in files  # weights as safetensors, and no pickled weights
        assert not {"adapter_model.bin", "pytorch_model.bin", "model.safetensors"} & files
    assert_same_run(trainer, reference, tmp_path / "final")


def test_resuming_a_finished_run_trains_no_further_step(tmp_path, reference):
    out = tmp_path / "out"
    shutil.copytree(reference["out"], out, ignore=shutil.ignore_patterns("final"))
    assert last_complete_checkpoint(out) == str(out / f"checkpoint-{MAX_STEPS}")
    trainer = build(out)
    steps = record_steps(trainer)
    trainer.train(resume_from_checkpoint=True)
    assert steps == [] and trainer.state.global_step == MAX_STEPS
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        f"checkpoint-{s}" for s in range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS)]
    assert_same_run(trainer, reference, tmp_path / "final")  # the weights of the finished run, loaded


def truncate(path: Path) -> None:
    """Keep the first half of ``path``: what a kill or a full disk leaves of a file being written in place."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def finished_run_copy(reference: dict, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(reference["out"], out, ignore=shutil.ignore_patterns("final"))
    return out


DAMAGED_FILES = ["adapter_model.safetensors", "optimizer.pt"]


@pytest.mark.parametrize("damaged", DAMAGED_FILES)
def test_resume_true_passes_over_a_newest_checkpoint_with_a_truncated_file(tmp_path, reference, caplog, damaged):
    out = finished_run_copy(reference, tmp_path)
    newest, older = out / f"checkpoint-{MAX_STEPS}", out / f"checkpoint-{MAX_STEPS - SAVE_STEPS}"
    truncate(newest / damaged)
    trainer = build(out)
    steps = record_steps(trainer)
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.trainer_mixin"):
        trainer.train(resume_from_checkpoint=True)
    named = [r.getMessage() for r in caplog.records if str(newest) in r.getMessage()]
    assert len(named) == 1, named
    assert damaged in named[0] and "truncated" in named[0], named[0]
    assert steps == list(range(MAX_STEPS - SAVE_STEPS, MAX_STEPS)), steps  # went on from checkpoint-4
    assert checkpoint_problem(older) is None and checkpoint_problem(newest) is None  # checkpoint-6 written anew
    assert_same_run(trainer, reference, tmp_path / "final")  # = resuming from checkpoint-4 by name


@pytest.mark.parametrize("damaged", DAMAGED_FILES)
def test_an_explicitly_named_damaged_checkpoint_fails_before_any_step_naming_the_file(tmp_path, reference, damaged):
    out = finished_run_copy(reference, tmp_path)
    newest = out / f"checkpoint-{MAX_STEPS}"
    truncate(newest / damaged)
    trainer = build(out)
    steps = record_steps(trainer)
    with pytest.raises(ValueError) as info:
        trainer.train(resume_from_checkpoint=str(newest))
    message = str(info.value)
    assert str(newest) in message and damaged in message and "truncated" in message, message
    assert str(out / f"checkpoint-{MAX_STEPS - SAVE_STEPS}") in message, message  # the intact one to use instead
    assert steps == []


def test_resume_true_with_every_checkpoint_damaged_lists_them_in_its_error(tmp_path, reference):
    out = finished_run_copy(reference, tmp_path)
    names = [f"checkpoint-{s}" for s in range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS)]
    for name in names:
        truncate(out / name / "adapter_model.safetensors")
    trainer = build(out)
    with pytest.raises(ValueError, match="no complete checkpoint") as info:
        trainer.train(resume_from_checkpoint=True)
    for name in names:
        assert str(out / name) in str(info.value), info.value
    assert "adapter_model.safetensors" in str(info.value)


class _SaveFailed(RuntimeError):
    pass


@pytest.mark.parametrize("atomic", [True, False])
def test_a_failed_save_never_becomes_the_latest_checkpoint(tmp_path, monkeypatch, atomic):
    """The in-process version of the kill above, with and without staging: the control shows the failure mode."""
    import transformers
    from transformers.trainer_utils import get_last_checkpoint

    original = transformers.Trainer._save_optimizer_and_scheduler

    def failing(self, output_dir):
        if self.state.global_step == 4:
            raise _SaveFailed("disk full")
        return original(self, output_dir)

    monkeypatch.setattr(transformers.Trainer, "_save_optimizer_and_scheduler", failing)
    out = tmp_path / "out"
    trainer = build(out, max_steps=4, atomic_saves=atomic)
    with pytest.raises(_SaveFailed):
        trainer.train()
    latest = get_last_checkpoint(str(out))
    if atomic:
        assert latest == str(out / "checkpoint-2") and not (out / "checkpoint-4").exists()
        assert not any(p.name.startswith(STAGING_PREFIX) for p in out.iterdir())
    else:  # transformers' own saving: the half-written checkpoint-4 is what resume_from_checkpoint=True would load
        assert latest == str(out / "checkpoint-4")
        assert checkpoint_problem(out / "checkpoint-4") is not None
        assert last_complete_checkpoint(out) == str(out / "checkpoint-2")  # nbkit's choice still avoids it


def test_save_model_into_output_dir_keeps_checkpoints_and_writes_safetensors(tmp_path):
    out = tmp_path / "out"
    trainer = build(out, max_steps=2)
    trainer.train()
    trainer.save_model()  # into output_dir, beside checkpoint-2: files are replaced one by one, folders kept
    names = {p.name for p in out.iterdir()}
    assert {"checkpoint-2", "adapter_model.safetensors", "adapter_config.json"} <= names
    assert not any(n.startswith(".nbkit-") for n in names)
    assert not any(n.endswith((".bin", ".pt", ".pth")) and n != "training_args.bin" for n in names)
    trainer.save_model(str(tmp_path / "adapter"))
    trainer.save_model(str(tmp_path / "adapter"))  # overwrite: swapped whole
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    assert not any(p.name.startswith(".nbkit-") for p in tmp_path.iterdir())


def test_best_checkpoint_tracking_points_at_the_published_folders(tmp_path):
    """Staging must not leak into transformers' best-model bookkeeping (``load_best_model_at_end``)."""
    from nbkit.demo.data import make_dataset

    out = tmp_path / "out"
    trainer = build(out, eval_dataset=make_dataset("messages", n=8, split="eval"), max_steps=4,
                    eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                    metric_for_best_model="eval_loss", save_total_limit=1)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and Path(best).parent == out and Path(best).is_dir(), best
    for state in out.glob("checkpoint-*/trainer_state.json"):
        recorded = json.loads(state.read_text())["best_model_checkpoint"]
        assert recorded is None or Path(recorded).parent == out, recorded
    assert not any(p.name.startswith(".nbkit-") for p in out.iterdir())


def test_resume_true_without_a_complete_checkpoint_is_a_clear_error(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)  # a save that never finished
    trainer = build(out, max_steps=1)
    with pytest.raises(ValueError, match="no complete checkpoint.*checkpoint-2"):
        trainer.train(resume_from_checkpoint=True)


SECRET = "hf_nbkitTestSecret0123456789abcdef"


def test_demo_resume_matches_uninterrupted_and_shows_no_secret(tmp_path, monkeypatch, capfd):
    """``python -m nbkit demo`` stopped mid-run (KeyboardInterrupt, the notebook's stop button) and rerun with
    ``--resume`` ends like an uninterrupted demo; an HF_TOKEN in the environment is never printed or written."""
    from nbkit.demo import run as demo
    from nbkit.trainer import FastSFT as Trainer

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", SECRET)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def argv(out: Path, *extra: str) -> list[str]:
        return ["--max-steps", "6", "--save-steps", "2", "--no-4bit", "--lora-r", "4", "--batch-size", "1",
                "--max-length", "64", "--eval-examples", "2", "--output-dir", str(out), "--json",
                str(out / "metrics.json"), *extra]

    full = demo.main(argv(tmp_path / "full"))

    original = Trainer.training_step

    def interrupted(self, *args, **kwargs):
        if self.state.global_step == 3:  # in step 4, after checkpoint-2
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.main(argv(tmp_path / "cut"))
    monkeypatch.setattr(Trainer, "training_step", original)
    resumed = demo.main(argv(tmp_path / "cut", "--resume"))

    assert resumed["resumed_from"] == str(tmp_path / "cut" / "trainer" / "checkpoint-2")
    assert resumed["steps"] == full["steps"] == 6
    assert_same_series(resumed["losses"], full["losses"], SAME)
    a = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "cut" / "adapter" / "adapter_model.safetensors")
    assert_same_tensors(b, a, SAME, where="final adapter")
    assert json.loads((tmp_path / "cut" / "metrics.json").read_text())["losses"] == resumed["losses"]
    again = demo.main(argv(tmp_path / "cut", "--resume"))  # the run is finished: nothing left to train
    assert again["resumed_from"] == str(tmp_path / "cut" / "trainer" / "checkpoint-6") and again["steps"] == 6
    assert not (tmp_path / "cut" / "trainer" / "checkpoint-7").exists()
    assert_same_series(again["losses"], full["losses"], SAME)

    out, err = capfd.readouterr()
    assert "resuming from" in out
    assert SECRET not in out and SECRET not in err
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
