"""CPU smoke runs of the trainer-level benchmarks through their public entries (``--tiny``: a tiny fp32 model).

Each path trains on the same data from the same initial weights and LoRA, so at step 1 (before any update) plain
TRL and FastSFT compute the same loss: equal to 1e-4 relative in fp32 (their attention kernels differ). Each run
writes its results file under the exact command line.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import e2e, packing


def _check_written(path, benchmark: str, argv: list[str], rows: list[dict]) -> None:
    written = json.loads(path.read_text())
    assert written["benchmark"] == benchmark
    assert written["command"] == " ".join(["python", "-m", f"benchmarks.{benchmark}", *argv])
    assert [r["path"] for r in written["figures"]] == [r["path"] for r in rows]
    assert written["notes"] == "CPU smoke run (--tiny)"


def test_e2e_tiny_runs_plain_trl_and_fastsft_to_the_same_first_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--paths", "sft,fastsft", "--tokens", "256", "--steps", "2", "--warmup", "1",
            "--profile", "fastsft"]
    rows = e2e.main(argv)
    assert [r["path"] for r in rows] == ["sft", "fastsft"] and not [r for r in rows if r.get("error")], rows
    sft, fast = rows
    assert fast["loss_first"] == pytest.approx(sft["loss_first"], rel=1e-4)
    assert len(fast["losses"]) == len(sft["losses"]) == 3 and all(r["tokens"] == 256 for r in rows)
    assert "GPU kernel time per step" in fast["profile"] and "profile" not in sft  # the profiled path only
    _check_written(tmp_path / "e2e_tiny.json", "e2e", argv, rows)


def test_packing_tiny_runs_sdpa_and_nbkit_to_the_same_first_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--paths", "sdpa,nbkit", "--tokens", "512", "--steps", "2", "--warmup", "1"]
    rows = packing.main(argv)
    assert [r["path"] for r in rows] == ["sdpa", "nbkit"] and not [r for r in rows if r.get("error")], rows
    sdpa, nbkit = rows
    assert nbkit["loss_first"] == pytest.approx(sdpa["loss_first"], rel=1e-4)
    # packing alone: the ratio is that speedup's own
    assert [s.split("(")[0] for s in nbkit["speedups"]] == ["cached_packing"] and not sdpa["speedups"]
    _check_written(tmp_path / "packing.json", "packing", argv, rows)
