"""Offloaded checkpointing benchmark: five ways to hold activations, side by side in one process.

Workload (issue 3): Qwen3-8B- and Qwen3-14B-shaped models with random weights, QLoRA (bitsandbytes nf4 with double
quantization, bf16 compute, LoRA r=16 on all 7 projections), one packed row of 16K / 32K tokens per step from
documents of about 400 tokens, passed like TRL's padding-free collator (position_ids, cu_seq_lens_q/k,
max_length_q/k). Attention: nbkit's packed ("nbkit", varlen) attention when ``nbkit.speedups.packed_attention`` is present, else
"sdpa" (a dense T x T block mask; O(T^2), said in the output). The LM head + cross-entropy runs in checkpointed 4K
token chunks in every config, so the decoder stack, not 32K x 152K logits, decides peak memory. A step is forward +
backward (no optimizer: LoRA's AdamW update is ~1 ms and the same in every config).

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

Layer time: 2 x params x tokens FLOP at ~550 TFLOP/s (4-bit dequant + bf16 GEMM, 70% of the 779 measured) plus
~30% for LoRA (fp32 casts), norms, RoPE, SwiGLU; varlen attention is <1 ms per layer at 16K (FACTS.md). Backward of a
frozen 4-bit base is dgrad only (~1x forward) plus the recompute (1x forward). With "sdpa" (dense mask) add ~15 ms
(8B) / ~19 ms (14B) of attention forward per layer at 16K and 4x that at 32K, which shrinks every ratio below.

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
- ``--longest`` (14B, 40 layers, varlen): ~700 KB/token with ``ckpt`` (400 KB of layer inputs + ~300 KB working set
  of one layer's backward) -> ~180K tokens in 131 GB; offloaded configs ~300 KB/token on the GPU but 400 KB/token of
  host RAM, so the host (128 GB) caps them near ~250K; ``no_ckpt`` ~12 MB/token -> ~10K. Measured (time-capped):
  no_ckpt 8,192 (12,288 OOM); ckpt >= 143,360 (0.86 MB/token); ckpt_offload >= 65,536; nbkit_double 155,648
  (0.52 MB/token; 249,856 failed with part of its inputs kept on the GPU; most likely because the host check did not
  count the 40-60 GiB of pinned blocks save_on_cpu's tries had left in torch's host cache). Revised: ckpt ~147K and
  nbkit_double ~250K (GPU-bound); ckpt_offload ~205K, host-bound: torch pins each input in a power-of-two block,
  40 x 2 GiB up to 209,715 tokens and 40 x 4 GiB (more than the host has) past it. The search takes ~3.5 min of
  tries ('peak' tries: forward + the backward of the last 4 layers) on the H200; ~5.5 min with full steps.

    python -m benchmarks.offload [--models 8b,14b] [--tokens 16384,32768] [--layers 8] [--warmup 1] [--steps 3]
    python -m benchmarks.offload --models 8b --tokens 16384,32768 --layers 0     # full depth, ~3 min
    python -m benchmarks.offload --longest [--longest-budget 210] [--longest-probe peak|full]
    python -m benchmarks.offload --tiny [--longest]     # CPU smoke runs of the same code
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
import traceback
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nbkit.ops.offload_lanes import release_host_cache
from nbkit.speedups.offload import OffloadedCheckpointing

from .common import environment, event, peak_memory, write_results

COMMON = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=False, head_dim=128)
SHAPES = {
    "8b": dict(COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8),
    "14b": dict(COMMON, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=8),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = ("ckpt", "ckpt_offload", "nbkit_single", "nbkit_double", "no_ckpt")  # ckpt first: the reference
LONGEST_CONFIGS = ("no_ckpt", "ckpt", "ckpt_offload", "nbkit_double")
GiB = 2**30
CPU_SKIP = "skipped on CPU (save_on_cpu pins host memory, which needs CUDA)"


# ------------------------------------------------------------------------------------------------------- the model
def _nf4(lin: nn.Linear) -> nn.Module:
    """bitsandbytes nf4 (double quant, bf16 compute) copy of ``lin``, quantized where its weight lives."""
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                          compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                 module=q).to(lin.weight.device)
    if lin.bias is not None:
        q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
    return q


def build_qlora(shape: str, layers: int, device: str, seed: int = 0, overrides: Optional[dict] = None):
    """Random-weight QLoRA model: built in bf16 on ``device``, each decoder Linear swapped for nf4 layer by layer.

    Returns (peft_model, causal_lm, seconds). Building in bf16 first needs the bf16 size transiently (~30 GB for 14B,
    fine on an H200); quantizing is one kernel per Linear.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    t0 = time.perf_counter()
    cfg = dict(SHAPES[shape], **(overrides or {}))
    if layers:
        cfg["num_hidden_layers"] = layers
    config = Qwen3Config(**cfg, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        causal = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for layer in causal.model.layers:
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, nn.Linear):
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent), attr, _nf4(mod))
    causal.requires_grad_(False)
    causal.is_loaded_in_4bit = True  # PEFT then wraps the Linear4bit layers with its bnb LoRA layers
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(causal, lora)
    model.train()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return model, causal, time.perf_counter() - t0


