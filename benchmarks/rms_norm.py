"""A frozen-weight RMSNorm's forward + backward: Liger's kernels against ``nbkit.ops.rms_norm``, at the norms of a
Qwen3 step (the hidden-size norms and the per-head q/k norms) for the 1.7B and 14B shapes.

Op level, to explain a step's profile, not a speed claim (those are trainer level, ``benchmarks.e2e``): each case
runs one forward and one backward (the incoming gradient given), bf16, weight frozen, ``--reps`` calls after 10
warm-up calls. Two figures a call, in microseconds: the GPU kernel time (``torch.profiler``, the sum of the call's
kernels: what a GPU-bound or CUDA-graphed step pays), and the wall time with CUDA events (median of 5 runs; at these
sizes it is the host's Python and launches, which a graphed step does not pay). Beside them the bandwidth the nbkit
kernels reach (x and y forward, x, dy and dx backward, over the kernel time) and the largest difference between the
two ops' outputs and input gradients.

    python -m benchmarks.rms_norm
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

from nbkit.ops.rms_norm import rms_norm

from .common import write_results

SHAPES = {"1.7b": (2048, 16, 8), "14b": (5120, 40, 8)}  # hidden, query heads, kv heads; head_dim 128


def cases(tokens: list[int]) -> list[tuple[str, int, int]]:
    out = []
    for shape, (hidden, q, kv) in SHAPES.items():
        for t in tokens:
            out += [(f"{shape} hidden", t, hidden), (f"{shape} q_norm", t * q, 128), (f"{shape} k_norm", t * kv, 128)]
    return out


def time_op(op: Callable, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, reps: int) -> list[float]:
    def call() -> None:
        xx = x.detach().requires_grad_(True)
        op(xx, w).backward(dy)

    for _ in range(10):
        call()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            call()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1000 / reps)
    return runs


def kernel_us(op: Callable, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, reps: int) -> float:
    """GPU kernel time per forward + backward call, microseconds."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            xx = x.detach().requires_grad_(True)
            op(xx, w).backward(dy)
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA) / reps


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,4096,16384")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    from liger_kernel.transformers.functional import liger_rms_norm

    ops = {"liger": lambda x, w: liger_rms_norm(x, w, 1e-6, 0.0, "llama", False),
           "nbkit": lambda x, w: rms_norm(x, w, 1e-6, 0.0, "llama")}
    rows = []
    for name, n_rows, n in cases([int(t) for t in args.tokens.split(",")]):
        torch.manual_seed(0)
        x = torch.randn(n_rows, n, device="cuda", dtype=torch.bfloat16)
        w = (torch.rand(n, device="cuda") + 0.5).to(torch.bfloat16)
        dy = torch.randn_like(x)
        row: dict[str, Any] = {"case": name, "rows": n_rows, "width": n}
        outs = {}
        for label, op in ops.items():
            runs = time_op(op, x, w, dy, args.reps)
            row[f"{label}_wall_us"] = statistics.median(runs)
            row[f"{label}_wall_us_min"], row[f"{label}_wall_us_max"] = min(runs), max(runs)
            row[f"{label}_us"] = kernel_us(op, x, w, dy, args.reps)
            xx = x.detach().requires_grad_(True)
            y = op(xx, w)
            y.backward(dy)
            outs[label] = (y.detach(), xx.grad)
        row["speedup"] = row["liger_us"] / row["nbkit_us"]
        row["nbkit_GBps"] = 5 * x.numel() * x.element_size() / (row["nbkit_us"] * 1e-6) / 1e9
        row["max_diff_y"] = float((outs["liger"][0].float() - outs["nbkit"][0].float()).abs().max())
        row["max_diff_dx"] = float((outs["liger"][1].float() - outs["nbkit"][1].float()).abs().max())
        print(f"{name:16s} {n_rows:>7d} x {n:<5d} kernels: liger {row['liger_us']:7.1f} us  nbkit "
              f"{row['nbkit_us']:7.1f} us ({row['speedup']:.1f}x, {row['nbkit_GBps']:.0f} GB/s); wall: liger "
              f"{row['liger_wall_us']:.0f} nbkit {row['nbkit_wall_us']:.0f} us; max diff y {row['max_diff_y']:.3g} "
              f"dx {row['max_diff_dx']:.3g}", flush=True)
        rows.append(row)
    write_results("rms_norm", {"rows": rows}, argv=argv)
    return rows


if __name__ == "__main__":
    main()
