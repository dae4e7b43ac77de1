"""Unsloth's notebook recipe: its data and row (``benchmarks.unsloth_recipe``) and the side-by-side table of the
three trainers (``benchmarks.recipe_table``), on results files written by hand."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import recipe_table, unsloth_recipe


def _row(path: str, train_s: float, compute: str = "bf16", cap: float | None = None) -> dict:
    return {"path": path, "recipe": "unsloth", "shape": "1.7b", "compute": compute, "cap_gib": cap,
            "train_s": train_s, "step_ms": 1234.5, "step_ms_min": 1200.0, "step_ms_max": 1300.0,
            "first_steps_ms": [9000.0, 1500.0, 1250.0, 1240.0], "peak_gib": 6.25, "loss_first": 12.1,
            "loss_last": 11.9}


def _write(folder, name: str, benchmark: str, rows: list[dict]) -> None:
    payload = {"benchmark": benchmark, "date": "2026-12-06", "command": f"python -m benchmarks.{benchmark}",
               "git_commit": "unknown", "environment": {}, "figures": rows, "notes": ""}
    (folder / f"{name}.json").write_text(json.dumps(payload))


def _line(text: str, mode: str, path: str) -> str:
    found = [ln for ln in text.splitlines() if ln.startswith(f"| {mode} | {path} |")]
    assert len(found) == 1, text
    return found[0]


def test_each_trainer_is_set_against_unsloths_whole_run_in_its_own_mode(tmp_path):
    _write(tmp_path, "unsloth_e2e_recipe-unsloth_1.7b_bf16_uncapped", "unsloth_e2e", [_row("unsloth", 100.0)])
    _write(tmp_path, "e2e_recipe-unsloth_1.7b_bf16_uncapped_fastsft", "e2e", [_row("fastsft", 80.0)])
    _write(tmp_path, "e2e_recipe-unsloth_1.7b_fp16_cap15_sft", "e2e", [_row("sft", 150.0, "fp16", 15.0)])
    _write(tmp_path, "e2e_1.7b", "e2e", [dict(_row("sft", 1.0), recipe="packed")])  # another recipe: left out
    rows = recipe_table.load_rows([tmp_path])
    assert sorted(r["path"] for r in rows) == ["fastsft", "sft", "unsloth"]
    unsloth, fast = (next(r for r in rows if r["path"] == p) for p in ("unsloth", "fastsft"))
    assert recipe_table.speed_vs(fast, unsloth) == pytest.approx(1.25)  # Unsloth's 100 s over FastSFT's 80 s

    text = recipe_table.main([str(tmp_path)])
    assert "| 1.25x |" in _line(text, "1.7b bf16", "fastsft")
    assert "| 1.00x |" in _line(text, "1.7b bf16", "unsloth")
    assert "| 80.0 |" in _line(text, "1.7b bf16", "fastsft")
    assert "9,000; 1,500; 1,250; 1,240" in _line(text, "1.7b bf16", "fastsft")
    assert "| - |" in _line(text, "1.7b fp16@15", "sft")  # no Unsloth row in that mode: no ratio
    lines = text.splitlines()
    # the uncapped mode first, and in a mode the trainers in ORDER (sft, fastsft, unsloth)
    assert lines.index(_line(text, "1.7b bf16", "fastsft")) < lines.index(_line(text, "1.7b bf16", "unsloth")) \
        < lines.index(_line(text, "1.7b fp16@15", "sft"))


def test_a_failed_row_is_named_and_gives_no_ratio():
    failed = {"path": "sft", "recipe": "unsloth", "shape": "14b", "compute": "fp16", "cap_gib": 15.0,
              "error": "OutOfMemoryError: CUDA out of memory"}
    unsloth = _row("unsloth", 100.0, "fp16", 15.0) | {"shape": "14b"}
    assert recipe_table.speed_vs(failed, unsloth) is None
    assert "failed: OutOfMemoryError" in _line(recipe_table.table([failed, unsloth]), "14b fp16@15", "sft")


def test_recipe_row_times_every_step_as_the_user_waits():
    """Step wall times are the gaps between step ends; the median leaves the warm-up steps out."""
    times = SimpleNamespace(step_end_s=[5.0, 6.0, 7.5, 8.5, 9.5, 10.7], step_ms=[4900.0, 990, 1490, 990, 990, 1190],
                            losses=[12.0, 11.9, 11.8, 11.8, 11.7, 11.6], first_step_s=5.0, tokens=[1] * 6)
    row = unsloth_recipe.recipe_row("fastsft", times, train_s=11.0, setup_s=2.0, peak_bytes=3 * 2**30, warmup=4)
    assert row["step_wall_ms_all"] == pytest.approx([5000, 1000, 1500, 1000, 1000, 1200])
    assert row["first_steps_ms"] == pytest.approx([5000, 1000, 1500, 1000])
    assert (row["step_ms"], row["step_ms_min"], row["step_ms_max"]) == pytest.approx((1100, 1000, 1200))
    assert row["event_step_ms"] == pytest.approx(1090)
    assert (row["loss_first"], row["loss_last"], row["peak_gib"], row["steps"]) == (12.0, 11.6, 3.0, 6)


def test_recipe_documents_spread_past_the_cut_the_same_for_every_trainer():
    lengths = unsloth_recipe.document_lengths(2000)
    assert lengths == unsloth_recipe.document_lengths(2000)  # seeded: every trainer trains on the same rows
    assert 100 <= min(lengths) < 150 and 2900 < max(lengths) <= 3000
    over = sum(n > unsloth_recipe.MAX_LENGTH for n in lengths) / len(lengths)
    assert 0.07 < over < 0.16  # log-uniform: about 11% are cut
    assert unsloth_recipe.n_documents(60) == 8 * 62


def test_capture_statistics_are_read_when_the_trainer_has_them_and_never_fail():
    stats = SimpleNamespace(capture_s=1.5, captures=28, _private=object())
    assert unsloth_recipe.capture_stats(SimpleNamespace(nbkit_layer_stats=stats)) == {
        "nbkit_layer_stats": {"capture_s": 1.5, "captures": 28}, "capture_s": 1.5, "captures": 28}
    assert unsloth_recipe.capture_stats(SimpleNamespace()) == {}

    class Broken:
        @property
        def nbkit_layer_stats(self):
            raise RuntimeError("not yet")

    assert "RuntimeError" in unsloth_recipe.capture_stats(Broken())["nbkit_layer_stats_error"]
