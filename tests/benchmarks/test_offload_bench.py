"""CPU tests of the offload benchmark (``python -m benchmarks.offload``): its pure logic (copy overlap from a trace,
the longest-row search's next-try rule, host limits, failure kinds), one try of the search, the packed batch, and
the benchmark's public entry end to end on a tiny model (``--tiny``).

Parity through the entry is bitwise: on CPU fp32 the offloaded configs restore each layer input byte for byte, so
their LoRA gradients equal plain checkpointing's exactly.
"""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch

from benchmarks.offload import copy_overlap
from benchmarks.offload import main as offload_main
from benchmarks.offload_longest import failure_kind, host_limit_tokens, host_need, next_try, predict_max, probe
from benchmarks.offload_workload import packed_batch
from nbkit.memory import GiB

LAYERS = 4


@pytest.fixture
def gc_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(cfg).float()
    model.train()
    model.gradient_checkpointing_enable()
    return model


def test_copy_overlap_from_a_synthetic_trace():
    def ev(cat, name, ts, dur, stream, nbytes=None):
        args = {"stream": stream} | ({"bytes": nbytes} if nbytes is not None else {})
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    trace = {"traceEvents": [
        ev("kernel", "gemm", 0, 100, 7),
        ev("kernel", "gemm", 150, 100, 7),
        ev("kernel", "gemm", 400, 100, 7),
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50, 100, 20, 64 * 2**20),  # 50 of 100 us under compute
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 260, 40, 20, 64 * 2**20),  # none under compute
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 410, 40, 20, 64 * 2**20),  # all under compute
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 420, 20, 7, 64 * 2**20),  # on the compute stream: none
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 0, 5, 7, 4),  # tiny: ignored
    ]}
    out = copy_overlap(trace)
    assert out["DtoH"]["count"] == 1 and out["DtoH"]["overlap"] == pytest.approx(0.5)
    assert out["DtoH"]["gb_per_s"] == pytest.approx(64 * 2**20 / 100e3)
    # per copy, only kernels on other streams count: the side-stream copy at 410 is covered by stream 7's kernel
    assert out["HtoD"]["count"] == 3 and out["HtoD"]["overlap"] == pytest.approx(40 / 100)
    assert out["HtoD"]["streams"] == [7, 20]


def _search_on(peak, cap, prior, first=32768, res=8192):
    """Drive the benchmark's next-try rule against a made-up GPU (``peak(tokens)`` GiB; fits while <= cap)."""
    probes, lo, hi = [], 0, None
    pred = predict_max(probes, cap, prior)
    t = next_try(0, None, res, pred) if pred is not None else first
    while t is not None and len(probes) < 25:
        ok = peak(t) <= cap
        probes.append(dict(tokens=t, outcome="ok" if ok else "failed", peak_gib=peak(t) if ok else 0.0, host_short=0))
        if ok:
            lo = max(lo, t)
        elif hi is None or t < hi:
            hi = t
        t = next_try(lo, hi, res, predict_max(probes, cap, prior))
    return lo, hi, [(p["tokens"], p["outcome"]) for p in probes]


def test_longest_search_converges():
    """The search's rule: a right prior takes two tries, failure first; a wrong one or none still brackets the
    limit (180,000 tokens here) to the 8K resolution in a few."""
    peak = lambda t: 10 + 0.0005 * t
    lo, hi, tries = _search_on(peak, 100.0, (100000, 60.0, 0.0005))
    assert lo <= 180000 < hi and hi - lo <= 8192
    assert tries == [(180224, "failed"), (172032, "ok")]
    for prior in [(100000, 50.0, 0.0004), (50000, 80.0, 0.0008), None]:
        lo, hi, tries = _search_on(peak, 100.0, prior)
        assert lo <= 180000 < hi and hi - lo <= 8192 and len(tries) <= 7, (prior, tries)
    lo, hi, tries = _search_on(lambda t: 200.0, 100.0, None)  # nothing fits
    assert lo == 0 and tries[-1][0] <= 8192


