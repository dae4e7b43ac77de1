"""The pure side of ``benchmarks.long_context``'s search: which length to try next, when a search has converged or
must stop, what a try will cost, and how a crashed try is recorded. No GPU and no trainer here, so
tests/benchmarks/test_long_context.py checks it on synthetic memory lines.

The length rule reuses ``benchmarks.offload_longest`` (``predict_max``: where a line of peak memory against tokens
reaches the budget; ``next_try``: the next length inside the bracket, on a power-of-two grid)."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Callable, Optional

from nbkit.memory import GiB, MiB

from .common import parse_path
from .offload_longest import _pow2_floor, next_try, predict_max

MAX_POSITIONS = 1 << 20  # the longest row the benchmark's models are configured for

# The prediction above as priors of the search: (fixed GiB, MiB per token) of peak allocated memory. They only
# choose the first lengths; every bound reported is measured.
PRIORS: dict[str, dict[str, tuple[float, float]]] = {
    "8b": {"sft": (6.5, 0.58), "sft_full_logits": (6.5, 1.8), "fastsft": (6.5, 0.27),
           "fastsft_no_offload": (6.5, 0.5), "fastsft_tiled": (6.5, 0.12), "fastsft_tiled_no_offload": (6.5, 0.38)},
    "14b": {"sft": (10.9, 0.86), "sft_full_logits": (10.9, 2.2), "fastsft": (10.9, 0.4),
            "fastsft_no_offload": (10.9, 0.8), "fastsft_tiled": (10.9, 0.2), "fastsft_tiled_no_offload": (10.9, 0.6)},
}


def prior_key(spec: str) -> str:
    """Which prior a path takes: its trainer, offloaded or not, tiled MLP or not."""
    name, over = parse_path(spec)
    if name != "fastsft":
        return name
    tiled = over.get("tiled_mlp", "auto") is not False  # 'auto' (the default) tiles near the limit
    key = "fastsft_tiled" if tiled else "fastsft"
    return key + ("_no_offload" if over.get("offload_checkpointing", "auto") is False else "")


# Lines a run measured (BENCHMARKS.md, Long context) replace the prediction's: FastSFT's default on the 8B, run 2,
# 65,536 to 147,456 tokens at 16 and 24 GiB.
MEASURED: dict[str, dict[str, tuple[float, float]]] = {"8b": {"fastsft_tiled": (6.0, 0.11)}}


# Bytes of checkpointed layer inputs per token (layers x hidden x 2 B in bf16): what a capped offload pool holds.
INPUT_BYTES_PER_TOKEN = {"8b": 32 * 4096 * 2, "14b": 40 * 5120 * 2}


def prior_line(shape: str, spec: str) -> Optional[tuple[int, float, float]]:
    """``predict_max``'s prior, (tokens, peak GiB, GiB per token): a measured line (``MEASURED``) where there is one,
    else the prediction's (``PRIORS``); None for shapes without one. With ``offload_max_host_bytes`` the pool fills
    at cap / (input bytes per token) tokens and past it every layer input stays on the GPU: the line starts there,
    steeper by those bytes."""
    key = prior_key(spec)
    fixed, mib = MEASURED.get(shape, {}).get(key) or PRIORS.get(shape, {}).get(key, (None, None))
    if fixed is None:
        return None
    slope = mib * MiB / GiB
    cap = parse_path(spec)[1].get("offload_max_host_bytes")
    if cap is None or key.endswith("_no_offload") or shape not in INPUT_BYTES_PER_TOKEN:
        return (0, fixed, slope)
    full = int(cap) // INPUT_BYTES_PER_TOKEN[shape]
    return (full, fixed + slope * full, slope + INPUT_BYTES_PER_TOKEN[shape] / GiB)


def budget_dependent(spec: str) -> bool:
    """Whether a path's memory per token depends on the budget: FastSFT with ``tiled_mlp="auto"`` (the default)
    tiles only near the limit."""
    name, over = parse_path(spec)
    return name == "fastsft" and over.get("tiled_mlp", "auto") == "auto"


def offloaded(spec: str, cuda: bool) -> bool:
    """Whether a path keeps its checkpointed layer inputs in host memory (nbkit's pool), so host RAM caps it."""
    name, over = parse_path(spec)
    return cuda and name == "fastsft" and over.get("offload_checkpointing", "auto") is not False


def resolution(guess: float, min_res: int) -> int:
    """The search's grid: the largest power of two at most 1/16 of the expected limit, at least ``min_res``."""
    return max(min_res, _pow2_floor(max(1, int(guess) // 16)))


def fit_step_time(points: Sequence[tuple[int, float]]) -> Optional[tuple[float, float]]:
    """(a, b) >= 0 of ``seconds = a L + b L^2`` through (tokens, seconds) points, least squares. One point (or a fit
    that would need a negative term): half linear, half quadratic at the longest point, which neither flatters nor
    overstates a longer try much (the linear layers and attention cost about the same at 32K)."""
    pts = [(float(n), float(s)) for n, s in points if n > 0 and s > 0]
    if not pts:
        return None
    if len({n for n, _ in pts}) >= 2:
        s2 = sum(n * n for n, _ in pts)
        s3 = sum(n ** 3 for n, _ in pts)
        s4 = sum(n ** 4 for n, _ in pts)
        t1 = sum(s * n for n, s in pts)
        t2 = sum(s * n * n for n, s in pts)
        det = s2 * s4 - s3 * s3
        if det > 0:
            a, b = (t1 * s4 - t2 * s3) / det, (t2 * s2 - t1 * s3) / det
            if a >= 0 and b >= 0:
                return a, b
    n, s = max(pts)
    return s / (2 * n), s / (2 * n * n)


def eta_s(points: Sequence[tuple[int, float]], tokens: int, overhead_s: float, long_steps: int = 1) -> Optional[float]:
    """Seconds a try of ``tokens`` should take: ``long_steps`` steps from ``fit_step_time`` plus the per-try overhead
    (trainer, warm step, teardown); None without any measured step."""
    fit = fit_step_time(points)
    if fit is None:
        return None
    a, b = fit
    return overhead_s + long_steps * (a * tokens + b * tokens * tokens)


def bracket(here: Sequence[dict], implied_lo: int = 0, implied_hi: Optional[int] = None) -> tuple[int, Optional[int]]:
    """(longest fit, shortest failure) of the tries at one budget, narrowed by what other budgets imply."""
    lo = max([implied_lo] + [t["tokens"] for t in here if t["outcome"] == "ok"])
    fails = [t["tokens"] for t in here if t["outcome"] not in ("ok", "time-cap")]
    fails += [implied_hi] if implied_hi else []
    return lo, (min(fails) if fails else None)


def next_length(here: Sequence[dict], line: Sequence[dict], cap_gib: Optional[float], prior: Optional[tuple], res: int,
                *, implied_lo: int = 0, implied_hi: Optional[int] = None, host_limit: Optional[int] = None,
                max_tokens: int = MAX_POSITIONS, start_tokens: int = 8192) -> tuple[Optional[int], str]:
    """The next length to try at one budget, or (None, why the search is over).

    ``here``: the tries at this budget; ``line``: this path's tries at any budget (its fits give the peak line);
    ``cap_gib``: where the peak may reach (None: no prediction, as on a CPU: doubling, then bisection)."""
    lo, hi = bracket(here, implied_lo, implied_hi)
    if hi is not None and lo >= hi:
        return None, f"not monotone: {lo:,} trained, {hi:,} failed"
    pred = predict_max(list(line), cap_gib, prior)
    if not lo and hi is None and pred is None:
        t: Optional[int] = max(res, start_tokens // res * res)
    else:
        t = next_try(lo, hi, res, pred, host_limit)
    if t is None:
        return None, "converged" if lo else "nothing fits"
    if t > max_tokens:
        if lo < max_tokens and (hi is None or max_tokens < hi):
            return max_tokens, ""
        return None, f"--max-tokens {max_tokens:,}"
    return t, ""


def warm_length(tokens: int, warm: int, auto_tokens: int) -> int:
    """The first row's length. On CUDA at least ``auto_tokens``: FastSFT's 'auto' offload decides once, at the first
    step, from one layer input's size, so the warm row must be long enough to decide as the long row does (a user's
    first step is a long row); at most the long row itself. Off CUDA (no offload decision): half the row, at most
    ``warm``."""
    if auto_tokens:
        return max(1, min(tokens, max(warm, auto_tokens)))
    return max(1, min(warm, tokens // 2))


def run_search(run_one: Callable[[int], dict], tries: list[dict], budget: str, cap_gib: Optional[float], *,
               prior: Optional[tuple], res: int, deadline: float, clock: Callable[[], float],
               eta: Callable[[int], Optional[float]], implied_lo: int = 0, implied_hi: Optional[int] = None,
               host_limit: Callable[[], Optional[int]] = lambda: None, max_tokens: int = MAX_POSITIONS,
               start_tokens: int = 8192, max_tries: int = 10, same_budget_line: bool = False) -> str:
    """One (path, budget) search: runs ``run_one(tokens)`` (a try record with ``tokens``, ``budget``, ``outcome``,
    ``peak_gib``, ``host_short``), appended to ``tries`` (this path's, all budgets), until it stops; returns why.

    ``same_budget_line``: the peak line through this budget's fits only (a path whose memory use depends on the
    budget, as ``tiled_mlp="auto"``'s does: a fit far below another budget's limit sits on the untiled line)."""
    while True:
        here = [t for t in tries if t["budget"] == budget]
        line = [t for t in (here if same_budget_line else tries) if t["outcome"] == "ok" and t.get("peak_gib")]
        t, stop = next_length(here, line, cap_gib, prior, res, implied_lo=implied_lo, implied_hi=implied_hi,
                              host_limit=host_limit(), max_tokens=max_tokens, start_tokens=start_tokens)
        if t is None:
            return stop
        if len(here) >= max_tries:
            return f"--max-tries {max_tries}"
        e = eta(t)
        if e is not None and clock() + e > deadline:
            return f"time budget (next try {t:,} tokens: ~{e:.0f} s)"
        rec = run_one(t)
        tries.append(rec)
        if rec.get("restart"):
            return "restart"


def expected_cost(line: Sequence[dict], cap_gib: Optional[float], prior: Optional[tuple],
                  eta: Callable[[int], Optional[float]], fallback: int) -> float:
    """Seconds a search should take (three tries at its predicted limit): the searches run cheapest first."""
    pred = predict_max(list(line), cap_gib, prior)
    e = eta(int(pred) if pred and pred > 0 else fallback)
    return 3 * e if e is not None else float(pred or fallback)


def inflight(records: Sequence[dict]) -> Optional[dict]:
    """The try a worker started and never finished (its last "start" without a result), or None."""
    started = None
    for r in records:
        if r.get("event") == "start":
            started = r
        elif r.get("event") == "try" and started is not None and all(
                r.get(k) == started.get(k) for k in ("path", "budget", "tokens", "kind")):
            started = None
    return started


def crash_record(start: dict, rc: int, killed: bool) -> dict:
    """The record of a try whose worker died under it: killed by the parent at the time budget (time-cap), by
    SIGKILL otherwise (the kernel's OOM killer: host-oom), or any other exit (error)."""
    if killed:
        outcome, why = "time-cap", "the worker was stopped at the time budget"
    elif rc in (-signal.SIGKILL, 128 + signal.SIGKILL):
        outcome, why = "host-oom", "the worker was killed (SIGKILL: most likely the kernel's OOM killer)"
    else:
        outcome, why = "error", f"the worker exited with {rc} during this try"
    return {**{k: v for k, v in start.items() if k != "event"}, "event": "try", "outcome": outcome, "error": why,
            "peak_gib": 0.0, "host_short": 0, "wall_s": None, "crashed": True}


