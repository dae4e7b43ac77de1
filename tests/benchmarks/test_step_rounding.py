"""CPU tests of the per-step rounding benchmark (``python -m benchmarks.step_rounding``) and of curves' ``trl_liger``.

On a CPU every path trains in fp32, so each is float64 to fp32 rounding (~1e-7 relative) and FastSFT's distance is
of the same order as plain TRL's; a path whose loss is scaled by 1 + 1e-3 must show 1e-3, and the verdict must call
it above the plain range. The reference's own machinery (dtypes forced to float64, NF4 dequantized exactly) is
checked on its own too.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import curves, step_rounding
from benchmarks.common import parse_path, split_paths

PATHS = ("fp64", "trl", "trl_eager", "fastsft")
PERTURBED = "fastsft[dataloader_drop_last=False]"  # FastSFT under another name (the switch is TRL's default)
SCALE = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The ``--tiny`` run through the public entry, each path in its own process (as on a GPU)."""
    out = tmp_path_factory.mktemp("out")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OUT", str(out))
        payload = step_rounding.main(["--tiny"])
    return payload, out


def _rows(payload: dict) -> dict[str, dict]:
    return {r["path"]: r for r in payload["figures"] if r["kind"] == "path"}


def test_tiny_run_measures_every_path_against_float64(tiny):
    payload, out = tiny
    saved = json.loads((out / "step_rounding.json").read_text())
    assert saved["benchmark"] == "step_rounding" and saved["command"] == "python -m benchmarks.step_rounding --tiny"
    assert saved["figures"] == json.loads(json.dumps(payload["figures"]))
    rows = _rows(payload)
    assert tuple(rows) == PATHS and not [r for r in rows.values() if "error" in r], rows
    ref = rows["fp64"]
    assert ref["loss_rel"] == ref["grads_rel"] == 0 and all(g["median"] == 0 for g in ref["groups"].values())
    for path in PATHS[1:]:
        r = rows[path]
        assert r["batches"] == 3 and len(r["per_batch"]["grads_rel"]) == 3 and r["precision"] == "fp32"
        for key in ("loss_rel", "grads_rel"):
            assert math.isfinite(r[key]) and 0 < r[key] < 1e-5, (path, key, r[key])  # fp32 rounding, not 0
        assert set(r["groups"]) == {"embeddings", "head", "attention_lora", "mlp_lora"}
    fast, trl = rows["fastsft"], rows["trl"]
    assert fast["nbkit_attached"] and not trl["nbkit_attached"]
    assert 0.1 < fast["grads_rel"] / trl["grads_rel"] < 10 and fast["vs_trl_grads_rel"] < 1e-5
    (v,) = [r for r in payload["figures"] if r["kind"] == "verdict"]
    assert v["path"] == "fastsft" and v["plain_paths"] == ["trl", "trl_eager"] and v["within_plain_range"] is True


def test_a_perturbed_path_is_far_from_float64_and_judged_above(tmp_path, monkeypatch):
    """Negative control: the loss of one path scaled by 1 + SCALE (gradients too): distance SCALE, verdict above."""
    from trl import SFTTrainer

    from nbkit.speedups import sync_free_loss

    plain = SFTTrainer.compute_loss

    def compute_loss(self, *args, **kwargs):
        loss = plain(self, *args, **kwargs)
        return loss * (1 + SCALE) if getattr(self, "nbkit_job", {}).get("path") == PERTURBED else loss

    monkeypatch.setattr(SFTTrainer, "compute_loss", compute_loss)
    sync_free = sync_free_loss.sync_free_loss  # FastSFT's default loss path (sync_free_metrics)

    def sync_free_scaled(trainer, *args, **kwargs):
        loss = sync_free(trainer, *args, **kwargs)
        return loss * (1 + SCALE) if getattr(trainer, "nbkit_job", {}).get("path") == PERTURBED else loss

    monkeypatch.setattr(sync_free_loss, "sync_free_loss", sync_free_scaled)
    monkeypatch.setenv("OUT", str(tmp_path))
    payload = step_rounding.main(["--tiny", "--jobs", "0", "--batches", "2", "--paths", f"trl,fastsft,{PERTURBED}"])
    rows = _rows(payload)
    assert not [r for r in rows.values() if "error" in r], rows
    bad = rows[PERTURBED]
    for key in ("loss_rel", "grads_rel", "vs_trl_loss_rel", "vs_trl_grads_rel"):
        assert bad[key] == pytest.approx(SCALE, rel=1e-2), key
    assert bad["grads_rel"] > 100 * rows["trl"]["grads_rel"]
    verdicts = {v["path"]: v for v in payload["figures"] if v["kind"] == "verdict"}
    assert verdicts["fastsft"]["within_plain_range"] is True
    assert verdicts[PERTURBED]["within_plain_range"] is False
    assert verdicts[PERTURBED]["grads_rel_ratio_to_largest_plain"] > 100


