"""Offloaded checkpointing benchmark: five ways to hold activations, side by side in one process.

Workload (issue 3): Qwen3-8B- and Qwen3-14B-shaped models with random weights, QLoRA (bitsandbytes nf4 with double
quantization, bf16 compute, LoRA r=16 on all 7 projections), one packed row of 16K / 32K tokens per step from
documents of about 400 tokens, passed like TRL's padding-free collator (position_ids, cu_seq_lens_q/k,
max_length_q/k). Attention: nbkit's packed ("nbkit", varlen) attention when ``nbkit.speedups.packed_attention`` is
present, else "sdpa" (a dense T x T block mask; O(T^2), said in the output). The LM head + cross-entropy runs in
checkpointed 4K token chunks in every config, so the decoder stack, not 32K x 152K logits, decides peak memory. A
step is forward + backward (no optimizer: LoRA's AdamW update is ~1 ms and the same in every config).

Configs: ``no_ckpt`` (where it fits), ``ckpt`` (transformers' non-reentrant checkpointing), ``ckpt_offload``
(transformers' ``offload=True``: torch ``save_on_cpu``, copies on the compute stream), ``nbkit_single``,
``nbkit_double`` (nbkit.speedups.offload with one / two restore buffers).

Prediction (written before the first run; n = one layer's checkpointed input = tokens x hidden x 2 bytes):

| shape | tokens | n | n x all layers | one copy at 55 GB/s | layer fwd (est.) | recompute + bwd (est.) |
|---|---|---|---|---|---|---|
| 8B: h 4096, 36 layers, 193 M params/layer | 16K | 128 MiB | 4.5 GiB | 2.4 ms | ~16 ms | ~37 ms |
| 8B | 32K | 256 MiB | 9.0 GiB | 4.9 ms | ~32 ms | ~74 ms |
| 14B: h 5120, 40 layers, 330 M params/layer | 16K | 160 MiB | 6.25 GiB | 3.1 ms | ~27 ms | ~61 ms |
| 14B | 32K | 320 MiB | 12.5 GiB | 6.1 ms | ~54 ms | ~122 ms |

Layer time: 2 x params x tokens FLOP at ~550 TFLOP/s (4-bit dequant + bf16 GEMM, 70% of the 779 measured) plus ~30%
for LoRA (fp32 casts), norms, RoPE, SwiGLU; varlen attention is 0.34 ms per layer forward at 16K (BENCHMARKS.md, "The
machine"). Backward of a frozen 4-bit base is dgrad only (~1x forward) plus the recompute (1x forward). With "sdpa"
(dense mask) add ~15 ms (8B) / ~19 ms (14B) of attention forward per layer at 16K and 4x that at 32K, which shrinks
every ratio below.

So a D2H copy is ~11-15% of a layer's forward and an H2D copy ~5-7% of its backward: both hide on a side stream.
- step time vs ``ckpt``: ``no_ckpt`` ~0.70x (no recompute); ``ckpt_offload`` +9-13% (a blocking D2H and an H2D per
  layer on the compute stream, and the host stalls once per layer); ``nbkit_single`` +3.5-4.5% (H2D exposed, D2H
  hidden); ``nbkit_double`` within 1% (target 3%). Double over single: ~3.5-4.5%.
- peak: ``ckpt`` - ``nbkit_double`` ~ (layers - 2) x n (two restore buffers stay); ``ckpt_offload`` and
  ``nbkit_single`` ~ (layers - 1) x n. With the default ``--layers 8``: 0.75 GiB (8B 16K) to 1.9 GiB (14B 32K); at full
  depth 4.25 GiB (8B 16K) to 11.9 GiB (14B 32K). Measured (14B, 16K, 40 layers): ckpt 23.6, ckpt_offload 17.92,
  nbkit_single 17.92, nbkit_double 18.07 GiB, at 4,321 / 4,496 / 4,402 / 4,331 ms.
- Revised prediction, after moving the prefetch behind each layer's MLP backward (the second buffer is taken from the
  allocator after the layer's peak and given back at the layer's end): ``nbkit_double`` peak = ``ckpt_offload``'s
  (within allocator rounding), step time unchanged (an H2D copy of 3 ms at 14B 16K hides behind ~4-6 ms of attention
  and q/k/v/o backward); the prefetch table shows it from nbkit's own timed events ("compute waited" ~0).
- loss identical across configs (same weights, same batch); LoRA gradients equal to ``ckpt`` up to bf16 kernel order.

    python -m benchmarks.offload [--models 8b,14b] [--tokens 16384,32768] [--layers 8] [--warmup 1] [--steps 3]
    python -m benchmarks.offload --models 8b --tokens 16384,32768 --layers 0     # full depth, ~3 min
    python -m benchmarks.offload --longest [--longest-budget 210] [--longest-probe peak|full]
    python -m benchmarks.offload --tiny [--longest]     # CPU smoke runs of the same code

The ``--longest`` search lives in ``benchmarks.offload_longest``, the shared model and batch in
``benchmarks.offload_workload``. Results: ``$OUT/offload.json`` / ``$OUT/offload_longest.json`` (the schema of
``benchmarks.common.write_results``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

import torch
from torch import nn

from nbkit.memory import GiB

from .common import event, peak_memory, write_results
from .offload_longest import LONGEST_CONFIGS, longest, longest_table
from .offload_workload import (
    CPU_SKIP,
    SHAPES,
    attach_attention,
    build_qlora,
    cleanup,
    is_oom,
    loss_fn,
    packed_batch,
    set_config,
    trainable,
)

CONFIGS = ("ckpt", "ckpt_offload", "nbkit_single", "nbkit_double", "no_ckpt")  # ckpt first: the reference


# --------------------------------------------------------------------------------------------------- timed steps
def run_steps(model: nn.Module, causal: nn.Module, batch: dict, warmup: int, steps: int) -> dict:
    """Timed forward+backward steps (CUDA events, median after warmup); peak over all of them; LoRA grads kept."""
    params = trainable(model)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        for p in params:
            p.grad = None
        start, end = event(), event()
        start.record()
        loss = loss_fn(causal, batch)
        loss.backward()
        end.record()
        end.synchronize()
        losses.append(loss.item())
        if i >= warmup:
            times.append(start.elapsed_time(end))
    grads = torch.cat([p.grad.float().flatten().cpu() for p in params if p.grad is not None])
    return dict(step_ms=statistics.median(times), step_ms_all=times, loss=losses[-1], losses=losses,
                peak_gib=peak_memory() / GiB, grads=grads)


# ------------------------------------------------------------------------------------------------- copy overlap
def copy_overlap(trace: str | dict, min_bytes: int = 2**20) -> dict:
    """From a torch.profiler chrome trace: how much of the large D2H / H2D copies ran under compute kernels.

    For each direction: count, total copy ms, the fraction of copy time overlapped by kernels on other streams than
    the copy's own (a synchronous restore copies on the compute stream: nothing runs beside it), the copy bandwidth,
    and the streams the copies ran on.
    """
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("stream"))
               for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    busy_beside: dict[Any, list[tuple[float, float]]] = {}  # kernels on every stream but this one
    out = {}
    for direction in ("DtoH", "HtoD"):
        sel = [c for c in copies if direction in c.get("name", "")
               and c.get("args", {}).get("bytes", min_bytes) >= min_bytes]
        streams = {c.get("args", {}).get("stream") for c in sel}
        for s in streams - busy_beside.keys():
            busy_beside[s] = _union([(a, b) for a, b, k in kernels if k != s])
        total = sum(c["dur"] for c in sel)
        covered = sum(_covered(busy_beside[c.get("args", {}).get("stream")], c["ts"], c["ts"] + c["dur"])
                      for c in sel)
        nbytes = sum(c.get("args", {}).get("bytes", 0) for c in sel)
        out[direction] = dict(count=len(sel), ms=total / 1e3, overlap=covered / total if total else 0.0,
                              gb_per_s=nbytes / (total * 1e3) if total and nbytes else None,
                              streams=sorted(s for s in streams if s is not None))
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _covered(busy: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy if x < b and y > a)


def profile_overlap(model: nn.Module, causal: nn.Module, batch: dict) -> dict:
    """One profiled step (after the config's timed steps): copy/compute overlap from the chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels and copies only: a small trace at full depth
        loss_fn(causal, batch).backward()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        return copy_overlap(path)


# --------------------------------------------------------------------------------------------------- the side-by-side
def side_by_side(args: argparse.Namespace, device: str, deadline: float) -> list[dict]:
    """Every config on every (model, tokens), one model build per shape; a failing config gives an error row.

    Each nbkit config is profiled once, at its first (model, tokens): one extra step, whose copy/compute overlap goes
    into that row (``copy_overlap``)."""
    rows: list[dict] = []
    profiled: set[str] = set()
    for shape in args.models:
        if time.monotonic() > deadline:
            rows.append(dict(model=shape, config="all", error="skipped: time budget"))
            continue
        model, causal, build_s = build_qlora(shape, args.layers, device)
        packed, attn_note = attach_attention(model, args.attn)
        layers = len(causal.model.layers)
        print(f"[{shape}] built {layers} layers in {build_s:.1f} s; attention: {attn_note}", flush=True)
        for tokens in args.tokens:
            batch = packed_batch(tokens, causal.config.vocab_size, device)
            n_bytes = tokens * causal.config.hidden_size * 2
            ref = None
            for name in args.configs:
                row = dict(model=shape, layers=layers, full_layers=SHAPES[shape]["num_hidden_layers"], tokens=tokens,
                           config=name, layer_input_mib=n_bytes / 2**20, attention=attn_note)
                if time.monotonic() > deadline:
                    rows.append(dict(row, error="skipped: time budget"))
                    continue
                if name == "ckpt_offload" and device != "cuda":
                    rows.append(dict(row, error=CPU_SKIP))
                    continue
                oc = None
                try:
                    oc = set_config(model, causal, name)
                    res = run_steps(model, causal, batch, args.warmup, args.steps)
                    grads = res.pop("grads")
                    if name == "ckpt":
                        ref = grads
                    if ref is not None:
                        res["grad_rel_diff"] = float((grads - ref).norm() / ref.norm().clamp_min(1e-30))
                        res["grad_bitwise"] = bool(torch.equal(grads, ref))
                    if oc is not None:
                        res["offload_stats"] = oc.stats_dict()
                        res["steps_run"] = args.warmup + args.steps
                    row.update(res)
                    if name.startswith("nbkit") and args.profile and name not in profiled:
                        profiled.add(name)
                        row["copy_overlap"] = profile_overlap(model, causal, batch)
                except Exception as err:  # one config failing must not hide the others
                    if is_oom(err):
                        row["error"] = "OOM"
                    else:
                        traceback.print_exc()
                        row["error"] = f"{type(err).__name__}: {err}"[:200]
                finally:
                    if oc is not None:
                        oc.detach()
                    cleanup(model)
                rows.append(row)
                print(_row_line(row), flush=True)
        if packed is not None:
            packed.detach()
        del model, causal
        cleanup(nn.Module())
    return rows


def _row_line(r: dict) -> str:
    if r.get("error"):
        return f"  {r['model']} {r.get('tokens', '')} {r['config']}: {r['error']}"
    return (f"  {r['model']} {r['tokens']} {r['config']}: {r['step_ms']:.0f} ms, peak {r['peak_gib']:.2f} GiB, "
            f"loss {r['loss']:.4f}, grad diff {r.get('grad_rel_diff', float('nan')):.2e}")


def table(rows: list[dict]) -> str:
    head = ("| model (layers) | tokens | config | step ms | ms/layer | vs ckpt | tok/s | peak GiB | peak - ckpt GiB | "
            "loss | grad rel diff |")
    lines = [head, "|" + "---|" * 11]
    refs = {(r["model"], r.get("tokens")): r for r in rows if r["config"] == "ckpt" and not r.get("error")}
    for r in rows:
        label = f"{r['model']} ({r.get('layers', '?')}/{r.get('full_layers', '?')})"
        if r.get("error"):
            lines.append(f"| {label} | {r.get('tokens', '')} | {r['config']} | {r['error']} |" + " |" * 7)
            continue
        ref = refs.get((r["model"], r["tokens"]))
        rel = f"{r['step_ms'] / ref['step_ms'] - 1:+.1%}" if ref else "-"
        dpeak = f"{r['peak_gib'] - ref['peak_gib']:+.2f}" if ref else "-"
        diff = "bitwise" if r.get("grad_bitwise") else f"{r.get('grad_rel_diff', float('nan')):.1e}"
        lines.append(
            f"| {label} | {r['tokens']:,} | {r['config']} | {r['step_ms']:,.0f} | {r['step_ms'] / r['layers']:,.1f} | "
            f"{rel} | {r['tokens'] / r['step_ms'] * 1000:,.0f} | {r['peak_gib']:.2f} | {dpeak} | {r['loss']:.4f} | "
            f"{diff} |"
        )
    return "\n".join(lines)


def overlap_table(rows: list[dict]) -> str:
    lines = ["| model | tokens | config | D2H copies | D2H ms | D2H under compute | H2D copies | H2D ms | "
             "H2D under compute | GB/s (D2H, H2D) |", "|" + "---|" * 10]
    for o in rows:
        if "copy_overlap" not in o:
            continue
        d, h = o["copy_overlap"]["DtoH"], o["copy_overlap"]["HtoD"]
        bw = ", ".join(f"{x['gb_per_s']:.0f}" if x["gb_per_s"] else "-" for x in (d, h))
        lines.append(f"| {o['model']} | {o['tokens']:,} | {o['config']} | {d['count']} | {d['ms']:.1f} | "
                     f"{d['overlap']:.0%} | {h['count']} | {h['ms']:.1f} | {h['overlap']:.0%} | {bw} |")
    return "\n".join(lines)


def prefetch_table(rows: list[dict]) -> str:
    """nbkit's own timed events, per step: prefetches, the compute they could hide behind, and any wait for them."""
    lines = [("| model | tokens | config | restores | prefetched (after MLP bwd) | copy ms | compute ahead ms | "
              "compute waited ms | copies done in time |"), "|" + "---|" * 9]
    for r in rows:
        s, n = r.get("offload_stats"), r.get("steps_run")
        if not s or not n:
            continue
        timed = "- | - | - | -"  # no CUDA events (CPU) or no prefetch
        if s["prefetch_hits"] and s["copy_ms"]:
            timed = (f"{s['copy_ms'] / n:.1f} | {s['lead_ms'] / n:.1f} | {s['wait_ms'] / n:.2f} | "
                     f"{s['prefetch_hidden'] / s['prefetch_hits']:.0%}")
        lines.append(f"| {r['model']} | {r['tokens']:,} | {r['config']} | {s['unpacks'] / n:.0f} | "
                     f"{s['prefetch_hits'] / n:.0f} ({s['prefetch_after_ffn'] / n:.0f}) | {timed} |")
    return "\n".join(lines)

# ---------------------------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="8b,14b")
    p.add_argument("--tokens", default="16384,32768")
    p.add_argument("--layers", type=int, default=8, help="decoder layers to build (0: the full model)")
    p.add_argument("--configs", default=None, help=f"default: {','.join(CONFIGS)} ({','.join(LONGEST_CONFIGS)} "
                   "with --longest)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--attn", default="auto", choices=["auto", "nbkit", "sdpa"])
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the copy-overlap profile")
    p.add_argument("--budget", type=float, default=170.0, help="seconds; later configs are skipped past it")
    p.add_argument("--longest", action="store_true")
    p.add_argument("--longest-model", default="14b")
    p.add_argument("--longest-layers", type=int, default=0, help="0: the full model")
    p.add_argument("--longest-start", type=int, default=32768, help="first try where no prior applies")
    p.add_argument("--longest-step", type=int, default=8192, help="resolution in tokens (finer for short rows)")
    p.add_argument("--longest-budget", type=float, default=210.0, help="seconds for the search (the build is apart)")
    p.add_argument("--longest-probe", default="peak", choices=["peak", "full"],
                   help="peak: a try's backward stops once past its memory peak (the last --longest-peak-layers "
                   "layers); full: the whole backward")
    p.add_argument("--longest-peak-layers", type=int, default=4)
    p.add_argument("--longest-max", type=int, default=2**20)
    p.add_argument("--longest-fill", type=float, default=0.985, help="predicted peak aims at this share of the GPU")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, 2 layers of 256 tokens")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.configs = (args.configs or ",".join(LONGEST_CONFIGS if args.longest else CONFIGS)).split(",")
    if args.tiny:
        args.models, args.tokens, args.layers, args.profile = ["tiny"], [256], 2, False
        args.longest_model, args.longest_layers, args.longest_start, args.longest_step = "tiny", 2, 256, 128
        args.longest_budget, args.longest_max, args.longest_peak_layers = min(args.longest_budget, 20), 2048, 1
    return args


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Run the side-by-side (or, with ``--longest``, the longest-row search); write and return its rows."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny:
        torch.set_num_threads(2)
    elif device != "cuda":
        raise SystemExit("needs a CUDA GPU (or --tiny for a CPU smoke run)")
    started = time.monotonic()
    if args.longest:
        results = longest(args, device, argv)
        print(f"\nLongest packed row per config ({time.monotonic() - started:.0f} s in all, "
              f"{sum(r['seconds'] for r in results):.0f} s searching; tries: "
              f"{'forward + backward through its peak' if args.longest_probe == 'peak' else 'full steps'}):\n")
        print(longest_table(results))
        return results
    rows = side_by_side(args, device, started + args.budget)
    write_results("offload", rows, argv=argv, notes="CPU smoke run (--tiny)" if args.tiny else "")
    if any("copy_overlap" in r for r in rows):
        print("\nCopy / compute overlap (one profiled step, torch.profiler):\n")
        print(overlap_table(rows))
    if any(r.get("offload_stats") for r in rows):
        print("\nnbkit restores per step (nbkit.speedups.offload's timed CUDA events; 'compute ahead': "
              "compute-stream time from a prefetch's issue to its use):\n")
        print(prefetch_table(rows))
    print(f"\nOffloaded checkpointing, QLoRA, forward+backward per step ({time.monotonic() - started:.0f} s):\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
