"""Offloaded checkpointing benchmark: five ways to hold activations, side by side in one process.

Workload (issue 3): Qwen3-8B- and Qwen3-14B-shaped models with random weights, QLoRA (bitsandbytes nf4 with double
quantization, bf16 compute, LoRA r=16 on all 7 projections), one packed row of 16K / 32K tokens per step from
documents of about 400 tokens, passed like TRL's padding-free collator (position_ids, cu_seq_lens_q/k,
max_length_q/k). Attention: nbkit's packed ("nbkit", varlen) attention when ``nbkit.packing`` is present, else
"sdpa" (a dense T x T block mask; O(T^2), said in the output). The LM head + cross-entropy runs in checkpointed 4K
token chunks in every config, so the decoder stack, not 32K x 152K logits, decides peak memory. A step is forward +
backward (no optimizer: LoRA's AdamW update is ~1 ms and the same in every config).

Configs: ``no_ckpt`` (where it fits), ``ckpt`` (transformers' non-reentrant checkpointing), ``ckpt_offload``
(transformers' ``offload=True``: torch ``save_on_cpu``, copies on the compute stream), ``nbkit_single``,
``nbkit_double`` (nbkit.offload with one / two restore buffers).

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
  depth 4.25 GiB (8B 16K) to 11.9 GiB (14B 32K).
- loss identical across configs (same weights, same batch); LoRA gradients equal to ``ckpt`` up to bf16 kernel order.
- ``--longest`` (14B, 40 layers, varlen): ~700 KB/token with ``ckpt`` (400 KB of layer inputs + ~300 KB working set
  of one layer's backward) -> ~180K tokens in 131 GB; offloaded configs ~300 KB/token on the GPU but 400 KB/token of
  host RAM, so the host (128 GB) caps them near ~250K; ``no_ckpt`` ~12 MB/token -> ~10K.

    python -m nbkit.bench.offload [--models 8b,14b] [--tokens 16384,32768] [--layers 8] [--warmup 1] [--steps 3]
    python -m nbkit.bench.offload --longest [--longest-layers 40] [--longest-budget 300]
    python -m nbkit.bench.offload --tiny      # CPU smoke run of the same code
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

from nbkit.offload import OffloadedCheckpointing

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
            from nbkit.packing import PackedAttention
        except ImportError as err:
            if requested == "nbkit":
                raise
            return None, f"sdpa (dense block mask; nbkit.packing unavailable: {err})"
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

    For each direction: count, total copy ms, the fraction of copy time overlapped by kernels on other streams,
    the copy bandwidth, and the streams the copies ran on.
    """
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("stream"))
               for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    out = {}
    for direction in ("DtoH", "HtoD"):
        sel = [c for c in copies if direction in c.get("name", "")
               and c.get("args", {}).get("bytes", min_bytes) >= min_bytes]
        streams = {c.get("args", {}).get("stream") for c in sel}
        busy = _union([(a, b) for a, b, s in kernels if s not in streams])
        total = sum(c["dur"] for c in sel)
        covered = sum(_covered(busy, c["ts"], c["ts"] + c["dur"]) for c in sel)
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

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
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