def _cpu_grad_scaler(monkeypatch, **scaler_kwargs):
    """The fp16 scaler's code path of a GPU on a CPU: every trainer but the reference's gets a CPU ``GradScaler``
    (``scaler_kwargs``) before it trains, so accelerate scales each backward and steps through it, and accelerate's own
    ``unscale_gradients`` unscales (it checks for fp16 and native amp, neither of which a CPU can have: both are
    made true for that call alone, since either one at prepare time would autocast the model)."""
    from unittest import mock

    from accelerate import Accelerator

    unscale = Accelerator.unscale_gradients
    train = step_rounding._Capture.train

    def unscale_gradients(self, optimizer=None):
        if self.scaler is None:  # the reference: no fp16
            return unscale(self, optimizer)
        with mock.patch.object(self, "native_amp", True), mock.patch.object(Accelerator, "mixed_precision", "fp16"):
            return unscale(self, optimizer)

    def with_scaler(self, *args, **kwargs):
        if self.nbkit_job["kind"] != "reference":  # the reference's config turns fp16 off: no scaler
            self.accelerator.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
        return train(self, *args, **kwargs)

    monkeypatch.setattr(Accelerator, "unscale_gradients", unscale_gradients)
    monkeypatch.setattr(step_rounding._Capture, "train", with_scaler)


def test_fp16_grad_scaler_measures_after_prior_steps(tmp_path, monkeypatch):
    """At ``--at-step K`` the measure jobs pass over the K batches the weights took, and the trainer still unscales
    and steps through the scaler after each: they must leave it a scale (a GPU's fp16 runs failed there, "Attempted
    unscale_ but _scale is None"), and the first measured batch finds the scaler as at step 0 (here the K steps
    would have doubled the scale: it grows after every 2 steps without an overflow)."""
    _cpu_grad_scaler(monkeypatch, growth_interval=2)
    monkeypatch.setenv("OUT", str(tmp_path))
    payload = step_rounding.main(["--tiny", "--jobs", "0", "--batches", "2", "--at-step", "0,2",
                                  "--paths", "trl,fastsft"])
    rows = {(r["at_step"], r["path"]): r for r in payload["figures"] if r["kind"] == "path"}
    assert sorted(rows) == [(k, p) for k in (0, 2) for p in ("fastsft", "fp64", "trl")]
    assert not [r for r in rows.values() if "error" in r], rows
    init = torch.amp.GradScaler("cpu").get_scale()
    for k in (0, 2):
        assert rows[(k, "fp64")]["loss_scales"] == [1.0, 1.0]
        for path in ("trl", "fastsft"):
            r = rows[(k, path)]
            assert r["loss_scales"] == [init, init], (k, path)  # grown only after the 2nd; fp32: no halving
            assert 0 < r["grads_rel"] < 1e-5, (k, path)  # divided by the scale it was scaled by


def test_packed_gpt_oss_fastsft_is_measured_against_the_per_document_reference(tmp_path, monkeypatch):
    """Plain TRL's packed gpt-oss attends across documents, FastSFT's does not: FastSFT is far from the plain step
    (another function) and at fp32 rounding from the float64 step with per-document masks."""
    monkeypatch.setenv("OUT", str(tmp_path))
    payload = step_rounding.main(["--tiny", "--families", "gpt_oss", "--jobs", "0", "--batches", "2",
                                  "--paths", "trl,fastsft,fastsft[cached_packing=False]"])
    rows = _rows(payload)
    assert tuple(rows) == ("fp64", "fp64_per_document", "trl", "fastsft", "fastsft[cached_packing=False]")
    assert not [r for r in rows.values() if "error" in r], rows
    assert [rows[p]["reference"] for p in rows] == ["fp64", "fp64_per_document", "fp64", "fp64_per_document", "fp64"]
    assert rows["fp64_per_document"]["vs_trl_grads_rel"] > 0.1  # the two functions differ, not by rounding
    for path in ("trl", "fastsft", "fastsft[cached_packing=False]"):
        assert 0 < rows[path]["grads_rel"] < 1e-5, path
    assert rows["fastsft"]["vs_trl_grads_rel"] > 0.1
    verdicts = {v["path"]: v for v in payload["figures"] if v["kind"] == "verdict"}
    assert verdicts["fastsft"]["within_plain_range"] and verdicts["fastsft"]["reference"] == "fp64_per_document"


