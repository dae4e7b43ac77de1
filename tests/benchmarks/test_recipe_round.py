"""``benchmarks/recipe_round.sh`` refuses a short commit hash before it spends any GPU time: the results files it
writes must name the full commit (``tests/test_benchmark_results.py`` checks them)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def round_with(commit: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "NBKIT_GIT_COMMIT": commit, "MODES": "bf16", "PATHS": "fastsft"}
    return subprocess.run(["bash", "benchmarks/recipe_round.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_short_commit_hash_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    done = round_with("594762f", out)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "full 40-digit hash" in done.stderr
    assert not out.exists()  # no summary, no results: nothing ran
