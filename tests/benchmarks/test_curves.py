"""CPU tests of the curve benchmark (``python -m benchmarks.curves``): the smoothing and gap arithmetic (with curves
whose answer is known), the verdict against the floors, the real-text split, and the entry end to end (``--tiny``:
on a CPU in fp32, FastSFT's curve equals TRL's to rounding, so its gap is ~0)."""

from __future__ import annotations

import json

import pytest

from benchmarks.curves import FINAL_WINDOW, TEXT_CHARS, curve_gap, ema, text_documents, verdict
from benchmarks.curves import main as curves_main


def test_ema_is_bias_corrected_and_tracks_a_constant():
    assert ema([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert ema([1.0, 0.0], beta=0.5) == pytest.approx([1.0, (0.25) / 0.75])


def test_gap_of_a_shifted_curve_is_the_shift_and_of_itself_zero():
    ref = [4.0 / (1 + 0.05 * i) for i in range(200)]
    same = curve_gap(ref, ref)
    assert same["max_abs_gap"] == 0 and same["mean_abs_gap"] == 0 and same["final_rel_diff"] == 0
    shifted = curve_gap([x + 0.1 for x in ref], ref)
    assert shifted["max_abs_gap"] == pytest.approx(0.1) and shifted["mean_abs_gap"] == pytest.approx(0.1)
    assert shifted["max_rel_gap"] == pytest.approx(0.1 / min(ema(ref)), rel=1e-6)  # relative: largest where lowest
    tail = sum(ref[-FINAL_WINDOW:]) / FINAL_WINDOW
    assert shifted["final_rel_diff"] == pytest.approx(0.1 / tail)


def test_a_late_bump_is_found_at_its_step():
    ref = [1.0] * 100
    bumped = ref[:60] + [2.0] + ref[61:]
    gap = curve_gap(bumped, ref)
    assert gap["max_abs_gap_step"] == 61 and gap["max_abs_gap"] == pytest.approx(0.1, rel=1e-2)
    with pytest.raises(ValueError):
        curve_gap(ref[:10], ref)


def test_verdict_uses_the_attention_floor_and_falls_back_to_the_order_floor():
    def row(family, path, gap):
        return {"family": family, "task": "demo", "precision": "bf16", "path": path, "gap": {"max_abs_gap": gap}}

    rows = [row("qwen3", "trl_eager", 0.05), row("qwen3", "trl_order", 0.2), row("qwen3", "fastsft", 0.04),
            row("qwen3", "fastsft[fused_kernels=False]", 0.06),
            row("gemma2", "trl_order", 0.2), row("gemma2", "fastsft", 0.1)]
    got = {(v["family"], v["path"]): v for v in verdict(rows)}
    assert got[("qwen3", "fastsft")]["within_floor"] is True and got[("qwen3", "fastsft")]["floor_path"] == "trl_eager"
    assert got[("qwen3", "fastsft[fused_kernels=False]")]["within_floor"] is False
    assert got[("gemma2", "fastsft")]["floor_path"] == "trl_order" and got[("gemma2", "fastsft")]["within_floor"]
    assert verdict([row("llama", "fastsft", 0.1)])[0]["within_floor"] is None  # no floor measured: no verdict
    assert not [v for v in verdict(rows) if v["seed"] == "pooled"]  # one seed: nothing to pool


def test_pooled_verdict_compares_median_gaps_over_seeds():
    def row(seed, path, gap):
        return {"family": "gemma3", "task": "demo", "precision": "bf16", "seed": seed, "path": path,
                "gap": {"max_abs_gap": gap}}

    # seed 0 alone would call FastSFT above its floor; over three seeds it is not
    noisy = [row(0, "trl_eager", 0.2), row(0, "fastsft", 0.5), row(1, "trl_eager", 1.2), row(1, "fastsft", 0.9),
             row(2, "trl_eager", 0.7), row(2, "fastsft", 0.6)]
    (pooled,) = [v for v in verdict(noisy) if v["seed"] == "pooled"]
    assert pooled["within_floor"] and pooled["above_floor_at"] == 1 and pooled["max_abs_gap"] == 0.6
    # a systematic difference: above the floor at every seed
    biased = [row(s, "trl_eager", f) for s, f in enumerate((0.2, 0.3, 0.25))] + \
        [row(s, "fastsft", f + 0.3) for s, f in enumerate((0.2, 0.3, 0.25))]
    (pooled,) = [v for v in verdict(biased) if v["seed"] == "pooled"]
    assert not pooled["within_floor"] and pooled["above_floor_at"] == 3


def test_real_text_split_holds_out_whole_topics_in_bounded_documents():
    train, held = text_documents(held_out=False), text_documents(held_out=True)
    assert len(train) > 5 * len(held) > 0
    assert max(map(len, train + held)) <= TEXT_CHARS
    assert not set(train) & set(held)


def test_the_entry_end_to_end_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    payload = curves_main(["--tiny"])
    saved = json.loads((tmp_path / "curves.json").read_text())
    assert saved["benchmark"] == "curves" and saved["figures"] == json.loads(json.dumps(payload["figures"]))
    runs = {r["path"]: r for r in saved["figures"] if r["kind"] == "run"}
    assert set(runs) == {"trl", "fastsft"} and all("error" not in r for r in runs.values()), runs
    assert len(runs["trl"]["losses"]) == 6 and runs["fastsft"]["nbkit_attached"]
    assert runs["fastsft"]["gap"]["max_abs_gap"] < 1e-3 * runs["trl"]["losses"][0]
    (v,) = [r for r in saved["figures"] if r["kind"] == "verdict"]
    assert v["path"] == "fastsft" and v["within_floor"] is None


def test_moe_families_are_judged_against_the_experts_floor():
    def row(path, gap, seed=0):
        return {"family": "mixtral", "task": "demo", "precision": "bf16", "seed": seed, "path": path,
                "gap": {"max_abs_gap": gap}}

    rows = [row("trl_eager", 0.05), row("trl_experts", 0.2), row("trl_order", 0.3), row("fastsft", 0.1)]
    (v,) = verdict(rows)
    assert v["floor_path"] == "trl_experts" and v["within_floor"] and v["floor_trl_eager"] == 0.05


def test_the_experts_floor_loads_transformers_eager_experts(monkeypatch):
    import nbkit.loading
    from benchmarks import curves

    seen = {}

    class Stop(Exception):
        pass

    def fake_load(base, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(nbkit.loading, "load_model", fake_load)
    run = {"task": "demo", "family": "mixtral", "precision": "fp32", "steps": 1, "seed": 0, "base": "x"}
    for path, want in (("trl_experts", "eager"), ("trl", None)):
        seen.clear()
        with pytest.raises(Stop):
            curves.train_run({**run, "path": path, "load_in_4bit": False})
        assert seen.get("experts_implementation") == want


def test_merge_keeps_one_row_per_workload_and_path(tmp_path):
    from benchmarks.curves import _load_rows

    row = {"task": "demo", "family": "qwen2", "precision": "fp16", "seed": 0, "path": "trl", "losses": [1.0]}
    a, b = tmp_path / "a.partial.jsonl", tmp_path / "b.partial.jsonl"
    a.write_text(json.dumps(row) + "\n")
    b.write_text(json.dumps(row | {"losses": [2.0]}) + "\n" + json.dumps(row | {"path": "fastsft"}) + "\n")
    rows, _ = _load_rows([str(a), str(b)])
    assert [(r["path"], r["losses"]) for r in rows] == [("trl", [1.0]), ("fastsft", [1.0])]
