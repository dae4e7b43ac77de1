"""The longest packed row each checkpointing config can take: a bounded search per config, on one model.

``python -m benchmarks.offload --longest`` runs it (the workload of ``benchmarks.offload_workload``: 14B QLoRA, all
40 layers, nbkit's varlen attention). A try is one packed row, forward and backward ('peak' tries stop the backward
once past its memory peak, after the last ``--longest-peak-layers`` layers); it fails by a CUDA OOM or by host RAM
(classified by ``failure_kind``). ``next_try`` picks the next length from a peak-memory line (``predict_max``) and the
host-RAM limit (``host_limit_tokens``); the search stops when it has bracketed the limit to the resolution, or at
its time budget.

Prediction (written before the first run; 14B, 40 layers, varlen): ~700 KB/token with ``ckpt`` (400 KB of layer
inputs + ~300 KB working set of one layer's backward) -> ~180K tokens in 131 GB; offloaded configs ~300 KB/token on
the GPU but 400 KB/token of host RAM, so the host (128 GB) caps them near ~250K; ``no_ckpt`` ~12 MB/token -> ~10K.
Measured (time-capped): no_ckpt 8,192 (12,288 OOM); ckpt >= 143,360 (0.86 MB/token); ckpt_offload >= 65,536;
nbkit_double 155,648 (0.52 MB/token; 249,856 failed with part of its inputs kept on the GPU; most likely because the
host check did not count the 40-60 GiB of pinned blocks save_on_cpu's tries had left in torch's host cache). Revised:
ckpt ~147K and nbkit_double ~250K (GPU-bound); ckpt_offload ~205K, host-bound: torch pins each input in a
power-of-two block, 40 x 2 GiB up to 209,715 tokens and 40 x 4 GiB (more than the host has) past it. The search takes
~3.5 min of tries ('peak' tries: forward + the backward of the last 4 layers) on the H200; ~5.5 min with full steps.
"""

from __future__ import annotations

import argparse
import time
import traceback
from typing import Optional

import torch
from torch import nn

from nbkit.memory import GiB, device_memory, meminfo
from nbkit.ops.offload_lanes import release_host_cache
from nbkit.speedups.offload import OffloadedCheckpointing

from .common import peak_memory, write_results
from .offload_workload import (
    CPU_SKIP,
    attach_attention,
    build_qlora,
    cleanup,
    is_oom,
    loss_fn,
    packed_batch,
    set_config,
)

LONGEST_CONFIGS = ("no_ckpt", "ckpt", "ckpt_offload", "nbkit_double")

# First guesses for the search on the H200 (14B QLoRA, 40 layers, nbkit varlen attention), from the full-step search
# in benchmarks/results/offload_longest_full_steps.json: a length that trained, its peak GiB, and peak GiB per extra
# token; nbkit_double's less the second restore buffer it no longer holds at the peak (10 KB/token). Guesses only:
# every bound the search reports is measured in the run itself.
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


def failure_kind(err: BaseException) -> Optional[str]:
    """'CUDA OOM' or 'host RAM' for an allocation failure, None for anything else."""
    text = str(err)
    if isinstance(err, torch.OutOfMemoryError):
        return "CUDA OOM"
    if "DefaultCPUAllocator" in text or "can't allocate memory" in text:
        return "host RAM"
    if is_oom(err):  # a pinned host allocation (save_on_cpu's pack hook) fails with the same CUDA error text
        frames = traceback.extract_tb(err.__traceback__)
        return "host RAM" if any(f.name == "pack_to_cpu" for f in frames) else "CUDA OOM"
    return None