# ---------------------------------------------------------------------------------------------------- --longest
def longest(args: argparse.Namespace, device: str) -> list[dict]:
    """Longest packed row that trains (one forward+backward without OOM) per config, 14B QLoRA, bounded time.

    Per config: probe ``--longest-start`` tokens and twice that, then jump to where a linear fit of peak memory
    against tokens reaches 97% of the GPU (at most 4x), and bisect between the longest success and the first OOM
    down to ``--longest-step`` tokens. Each config gets an equal share of what is left of ``--longest-budget``; a
    probe whose predicted time (step time ~ tokens^e, e fitted on the successes, 1 <= e <= 2) does not fit in the
    share is not run, and the result says "time cap".
    """
    model, causal, build_s = build_qlora(args.longest_model, args.longest_layers, device)
    packed, attn_note = attach_attention(model, args.attn)
    capacity = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 64 * GiB
    print(f"[longest] {args.longest_model} x {len(causal.model.layers)} layers built in {build_s:.1f} s; "
          f"attention: {attn_note}", flush=True)
    results = []
    end_all = time.monotonic() + args.longest_budget
    for i, name in enumerate(args.configs):
        deadline = time.monotonic() + (end_all - time.monotonic()) / (len(args.configs) - i)
        probes, lo, hi, stop = [], 0, None, "resolution"
        step = args.longest_step
        t = max(step, args.longest_start // 8 // step * step) if name == "no_ckpt" else args.longest_start
        while True:
            oks = [p for p in probes if p["ok"]]
            if oks and time.monotonic() + _predict_s(oks, t) > deadline:
                stop = "time cap"
                break
            try:
                ok, secs, peak = _probe(model, causal, name, t, device)
            except Exception as err:  # not an OOM: report it, go on with the next config
                traceback.print_exc()
                stop = f"{type(err).__name__}: {err}"[:120]
                break
            probes.append(dict(tokens=t, ok=ok, s=secs, peak_gib=peak / GiB))
            print(f"  {name} {t:,} tokens: {'ok' if ok else 'OOM'} in {secs:.1f} s, peak {peak / GiB:.1f} GiB",
                  flush=True)
            lo, hi = (t, hi) if ok else (lo, t)
            if hi is None:
                oks = [p for p in probes if p["ok"]]
                nxt = 2 * t
                if len(oks) >= 2:
                    a, b = oks[-2], oks[-1]
                    slope = (b["peak_gib"] - a["peak_gib"]) / max(1, b["tokens"] - a["tokens"])
                    if slope > 0:
                        guess = b["tokens"] + (0.97 * capacity / GiB - b["peak_gib"]) / slope
                        nxt = min(4 * t, max(int(1.25 * t), int(guess)))
                t = max(step, nxt // step * step)
            else:
                t = (lo + hi) // 2 // step * step
                if hi - lo <= step or t <= lo:
                    break
        results.append(dict(config=name, longest_tokens=lo, first_oom_tokens=hi, stopped_by=stop, probes=probes,
                            layers=len(causal.model.layers), model=args.longest_model, attention=attn_note))
    if packed is not None:
        packed.detach()
    return results


def _predict_s(oks: list[dict], tokens: int) -> float:
    """Seconds a probe of ``tokens`` should take: time ~ tokens^e fitted on the last two successes."""
    import math

    b = max(oks, key=lambda p: p["tokens"])
    e = 1.5
    if len(oks) >= 2:
        a = sorted(oks, key=lambda p: p["tokens"])[-2]
        if b["tokens"] > a["tokens"] and a["s"] > 0 and b["s"] > 0:
            e = min(2.0, max(1.0, math.log(b["s"] / a["s"]) / math.log(b["tokens"] / a["tokens"])))
    return b["s"] * (tokens / b["tokens"]) ** e


def _probe(model: nn.Module, causal: nn.Module, name: str, tokens: int, device: str) -> tuple[bool, float, int]:
    oc, ok = None, True
    t0 = time.perf_counter()
    try:
        oc = set_config(model, causal, name)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        batch = packed_batch(tokens, causal.config.vocab_size, device)
        loss_fn(causal, batch).backward()
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as err:
        if not _is_oom(err):
            raise
        ok = False
    finally:
        if oc is not None:
            oc.detach()
        peak = peak_memory()
        _cleanup(model)
    return ok, time.perf_counter() - t0, peak


def longest_table(results: list[dict]) -> str:
    lines = ["| model (layers) | config | longest that trains | first OOM | stopped by | probes |", "|" + "---|" * 6]
    for r in results:
        oom = f"{r['first_oom_tokens']:,}" if r["first_oom_tokens"] else "-"
        lines.append(f"| {r['model']} ({r['layers']}) | {r['config']} | {r['longest_tokens']:,} | {oom} | "
                     f"{r['stopped_by']} | {len(r['probes'])} |")
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
    p.add_argument("--longest-start", type=int, default=32768)
    p.add_argument("--longest-step", type=int, default=4096)
    p.add_argument("--longest-budget", type=float, default=300.0)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, 2 layers of 256 tokens")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.configs = (args.configs or ",".join(LONGEST_CONFIGS if args.longest else CONFIGS)).split(",")
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny:
        args.models, args.tokens, args.layers, args.profile = ["tiny"], [256], 2, False
        args.longest_model, args.longest_layers, args.longest_start, args.longest_step = "tiny", 2, 256, 128
        args.longest_budget = min(args.longest_budget, 20)
        torch.set_num_threads(2)
    elif device != "cuda":
        raise SystemExit("needs a CUDA GPU (or --tiny for a CPU smoke run)")
    started = time.monotonic()
    payload: dict[str, Any] = dict(env=environment(), args=vars(args))
    if args.longest:
        results = longest(args, device)
        payload["longest"] = results
        write_results("offload_longest", payload)
        print(f"\nLongest packed row that trains ({time.monotonic() - started:.0f} s):\n")
        print(longest_table(results))
        return
    rows, overlaps, _ = side_by_side(args, device, started + args.budget)
    payload.update(rows=rows, overlap=overlaps)
    write_results("offload", payload)
    if overlaps:
        print("\nCopy / compute overlap (one profiled step, torch.profiler):\n")
        print(overlap_table(overlaps))
    print(f"\nOffloaded checkpointing, QLoRA, forward+backward per step ({time.monotonic() - started:.0f} s):\n")
    print(table(rows))


if __name__ == "__main__":
    main()