def attach_attention(model: nn.Module, requested: str) -> tuple[Any, str]:
    """nbkit's packed attention when available (and not overridden), else plain "sdpa" (dense block mask)."""
    if requested in ("auto", "nbkit"):
        try:
            from nbkit.speedups.packed_attention import PackedAttention
        except ImportError as err:
            if requested == "nbkit":
                raise
            return None, f"sdpa (dense block mask; nbkit.speedups.packed_attention unavailable: {err})"
        packed = PackedAttention("auto")
        if packed.attach(model):
            return packed, f"nbkit ({packed.kernel} kernel)"
    return None, "sdpa (dense T x T block mask: O(T^2) time and memory)"


# ------------------------------------------------------------------------------------------------------- the batch
def packed_batch(tokens: int, vocab: int, device: str, seed: int = 0, mean_len: int = 400, spread: int = 100) -> dict:
    """One padding-free row like TRL's collator: documents of ~400 tokens, labels -100 at each document start."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(mean_len - spread, mean_len + spread), tokens - sum(lengths)))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (1, tokens), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[pos == 0] = -100
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    return dict(input_ids=ids.to(device), labels=labels.to(device), position_ids=pos.to(device),
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
                nbkit_cu_seqlens_host=tuple(offsets))


def _ce_sum(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100, reduction="sum")


def loss_fn(causal: nn.Module, batch: dict, chunk: int = 4096) -> torch.Tensor:
    """Next-token loss; the LM head + CE in checkpointed chunks (never the full T x vocab logits)."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = causal.model(**kwargs, use_cache=False).last_hidden_state[0, :-1]
    target = batch["labels"][0, 1:]
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(_ce_sum, hidden[s:s + chunk], target[s:s + chunk], causal.lm_head.weight,
                                   use_reentrant=False)
    return total / (target != -100).sum()


# ------------------------------------------------------------------------------------------------------ the configs
def set_config(model: nn.Module, causal: nn.Module, name: str) -> Optional[OffloadedCheckpointing]:
    """Put the model in one config; returns the OffloadedCheckpointing to detach afterwards (nbkit configs)."""
    if name == "no_ckpt":
        causal.gradient_checkpointing_disable()
        return None
    causal.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False},
                                         offload=name == "ckpt_offload")
    if name.startswith("nbkit"):
        oc = OffloadedCheckpointing(mode=True, double_buffer=name == "nbkit_double")
        if not oc.attach(model):
            raise RuntimeError("OffloadedCheckpointing.attach returned False")
        return oc
    return None