def probe(model: nn.Module, causal: nn.Module, name: str, tokens: int, device: str,
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
    except Exception as err:  # classified: anything but an allocation failure is re-raised
        kind = failure_kind(err)
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
        cleanup(model)
    short = (oc.stats.host_short - short) if oc is not None else 0
    if outcome == "failed" and short:
        kind = f"{kind} ({short} layer inputs kept on the GPU: host RAM short)"
    return dict(tokens=tokens, outcome=outcome, kind=kind, s=secs, peak_gib=peak / GiB, host_room_gib=room / GiB,
                host_need_gib=host_need(name, len(layers), tokens, causal.config.hidden_size) / GiB,
                host_short=short)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def predict_max(probes: list[dict], cap: Optional[float], prior: Optional[tuple]) -> Optional[float]:
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


def next_try(lo: int, hi: Optional[int], res: int, pred: Optional[float],
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
        pred = predict_max(probes, cap, prior)
        guess = pred if pred is not None else (args.longest_start // 8 if name == "no_ckpt" else args.longest_start)
        if limit is not None:
            guess = min(guess, limit)
        res = max(args.longest_step // 8, min(args.longest_step, _pow2_floor(int(guess) // 4)))
        t = next_try(0, None, res, pred, limit) if pred is not None else max(res, int(guess) // res * res)
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
                probes.append(probe(model, causal, name, t, device, oc, args, deadline))
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
            t = next_try(lo, hi, res, predict_max(probes, cap, prior), limit)
        if stop == "converged" and not (lo and hi):
            stop = "nothing fits" if not lo else stop
    finally:
        if oc is not None:
            oc.detach()
        release_host_cache()
        cleanup(model)
    limited = ("time budget" if stop.startswith("time cap") else "--longest-max" if stop.startswith("--") else
               "host RAM" if hi_kind and "host RAM" in hi_kind else "GPU memory" if hi_kind else "-")
    return dict(config=name, longest_tokens=lo, first_failed_tokens=hi, failed_by=hi_kind, limited_by=limited,
                resolution=res, stopped_by=stop, probes=probes, seconds=time.monotonic() - started,
                gpu_cap_gib=cap)


def longest(args: argparse.Namespace, device: str, argv: list[str]) -> list[dict]:
    """Longest packed row per config (14B QLoRA, all 40 layers): one model, a bounded search per config.

    Per config: the first try is just past the predicted limit (from a peak-memory line: measured successes, else
    the H200 priors above, capped by host RAM for the offloaded configs), then just under it; then model-guided
    bisection inside (longest success, first failure) down to ``res`` tokens (``--longest-step``, finer for short
    rows). ``ckpt_offload`` lengths whose power-of-two pinned blocks do not fit in host RAM are failures predicted
    without running. Each config gets an equal share of what is left of ``--longest-budget``; a try predicted not to
    fit is skipped, a try running past it is cut ("time cap"). Results (``offload_longest.json``, the command line
    ``argv``) are written after each config, so a run cut short keeps the configs it finished.
    """
    from nbkit.ops.offload_lanes import host_available

    model, causal, build_s = build_qlora(args.longest_model, args.longest_layers, device)
    packed, attn_note = attach_attention(model, args.attn)
    set_config(model, causal, "ckpt")  # one short step first: kernels and libraries warm, so tries time the work
    loss_fn(causal, packed_batch(min(args.longest_start, 2048), causal.config.vocab_size, device)).backward()
    cap = None
    cleanup(model)
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()  # free to this process: what other processes hold is not ours to fill
        cap = (free + device_memory(device).reserved) / GiB * args.longest_fill
    info = host_gib()
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
                 probe=args.longest_probe, peak_layers=args.longest_peak_layers, host_gib=info)
        results.append(r)
        write_results("offload", results, argv=argv, name="offload_longest",
                      notes="CPU smoke run (--tiny)" if args.tiny else "")
    if packed is not None:
        packed.detach()
    return results


def host_gib() -> dict[str, float]:
    """Host memory as the kernel shows it (GiB): what a try's host check saw, recorded beside its result."""
    m = meminfo()
    return {k: round(m[k] / GiB, 1) for k in ("MemTotal", "MemFree", "MemAvailable", "Mlocked") if k in m}


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
