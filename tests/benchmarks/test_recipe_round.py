"""``benchmarks/recipe_round.sh``'s plumbing, without a GPU: it refuses a short commit hash before it spends any GPU
time (the results files must name the full commit: ``tests/test_benchmark_results.py`` checks them), and
``MEMORY_LOG=1`` and ``FIRST_STEPS=1`` reach the nbkit processes' command lines."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def round_with(commit: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "NBKIT_GIT_COMMIT": commit, "MODES": "bf16", "PATHS": "fastsft",
           "TMPDIR": str(out.parent)}
    return subprocess.run(["bash", "benchmarks/recipe_round.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_short_commit_hash_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    done = round_with("594762f", out)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "full 40-digit hash" in done.stderr
    assert not out.exists()  # no summary, no results: nothing ran


def fake_tools(bin_dir: Path, calls: Path) -> None:
    """``python3`` and ``nvidia-smi`` that only record their arguments: the round's plumbing without a GPU."""
    bin_dir.mkdir()
    for name in ("python3", "nvidia-smi"):
        tool = bin_dir / name
        tool.write_text(f'#!/usr/bin/env bash\necho "{name} $* OUT=$OUT" >> "{calls}"\n')
        tool.chmod(0o755)


def e2e_calls(tmp_path: Path, memory_log: str, first_steps: str = "0") -> list[str]:
    calls, model = tmp_path / f"calls{memory_log}", tmp_path / "model"
    fake_tools(tmp_path / f"bin{memory_log}", calls)
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")  # the model is reused: nothing is saved
    env = {**os.environ, "OUT": str(tmp_path / f"out{memory_log}"), "PATH": f"{tmp_path / f'bin{memory_log}'}:"
           f"{os.environ['PATH']}", "MODES": "fp16@15", "PATHS": "sft,fastsft", "MODEL_DIR": str(model),
           "MEMORY_LOG": memory_log, "FIRST_STEPS": first_steps, "TMPDIR": str(tmp_path)}
    env.pop("NBKIT_GIT_COMMIT", None)
    done = subprocess.run(["bash", "benchmarks/recipe_round.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in calls.read_text().splitlines() if "-m benchmarks.e2e" in line]


def test_memory_log_reaches_every_nbkit_process_and_only_when_asked(tmp_path):
    logged, plain = e2e_calls(tmp_path, "1"), e2e_calls(tmp_path, "0")
    assert len(logged) == len(plain) == 2  # sft, then fastsft
    assert all("--memory-log" in line and "--fp16 --tokens 2048@15" in line for line in logged)
    assert not any("--memory-log" in line for line in plain)


def test_first_steps_adds_one_profiled_process_after_each_timed_one_with_its_results_apart(tmp_path):
    calls = e2e_calls(tmp_path, "0", first_steps="1")
    assert len(calls) == 4, calls  # sft, its profile, fastsft, its profile
    timed, profiled = calls[0::2], calls[1::2]
    assert not any("--first-steps-profile" in line for line in timed)
    assert all("--first-steps-profile" in line and line.split("--first-steps-profile")[0].endswith("--steps 5 ")
               for line in profiled)
    assert all("/json " in line.split("OUT=")[1] + " " for line in timed)
    assert all("/profiles " in line.split("OUT=")[1] + " " for line in profiled)
    assert [line.split("--paths ")[1].split()[0] for line in calls] == ["sft", "sft", "fastsft", "fastsft"]