def _is_oom(err: BaseException) -> bool:
    """torch's OOM, or a library (cuBLAS, bitsandbytes) failing to allocate at the memory edge."""
    text = str(err)
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _cleanup(model: nn.Module) -> None:
    for p in _trainable(model):
        p.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_steps(model: nn.Module, causal: nn.Module, batch: dict, warmup: int, steps: int) -> dict:
    """Timed forward+backward steps (CUDA events, median after warmup); peak over all of them; LoRA grads kept."""
    params = _trainable(model)
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
def side_by_side(args: argparse.Namespace, device: str, deadline: float) -> tuple[list[dict], list[dict], str]:
    rows, overlaps, attn_note = [], [], ""
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
                    if name.startswith("nbkit") and args.profile and not any(
                            o["config"] == name for o in overlaps):
                        ov = profile_overlap(model, causal, batch)
                        overlaps.append(dict(model=shape, tokens=tokens, config=name, **ov))
                except Exception as err:  # one config failing must not hide the others
                    if _is_oom(err):
                        row["error"] = "OOM"
                    else:
                        traceback.print_exc()
                        row["error"] = f"{type(err).__name__}: {err}"[:200]
                finally:
                    if oc is not None:
                        oc.detach()
                    _cleanup(model)
                rows.append(row)
                print(_row_line(row), flush=True)
        if packed is not None:
            packed.detach()
        del model, causal
        _cleanup(nn.Module())
    return rows, overlaps, attn_note


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


def overlap_table(overlaps: list[dict]) -> str:
    lines = ["| model | tokens | config | D2H copies | D2H ms | D2H under compute | H2D copies | H2D ms | "
             "H2D under compute | GB/s (D2H, H2D) |", "|" + "---|" * 10]
    for o in overlaps:
        d, h = o["DtoH"], o["HtoD"]
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


# ---------------------------------------------------------------------------------------------------- --longest
# First guesses for the search on the H200 (14B QLoRA, 40 layers, nbkit varlen attention), from the run of 2026-11-29
# (notes/offload_longest.json): a length that trained, its peak GiB, and peak GiB per extra token; nbkit_double's less
# the second restore buffer it no longer holds at the peak (10 KB/token). Guesses only: every bound the search reports
# is measured in the run itself.
PRIORS_14B_40 = {
    "no_ckpt": (8192, 135.04, 0.01448),
    "ckpt": (143360, 132.22, 0.000856),
    "ckpt_offload": (65536, 42.11, 0.000493),
    "nbkit_double": (155648, 89.30 - 155648 * 10240 / 2**30, 0.000517 - 10240 / 2**30),
}
PIN_S_PER_GIB = {"ckpt_offload": 0.6, "nbkit_double": 0.25, "nbkit_single": 0.25}  # first touch of pinned memory there
HOST_RESERVE = 4 * GiB  # host memory left to everything else (as nbkit.speedups.offload does)


class _PeakPassed(Exception):
    """Raised from a gradient hook once the backward is past its memory peak (``--longest-probe peak``)."""


class _TryTimeCap(Exception):
    """Raised from a layer's forward pre-hook when a try runs past its deadline."""


def _raise_peak_passed(grad: torch.Tensor) -> None:
    raise _PeakPassed


def host_need(name: str, layers: int, tokens: int, hidden: int) -> int:
    """Host bytes a config needs for the checkpointed layer inputs of one step."""
    n = tokens * hidden * 2
    if name == "ckpt_offload":  # torch's pinned allocator rounds every block up to a power of two
        return layers * (1 << max(0, n - 1).bit_length())
    return layers * n if name.startswith("nbkit") else 0


def host_limit_tokens(name: str, layers: int, hidden: int, room: int) -> Optional[int]:
    """The longest row whose layer inputs fit in ``room`` host bytes (None: the config keeps nothing on the host)."""
    if name == "ckpt_offload":
        per = room // layers
        return (1 << (per.bit_length() - 1)) // (hidden * 2) if per > 0 else 0
    return room // (layers * hidden * 2) if name.startswith("nbkit") else None


def _host_room() -> int:
    from nbkit.ops.offload_lanes import host_available

    avail = host_available()
    return (avail if avail is not None else 2**50) - HOST_RESERVE