def test_longest_host_limits_and_failure_kinds():
    assert host_need("ckpt_offload", 40, 204800, 5120) == 40 * 2**31  # torch rounds pinned blocks to powers of two
    assert host_need("ckpt_offload", 40, 212992, 5120) == 40 * 2**32
    assert host_need("nbkit_double", 40, 212992, 5120) == 40 * 212992 * 10240 and host_need("ckpt", 40, 8, 8) == 0
    assert host_limit_tokens("ckpt_offload", 40, 5120, 100 * GiB) == 2**31 // 10240
    assert host_limit_tokens("nbkit_double", 40, 5120, 100 * GiB) == 100 * GiB // (40 * 10240)
    assert host_limit_tokens("ckpt", 40, 5120, 100 * GiB) is None

    def pack_to_cpu():  # the name of save_on_cpu's pack hook: a pinned allocation failing there is the host's
        raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(RuntimeError) as info:
        pack_to_cpu()
    assert failure_kind(info.value) == "host RAM"
    assert failure_kind(RuntimeError("CUDA error: out of memory")) == "CUDA OOM"
    assert failure_kind(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")) == "CUDA OOM"
    assert failure_kind(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")) == "CUDA OOM"
    assert failure_kind(RuntimeError("DefaultCPUAllocator: can't allocate memory")) == "host RAM"
    assert failure_kind(ValueError("shape mismatch")) is None


@pytest.mark.parametrize("mode", ["peak", "full", "time cap"])
def test_longest_try_stops_past_the_peak(gc_model, mode):
    """A 'peak' try runs the backward of the last layers only; 'full' all of it; a try past its deadline is cut."""
    done = []
    for i, layer in enumerate(gc_model.model.layers):
        def mark(module, args, i=i):
            if torch.is_grad_enabled() and args[0].requires_grad and not getattr(module, "_marked", False):
                module._marked = True  # the forward's call only (the recompute calls it again)
                args[0].register_hook(lambda g: done.append(i))
        layer.register_forward_pre_hook(mark)
    args = argparse.Namespace(longest_probe="full" if mode == "full" else "peak", longest_peak_layers=2)
    deadline = time.monotonic() + (-1 if mode == "time cap" else 60)
    r = probe(gc_model, gc_model, "ckpt", 128, "cpu", None, args, deadline)
    assert r["outcome"] == ("time cap" if mode == "time cap" else "ok") and r["kind"] is None
    assert done == {"peak": [3, 2], "full": [3, 2, 1, 0], "time cap": []}[mode]
    assert all(p.grad is None for p in gc_model.parameters())  # the try leaves nothing behind


def test_packed_batch_is_like_trl_padding_free():
    b = packed_batch(4096, 1000, "cpu")
    pos, cu = b["position_ids"][0], b["cu_seq_lens_q"]
    starts = (pos == 0).nonzero().flatten()
    assert cu[0] == 0 and cu[-1] == 4096 and torch.equal(cu[:-1].long(), starts)
    assert b["max_length_q"] == int(cu.diff().max()) and 300 <= int(cu.diff()[:-1].float().mean()) <= 500
    assert (b["labels"][0][starts] == -100).all() and (b["labels"][0] != -100).sum() == 4096 - len(starts)


def test_side_by_side_entry_gives_bitwise_parity_and_writes_its_results(tmp_path, monkeypatch):
    """``python -m benchmarks.offload --tiny`` (CPU, fp32): every config runs (``ckpt_offload`` is skipped: it pins
    host memory, which needs CUDA), the offloaded configs' LoRA gradients and losses are bitwise plain
    checkpointing's, and $OUT/offload.json holds the returned rows under the exact command line."""
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--steps", "1"]
    rows = offload_main(argv)
    by_config = {r["config"]: r for r in rows}
    assert set(by_config) == {"ckpt", "ckpt_offload", "nbkit_single", "nbkit_double", "no_ckpt"}
    assert "CUDA" in by_config["ckpt_offload"]["error"]
    ran = [r for r in rows if r["config"] != "ckpt_offload"]
    assert not [r for r in ran if r.get("error")], ran
    for name in ("nbkit_single", "nbkit_double"):
        assert by_config[name]["grad_bitwise"] and by_config[name]["losses"] == by_config["ckpt"]["losses"], name
        assert by_config[name]["offload_stats"]["packs"] > 0, name  # the layer inputs did go to the host
    written = json.loads((tmp_path / "offload.json").read_text())
    assert written["benchmark"] == "offload" and written["command"] == "python -m benchmarks.offload --tiny --steps 1"
    assert [r["config"] for r in written["figures"]] == [r["config"] for r in rows]


def test_longest_entry_writes_one_row_per_config(tmp_path, monkeypatch):
    """``--tiny --longest`` runs the whole search and writes one row per config; a row's longest length is the
    longest of its own successful tries (0 when its share of the time budget ran out before one), and the first
    config, which has no earlier tries to predict its time from, always gets one."""
    monkeypatch.setenv("OUT", str(tmp_path))
    results = offload_main(["--tiny", "--longest", "--configs", "ckpt,nbkit_double", "--longest-budget", "8"])
    assert [r["config"] for r in results] == ["ckpt", "nbkit_double"]
    for r in results:
        ok = [p["tokens"] for p in r["probes"] if p["outcome"] == "ok"]
        assert r["longest_tokens"] == max(ok, default=0) and r["stopped_by"], r
    assert results[0]["longest_tokens"] > 0
    written = json.loads((tmp_path / "offload_longest.json").read_text())
    assert written["benchmark"] == "offload" and [r["config"] for r in written["figures"]] == ["ckpt", "nbkit_double"]
