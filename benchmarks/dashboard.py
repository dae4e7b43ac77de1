"""Cost of the live dashboard per training step, measured in a real Jupyter kernel.

FastSFT with ``live_dashboard=True`` and ``False`` alternate (off, on, off, on) in one kernel started by nbclient,
on the same base model and data (``benchmarks.e2e``'s workload: QLoRA NF4 Qwen3 shape, LoRA r16 on all 7
projections, one packed row per step, gradient checkpointing), each path its own trainer's ``train()`` timed by
CUDA events at step boundaries. Inside the kernel the dashboard takes its widget path, as in JupyterLab, Colab and
Kaggle. The figure is the median step with the dashboard against the median step without, per pair.

    python -m benchmarks.dashboard --shape 1.7b --tokens 4096     # GPU
    python -m benchmarks.dashboard --tiny                         # CPU (tiny model, fp32)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

CELL = """
import argparse, json, os, sys, tempfile, torch
sys.path.insert(0, {root!r})
from benchmarks.e2e import SHAPES, load_base, run_path, save_random_model
from benchmarks.common import packed_token_dataset
args = argparse.Namespace(tiny={tiny}, tokens={tokens}, warmup={warmup}, steps={steps})
shape = "tiny" if args.tiny else {shape!r}
folder = tempfile.mkdtemp(prefix="nbkit-dash-")
save_random_model(shape, None, folder, args.tiny)
base, _ = load_base(folder, not args.tiny)
mean = 40 if args.tiny else 400
data = packed_token_dataset(2 * (args.warmup + args.steps + 2) * args.tokens // mean, SHAPES[shape]["vocab_size"],
                            mean_len=mean, spread=mean // 4)
import functools, time
from nbkit.dashboard.callback import LiveDashboard
spent = {{"s": 0.0, "calls": 0}}

def timed(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent["s"] += time.perf_counter() - t0
            spent["calls"] += 1
    return wrapper

for name in ("on_train_begin", "on_step_end", "on_log", "on_train_end"):
    setattr(LiveDashboard, name, timed(getattr(LiveDashboard, name)))
rows = []
for live in {order!r}:
    spent.update(s=0.0, calls=0)
    row, base, _ = run_path(f"fastsft[live_dashboard={{live}}]", base, data, args, profile=False)
    rows.append({{"live_dashboard": live, "step_ms": row.get("step_ms"), "step_ms_min": row.get("step_ms_min"),
                 "step_ms_max": row.get("step_ms_max"), "losses": row.get("losses"), "speedups": row.get("speedups"),
                 "error": row.get("error"), "dashboard_s": spent["s"], "dashboard_calls": spent["calls"],
                 "steps": args.warmup + args.steps}})
print("NBKIT_ROWS=" + json.dumps(rows))
"""


def run(args: argparse.Namespace) -> dict:
    import nbformat
    from nbclient import NotebookClient

    root = str(Path(__file__).resolve().parent.parent)
    order = [False, True] * args.pairs
    source = CELL.format(root=root, tiny=args.tiny, tokens=args.tokens, warmup=args.warmup, steps=args.steps,
                         shape=args.shape, order=order)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    NotebookClient(nb, timeout=args.timeout, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("output_type") == "stream")
    line = next(x for x in text.splitlines() if x.startswith("NBKIT_ROWS="))
    rows = json.loads(line.split("=", 1)[1])
    pairs = []
    for off, on in zip(rows[0::2], rows[1::2]):
        pairs.append({"off_ms": off["step_ms"], "on_ms": on["step_ms"],
                      "overhead_pct": 100.0 * (on["step_ms"] - off["step_ms"]) / off["step_ms"]})
    on = [r for r in rows if r["live_dashboard"]]
    own_ms = statistics.median(1000.0 * r["dashboard_s"] / r["steps"] for r in on)
    step_ms = statistics.median(r["step_ms"] for r in rows if not r["live_dashboard"])
    return {"rows": rows, "pairs": pairs, "step_ms_off_median": step_ms,
            "overhead_pct_median": statistics.median(p["overhead_pct"] for p in pairs),
            "dashboard_ms_per_step": own_ms, "dashboard_pct_of_step": 100.0 * own_ms / step_ms}


def table(result: dict) -> str:
    lines = ["| pair | step ms, dashboard off (median) | step ms, dashboard on (median) | cost |", "|---|---|---|---|"]
    for i, p in enumerate(result["pairs"], 1):
        lines.append(f"| {i} | {p['off_ms']:.1f} | {p['on_ms']:.1f} | {p['overhead_pct']:+.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.7b", choices=["1.7b", "14b"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on the CPU")
    args = parser.parse_args(argv)
    if args.tiny and args.tokens == 4096:
        args.tokens = 512
    result = run(args)
    from benchmarks import common

    writer = common.write_results
    writer("dashboard", {"args": vars(args), **result})
    print(table(result))
    print(f"step time with the dashboard vs without (median of pairs): {result['overhead_pct_median']:+.2f}%; "
          f"time inside the dashboard's callbacks: {result['dashboard_ms_per_step']:.3f} ms per step = "
          f"{result['dashboard_pct_of_step']:.3f}% of the median step ({result['step_ms_off_median']:.0f} ms)")


if __name__ == "__main__":
    main()