def _failure_kind(err: BaseException) -> Optional[str]:
    """'CUDA OOM' or 'host RAM' for an allocation failure, None for anything else."""
    text = str(err)
    if isinstance(err, torch.OutOfMemoryError):
        return "CUDA OOM"
    if "DefaultCPUAllocator" in text or "can't allocate memory" in text:
        return "host RAM"
    if _is_oom(err):  # a pinned host allocation (save_on_cpu's pack hook) fails with the same CUDA error text
        frames = traceback.extract_tb(err.__traceback__)
        return "host RAM" if any(f.name == "pack_to_cpu" for f in frames) else "CUDA OOM"
    return None


def _probe(model: nn.Module, causal: nn.Module, name: str, tokens: int, device: str,
           oc: Optional[OffloadedCheckpointing], args: argparse.Namespace, deadline: float) -> dict:
    """One try: forward and backward of one packed row (in 'peak' mode the backward stops after its peak)."""
    layers = causal.model.layers
    handles = []

    def check_time(module: nn.Module, inputs: tuple) -> None:
        if time.monotonic() > deadline:
            raise _TryTimeCap

    handles += [layer.register_forward_pre_hook(check_time) for layer in layers]
    if args.longest_probe == "peak" and 0 < args.longest_peak_layers < len(layers):
        armed = [True]

        def arm(module: nn.Module, inputs: tuple, kwargs: dict) -> None:
            x = inputs[0] if inputs else kwargs.get("hidden_states")
            if armed[0] and isinstance(x, torch.Tensor) and x.requires_grad:
                armed[0] = False  # the forward's call, not the recompute's
                x.register_hook(_raise_peak_passed)  # its gradient: the last `peak_layers` layers are done

        handles.append(layers[len(layers) - args.longest_peak_layers].register_forward_pre_hook(arm, with_kwargs=True))
    room = _host_room()
    short = oc.stats.host_short if oc is not None else 0
    outcome, kind = "ok", None
    t0 = time.perf_counter()
    try:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        batch = packed_batch(tokens, causal.config.vocab_size, device)
        loss_fn(causal, batch).backward()
    except _PeakPassed:
        pass  # the remaining layers repeat this pattern (offloaded) or hold fewer saved inputs (plain checkpointing)
    except _TryTimeCap:
        outcome = "time cap"
    except Exception as err:  # noqa: BLE001 - classified; anything but an allocation failure is re-raised
        kind = _failure_kind(err)
        if kind is None:
            raise
        outcome = "failed"
    finally:
        for h in handles:
            h.remove()
        if device == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        peak = peak_memory()
        if oc is not None:
            oc.reset()
        _cleanup(model)
    short = (oc.stats.host_short - short) if oc is not None else 0
    if outcome == "failed" and short:
        kind = f"{kind} ({short} layer inputs kept on the GPU: host RAM short)"
    return dict(tokens=tokens, outcome=outcome, kind=kind, s=secs, peak_gib=peak / GiB, host_room_gib=room / GiB,
                host_need_gib=host_need(name, len(layers), tokens, causal.config.hidden_size) / GiB,
                host_short=short)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _predict_max(probes: list[dict], cap: Optional[float], prior: Optional[tuple]) -> Optional[float]:
    """Tokens where peak memory reaches ``cap`` GiB: a line through the longest successes (or one and the prior's
    slope, or the prior alone). Successes that kept layer inputs on the GPU (host short) are left out."""
    if cap is None:
        return None
    oks = sorted((p for p in probes if p["outcome"] == "ok" and not p["host_short"] and p["peak_gib"] > 0),
                 key=lambda p: p["tokens"])
    slope = prior[2] if prior else None
    if len(oks) >= 2 and oks[-1]["tokens"] >= 1.1 * oks[-2]["tokens"]:
        a, b = oks[-2], oks[-1]
        slope = (b["peak_gib"] - a["peak_gib"]) / (b["tokens"] - a["tokens"])
    point = (oks[-1]["tokens"], oks[-1]["peak_gib"]) if oks else (prior[:2] if prior else None)
    if point is None or not slope or slope <= 0:
        return None
    return point[0] + (cap - point[1]) / slope