def test_verdict_is_the_plain_range_with_a_margin():
    def row(path, loss, grads, family="mistral"):
        return {"kind": "path", "family": family, "precision": "fp16", "seed": 0, "at_step": 0, "path": path,
                "loss_rel": loss, "grads_rel": grads}

    rows = [row("trl", 1e-3, 2e-3), row("trl_eager", 2e-3, 3e-3), row("fastsft", 2.1e-3, 3.2e-3),
            row("fastsft[fused_lora=False]", 1e-3, 4e-3), row("gemma2_only", 0, 0, "gemma2"),
            row("fastsft", 1e-3, 1e-3, "gemma2")]
    got = {(v["family"], v["path"]): v for v in step_rounding.verdict(rows)}
    assert got[("mistral", "fastsft")]["within_plain_range"] is True  # within 10% of the largest plain
    assert got[("mistral", "fastsft")]["plain_grads_rel_range"] == [2e-3, 3e-3]
    assert got[("mistral", "fastsft[fused_lora=False]")]["within_plain_range"] is False
    assert step_rounding.verdict(rows, margin=0.0)[0]["within_plain_range"] is False
    assert got[("gemma2", "fastsft")]["within_plain_range"] is None  # no plain path: no verdict


def test_reference_arithmetic_turns_every_low_precision_dtype_into_float64():
    outside = torch.ones(3)  # float32, made before the mode
    mode = step_rounding.Float64Arithmetic()
    x = torch.randn(4, 5, dtype=torch.float64)
    with step_rounding.float64_step(mode):
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float64
        assert torch.tensor(0.5).dtype == torch.float64  # the default dtype
        assert x.float().dtype == x.to(torch.bfloat16).dtype == torch.float64
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        assert (outside / 2).dtype == torch.float64  # a float32 input is read in float64
        assert not mode.low
        outside.mul_(2)  # in place on a float32 tensor: cannot be float64, so it is reported
    assert mode.low == ["aten.mul_.Tensor"] and torch.get_default_dtype() == torch.float32


def test_nf4_layers_are_dequantized_exactly_into_float64():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    dense = torch.nn.Linear(128, 64)
    layer = bnb.nn.Linear4bit(128, 64, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True)
    layer.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True)
    layer.bias = torch.nn.Parameter(dense.bias.data.clone(), requires_grad=False)
    layer = layer.to("cpu")  # quantizes
    state = layer.weight.quant_state
    linear = step_rounding.dequantized_linear(layer)
    assert linear.weight.dtype == torch.float64 and not linear.weight.requires_grad
    # exact: every weight is one of the 16 NF4 codes times its block's absmax (both fp32 numbers)
    absmax = (bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset).double()
    codes = linear.weight.flatten().view(-1, state.blocksize) / absmax[:, None]
    assert (codes[..., None] - state.code.double()).abs().min(-1).values.max() < 1e-15
    # bitsandbytes' own fp32 dequantization is the same to fp32 rounding, and not more exact
    theirs = bnb.functional.dequantize_4bit(layer.weight.data, state).double()
    assert torch.allclose(linear.weight, theirs, rtol=2**-24, atol=0) and not torch.equal(linear.weight, theirs)
    x = torch.randn(3, 128)
    assert torch.allclose(linear(x.double()), layer(x).double(), atol=1e-5)


def test_curves_trl_liger_path_turns_on_trls_liger_kernels(tmp_path, monkeypatch):
    import trl

    import nbkit.loading

    seen = {}

    class Stop(Exception):
        pass

    class Trainer:
        def __init__(self, model=None, args=None, **kwargs):
            seen["args"] = args
            raise Stop

    monkeypatch.setattr(nbkit.loading, "load_model", lambda base, **kwargs: (torch.nn.Linear(1, 1), None))
    monkeypatch.setattr(trl, "SFTTrainer", Trainer)
    assert split_paths("trl,trl_liger,fastsft") == ["trl", "trl_liger", "fastsft"]
    assert parse_path("trl_liger") == ("trl_liger", {})
    run = {"task": "demo", "family": "qwen3", "precision": "fp32", "steps": 1, "seed": 0, "base": "x",
           "work": str(tmp_path), "key": "k", "load_in_4bit": False}
    for path, want in (("trl_liger", True), ("trl", False)):
        with pytest.raises(Stop):
            curves.train_run({**run, "path": path})
        assert seen["args"].use_liger_kernel is want


def test_trl_liger_is_refused_without_a_gpu_and_reported_beside_the_floors(monkeypatch):
    monkeypatch.setattr(curves, "liger_runs", lambda: False)
    with pytest.raises(SystemExit):
        curves.main(["--families", "qwen3", "--paths", "trl,trl_liger,fastsft"])
    with pytest.raises(SystemExit):
        step_rounding.main(["--tiny", "--paths", "trl,trl_liger"])

    def row(path, gap):
        return {"family": "mistral", "task": "demo", "precision": "fp16", "seed": 0, "path": path,
                "gap": {"max_abs_gap": gap}}

    (v,) = curves.verdict([row("trl_eager", 0.01), row("trl_liger", 0.05), row("fastsft", 0.03)])
    assert v["floor_path"] == "trl_eager" and v["floor_trl_liger"] == 0.05 and v["within_floor"] is False