def _next_try(lo: int, hi: Optional[int], res: int, pred: Optional[float],
              limit: Optional[int] = None) -> Optional[int]:
    """The next length: just past the predicted limit while nothing failed (then just under it: a pinned pool sized
    by the longer try is reused), inside (lo, hi) on a ``res`` grid once both are known; None once hi - lo <= res.
    Without a prediction: doubling. ``limit``: the host-RAM limit, which caps both."""
    def snap(x: float) -> int:
        return max(res, int(x) // res * res)

    if limit is not None:
        pred = min(pred, limit) if pred is not None else (limit if hi is None and 2 * max(lo, res) > limit else None)

    if hi is None:
        t = snap(pred) + res if pred else 2 * max(lo, res)
        return max(t, lo + res) if not lo else min(max(t, lo + res), 4 * lo)
    if lo and hi - lo <= res:
        return None
    if not lo:  # failures only
        t = min(snap(pred) if pred and pred < hi else snap(hi // 2), hi - res)
        return t if t >= res and t < hi else None
    inside = pred is not None and lo + res <= pred < hi  # else a try refuted the line: halve instead
    t = snap(pred) if inside else snap((lo + hi) // 2)
    return min(max(t, lo + res), hi - res)


def _eta(run_probes: list[dict], name: str, tokens: int, layers: int, hidden: int, pinned: int) -> Optional[float]:
    """Seconds a try should take: the best seconds-per-token of this run's successes, plus first-touch pinning."""
    rates = [p["s"] / p["tokens"] for p in run_probes if p["outcome"] == "ok" and p["tokens"]]
    if not rates:
        return None
    extra = max(0, host_need(name, layers, tokens, hidden) - pinned) / GiB * PIN_S_PER_GIB.get(name, 0.0)
    return min(rates) * tokens + extra


def _search(model: nn.Module, causal: nn.Module, name: str, args: argparse.Namespace, device: str,
            cap: Optional[float], deadline: float, run_probes: list[dict]) -> dict:
    layers, hidden = len(causal.model.layers), causal.config.hidden_size
    priors = PRIORS_14B_40 if (device == "cuda" and args.longest_model == "14b" and layers == 40
                               and "H200" in torch.cuda.get_device_name()) else {}
    prior = priors.get(name)
    probes: list[dict] = []
    lo, hi, hi_kind, stop, started = 0, None, None, "converged", time.monotonic()
    oc = set_config(model, causal, name)
    bucket = None
    try:
        limit = host_limit_tokens(name, layers, hidden, _host_room())
        pred = _predict_max(probes, cap, prior)
        guess = pred if pred is not None else (args.longest_start // 8 if name == "no_ckpt" else args.longest_start)
        if limit is not None:
            guess = min(guess, limit)
        res = max(args.longest_step // 8, min(args.longest_step, _pow2_floor(int(guess) // 4)))
        t = _next_try(0, None, res, pred, limit) if pred is not None else max(res, int(guess) // res * res)
        while t is not None:
            if t > args.longest_max:
                stop = f"--longest-max {args.longest_max:,}"
                break
            room = _host_room() + (oc.stats.host_bytes if oc is not None else 0)
            if name == "ckpt_offload" and host_need(name, layers, t, hidden) > room:
                # torch's pinned allocator does not check: past the host's RAM the kernel's OOM killer ends the run
                probes.append(dict(tokens=t, outcome="failed", kind="host RAM (predicted, not run)", s=0.0,
                                   peak_gib=0.0, host_room_gib=room / GiB, host_short=0,
                                   host_need_gib=host_need(name, layers, t, hidden) / GiB))
            else:
                need = host_need(name, layers, t, hidden)  # a pool that must grow re-pins all of its slots
                reuse = (oc is not None and oc.stats.host_bytes >= need) or (
                    name == "ckpt_offload" and bucket == 1 << max(0, t * hidden * 2 - 1).bit_length())
                eta = _eta(run_probes, name, t, layers, hidden, need if reuse else 0)
                if eta is not None and time.monotonic() + eta > deadline:
                    stop = f"time cap (next try {t:,} tokens: ~{eta:.0f} s)"
                    break
                if name == "ckpt_offload":
                    nb = 1 << max(0, t * hidden * 2 - 1).bit_length()
                    if bucket is not None and nb != bucket:
                        release_host_cache()  # the cached blocks are the wrong size: give them back first
                    bucket = nb
                probes.append(_probe(model, causal, name, t, device, oc, args, deadline))
                run_probes.append(probes[-1])
            p = probes[-1]
            print(f"  {name} {t:,} tokens: {p['outcome']}{' (' + p['kind'] + ')' if p['kind'] else ''} in "
                  f"{p['s']:.1f} s, peak {p['peak_gib']:.1f} GiB, host {p['host_need_gib']:.0f}/"
                  f"{p['host_room_gib']:.0f} GiB", flush=True)
            if p["outcome"] == "time cap":
                stop = "time cap (try cut)"
                break
            if p["outcome"] == "ok":
                lo = max(lo, t)
            elif hi is None or t < hi:
                hi, hi_kind = t, p["kind"]
            limit = host_limit_tokens(name, layers, hidden, _host_room() + (oc.stats.host_bytes if oc else 0))
            t = _next_try(lo, hi, res, _predict_max(probes, cap, prior), limit)
        if stop == "converged" and not (lo and hi):
            stop = "nothing fits" if not lo else stop
    finally:
        if oc is not None:
            oc.detach()
        release_host_cache()
        _cleanup(model)
    limited = ("time budget" if stop.startswith("time cap") else "--longest-max" if stop.startswith("--") else
               "host RAM" if hi_kind and "host RAM" in hi_kind else "GPU memory" if hi_kind else "-")
    return dict(config=name, longest_tokens=lo, first_failed_tokens=hi, failed_by=hi_kind, limited_by=limited,
                resolution=res, stopped_by=stop, probes=probes, seconds=time.monotonic() - started,
                gpu_cap_gib=cap)


def longest(args: argparse.Namespace, device: str) -> list[dict]:
    """Longest packed row per config (14B QLoRA, all 40 layers): one model, a bounded search per config.

    Per config: the first try is just past the predicted limit (from a peak-memory line: measured successes, else
    the H200 priors above, capped by host RAM for the offloaded configs), then just under it; then model-guided
    bisection inside (longest success, first failure) down to ``res`` tokens (``--longest-step``, finer for short
    rows). ``ckpt_offload`` lengths whose power-of-two pinned blocks do not fit in host RAM are failures predicted
    without running. Each config gets an equal share of what is left of ``--longest-budget``; a try predicted not to
    fit is skipped, a try running past it is cut ("time cap"). Results are written after each config.
    """
    from nbkit.ops.offload_lanes import host_available

    model, causal, build_s = build_qlora(args.longest_model, args.longest_layers, device)
    packed, attn_note = attach_attention(model, args.attn)
    set_config(model, causal, "ckpt")  # one short step first: kernels and libraries warm, so tries time the work
    loss_fn(causal, packed_batch(min(args.longest_start, 2048), causal.config.vocab_size, device)).backward()
    cap = None
    _cleanup(model)
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        cap = (free + torch.cuda.memory_reserved()) / GiB * args.longest_fill
    info = _meminfo_gib()
    print(f"[longest] {args.longest_model} x {len(causal.model.layers)} layers built in {build_s:.1f} s; attention: "
          f"{attn_note}; GPU target {cap or 0:.1f} GiB; host {info} (usable {(host_available() or 0) / GiB:.1f} GiB)",
          flush=True)
    results: list[dict] = []
    run_probes: list[dict] = []
    end_all = time.monotonic() + args.longest_budget
    for i, name in enumerate(args.configs):
        if name == "ckpt_offload" and device != "cuda":
            print(f"  {name}: {CPU_SKIP}")
            continue
        deadline = time.monotonic() + (end_all - time.monotonic()) / (len(args.configs) - i)
        r = _search(model, causal, name, args, device, cap, deadline, run_probes)
        r.update(layers=len(causal.model.layers), model=args.longest_model, attention=attn_note,
                 probe=args.longest_probe, peak_layers=args.longest_peak_layers)
        results.append(r)
        write_results("offload_longest", dict(env=environment(), args=vars(args), host=info, longest=results))
    if packed is not None:
        packed.detach()
    return results


def _meminfo_gib() -> dict:
    """Host memory as the kernel shows it, and the RAM its zones hold (initialized or not: a lazily growing VM)."""
    from nbkit.memory import meminfo as _meminfo

    m = _meminfo()
    out = {k: round(m[k] / GiB, 1) for k in ("MemTotal", "MemFree", "MemAvailable", "Mlocked") if k in m}
    try:
        with open("/proc/zoneinfo") as f:
            rows = [line.split() for line in f]
        for key in ("present", "managed"):
            out[f"zones_{key}"] = round(sum(int(r[1]) for r in rows if r[:1] == [key]) * 4096 / GiB, 1)
    except (OSError, ValueError, IndexError):
        pass
    return out


def longest_table(results: list[dict]) -> str:
    what = "fits (fwd + bwd past its peak)" if results and results[0]["probe"] == "peak" else "trains"
    lines = [f"| model (layers) | config | longest that {what} | smallest that failed | failed by | limited by | "
             "resolution | tries (s) |", "|" + "---|" * 8]
    for r in results:
        oom = f"{r['first_failed_tokens']:,}" if r["first_failed_tokens"] else "-"
        ran = [p for p in r["probes"] if p["s"] > 0]
        limited = r["limited_by"] if r["stopped_by"] == "converged" else r["stopped_by"]
        secs = sum(p["s"] for p in ran)
        lines.append(f"| {r['model']} ({r['layers']}) | {r['config']} | {r['longest_tokens']:,} | {oom} | "
                     f"{r['failed_by'] or '-'} | {limited} | {r['resolution']:,} | {len(ran)} ({secs:.0f}) |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
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
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny:
        args.models, args.tokens, args.layers, args.profile = ["tiny"], [256], 2, False
        args.longest_model, args.longest_layers, args.longest_start, args.longest_step = "tiny", 2, 256, 128
        args.longest_budget, args.longest_max, args.longest_peak_layers = min(args.longest_budget, 20), 2048, 1
        torch.set_num_threads(2)
    elif device != "cuda":
        raise SystemExit("needs a CUDA GPU (or --tiny for a CPU smoke run)")
    started = time.monotonic()
    payload: dict[str, Any] = dict(env=environment(), args=vars(args))
    if args.longest:
        results = longest(args, device)
        payload.update(host=_meminfo_gib(), longest=results)
        write_results("offload_longest", payload)
        print(f"\nLongest packed row per config ({time.monotonic() - started:.0f} s in all, "
              f"{sum(r['seconds'] for r in results):.0f} s searching; tries: "
              f"{'forward + backward through its peak' if args.longest_probe == 'peak' else 'full steps'}):\n")
        print(longest_table(results))
        return
    rows, overlaps, _ = side_by_side(args, device, started + args.budget)
    payload.update(rows=rows, overlap=overlaps)
    write_results("offload", payload)
    if overlaps:
        print("\nCopy / compute overlap (one profiled step, torch.profiler):\n")
        print(overlap_table(overlaps))
    if any(r.get("offload_stats") for r in rows):
        print("\nnbkit restores per step (nbkit.speedups.offload's timed CUDA events; 'compute ahead': compute-stream time from "
              "a prefetch's issue to its use):\n")
        print(prefetch_table(rows))
    print(f"\nOffloaded checkpointing, QLoRA, forward+backward per step ({time.monotonic() - started:.0f} s):\n")
    print(table(rows))


if __name__ == "__main__":
    main()
