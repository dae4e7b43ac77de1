"""What the benchmarks share: synthetic packed data, step timing with CUDA events, result tables, the results file.

Timing contract: a step is timed from ``on_step_begin`` to ``on_step_end`` with CUDA events (forward, backward and
optimizer included); forward and backward are split by events around ``compute_loss``. The first ``warmup`` steps
are dropped; the median of the rest is reported.
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback

from nbkit.memory import GiB, fmt_bytes, peak_bytes


def packed_token_dataset(n_docs: int, vocab_size: int, mean_len: int = 400, spread: int = 100,
                         seed: int = 0) -> Dataset:
    """Pre-tokenized documents of about ``mean_len`` tokens (TRL packs them; it skips tokenization for input_ids)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n_docs):
        n = rng.randint(mean_len - spread, mean_len + spread)
        rows.append({"input_ids": [rng.randrange(10, vocab_size) for _ in range(n)]})
    return Dataset.from_list(rows)


class _HostEvent:
    """Stand-in for torch.cuda.Event on a machine without CUDA (smoke runs of the benchmarks on CPU)."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1000.0


def event() -> Any:
    """A timing event: a CUDA event on a GPU, a host clock off it."""
    return torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else _HostEvent()


def peak_memory() -> int:
    """The current device's peak bytes as nbkit.memory reads them: allocated on CUDA (since the benchmark's last
    ``torch.cuda.reset_peak_memory_stats``), this process's peak resident set on a CPU."""
    return peak_bytes(None)


@dataclass
class StepTimes:
    step_ms: list[float] = field(default_factory=list)
    fwd_ms: list[float] = field(default_factory=list)
    bwd_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)  # host time to issue a micro-step (GPU may still be busy)
    losses: list[float] = field(default_factory=list)
    first_step_s: float | None = None
    # seconds from on_train_begin to each optimizer step's end (after its sync): the steps as the user waits for
    # them, data loading and callbacks between steps included
    step_end_s: list[float] = field(default_factory=list)


class StepTimer(TrainerCallback):
    """CUDA-event step timer, one entry per optimizer step. The host waits for the GPU once per step, at its end (as
    a trainer logging every step does); the forward/backward events of ``TimedStepMixin``'s micro-steps are read
    there too, so timing adds no sync inside a step (gradient accumulation included) and entries are summed over
    the step's micro-steps."""

    def __init__(self) -> None:
        self.times = StepTimes()
        self._begin = None
        self._t0 = None
        self._micro: list[tuple[Any, Any, Any, int, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._micro = []
        self._begin = event()
        self._begin.record()

    def micro_step(self, start: Any, fwd_end: Any, end: Any, tokens: int, host_ms: float) -> None:
        """One micro-step's events (read at the step's end) and what the host measured of it."""
        self._micro.append((start, fwd_end, end, tokens, host_ms))

    def on_step_end(self, args, state, control, **kwargs):
        end = event()
        end.record()
        end.synchronize()
        self.times.step_end_s.append(time.perf_counter() - self._t0)
        if self.times.first_step_s is None:
            self.times.first_step_s = self.times.step_end_s[0]
        self.times.step_ms.append(self._begin.elapsed_time(end))
        if self._micro:
            t = self.times
            t.fwd_ms.append(sum(a.elapsed_time(f) for a, f, _, _, _ in self._micro))
            t.bwd_ms.append(sum(f.elapsed_time(b) for _, f, b, _, _ in self._micro))
            t.tokens.append(sum(m[3] for m in self._micro))
            t.host_ms.append(sum(m[4] for m in self._micro))
        self._micro = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.times.losses.append(float(logs["loss"]))


class TimedStepMixin:
    """Mix into a Trainer subclass: records each micro-step's forward/backward CUDA events and tokens for
    ``step_timer`` (no sync here: the timer reads them at the step's end). The forward's end is recorded after
    whichever ``compute_loss`` the step calls: the class's, or one a speedup set on the instance."""

    step_timer: StepTimer

    def training_step(self, model, inputs, *args, **kwargs):
        start, fwd_end, end = event(), event(), event()
        own = vars(self).get("compute_loss")
        loss_fn = self.compute_loss

        def timed_loss(*a, **k):
            out = loss_fn(*a, **k)
            fwd_end.record()
            return out

        t0 = time.perf_counter()
        start.record()
        self.compute_loss = timed_loss
        try:
            out = super().training_step(model, inputs, *args, **kwargs)
        finally:
            if own is None:
                del self.compute_loss
            else:
                self.compute_loss = own
        end.record()
        self.step_timer.micro_step(start, fwd_end, end, int(inputs["input_ids"].numel()),
                                   (time.perf_counter() - t0) * 1000.0)
        return out


def timed_trainer(fast: bool) -> type:
    """A FastSFT (``fast``) or SFTTrainer subclass with ``TimedStepMixin``: the trainer every bench path times."""
    from trl import SFTTrainer

    from nbkit import FastSFT

    base = FastSFT if fast else SFTTrainer
    return type(f"Timed{base.__name__}", (TimedStepMixin, base), {})


def failed_row(path: str, exc: BaseException, **extra: Any) -> dict:
    """The row of a path that raised (one failing path must not lose the others' numbers); frees its memory."""
    import gc
    import traceback

    traceback.print_exc()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"path": path, **extra, "error": f"{type(exc).__name__}: {exc}"[:300]}


def summarize(name: str, times: StepTimes, warmup: int, peak: int, extra: dict[str, Any] | None = None) -> dict:
    """Median over the timed steps whose row is full (>= 90% of the largest): BFD packing leaves a few short rows,
    and attention cost is not linear in tokens, so a short row would flatter a quadratic path."""
    idx = list(range(warmup, len(times.step_ms))) or list(range(len(times.step_ms)))
    if times.tokens:
        full = max(times.tokens[i] for i in idx) * 0.9
        idx = [i for i in idx if times.tokens[i] >= full] or idx

    def pick(xs: list) -> list:
        return [xs[i] for i in idx if i < len(xs)]

    steps, fwd, bwd, toks = pick(times.step_ms), pick(times.fwd_ms), pick(times.bwd_ms), pick(times.tokens)
    step = statistics.median(steps)
    row = {
        "path": name,
        "step_ms": step,
        "step_ms_min": min(steps),
        "step_ms_max": max(steps),
        "fwd_ms": statistics.median(fwd) if fwd else float("nan"),
        "bwd_ms": statistics.median(bwd) if bwd else float("nan"),
        "host_ms": statistics.median(pick(times.host_ms)) if pick(times.host_ms) else float("nan"),
        "tokens_per_step": statistics.median(toks) if toks else 0,
        "tok_per_s": (sum(toks) / sum(steps) * 1000) if toks else 0.0,
        "peak_gib": peak / GiB,
        "loss_first": times.losses[0] if times.losses else float("nan"),
        "loss_mean": statistics.fmean(times.losses) if times.losses else float("nan"),
        "losses": times.losses,
        "first_step_s": times.first_step_s,
        "steps_timed": len(steps),
        "step_ms_all": times.step_ms,
        "tokens_all": times.tokens,
    }
    row.update(extra or {})
    return row


def markdown_table(rows: list[dict], baseline: str | None = None) -> str:
    """One line per path; "speedup" is the ``baseline`` path's step time over this one's."""
    base = next((r for r in rows if r["path"] == baseline), None)
    head = ("| path | step ms (min-max) | fwd ms | bwd ms | tok/s | speedup | peak GiB | loss (first, mean) | "
            "first step s |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['path']} | failed: {r['error'][:80]} |" + " |" * 7)
            continue
        ratio = f"{base['step_ms'] / r['step_ms']:.2f}x" if base and not base.get("error") else "-"
        lines.append(
            f"| {r['path']} | {r['step_ms']:,.0f} ({r['step_ms_min']:,.0f}-{r['step_ms_max']:,.0f}) | "
            f"{r['fwd_ms']:,.0f} | {r['bwd_ms']:,.0f} | {r['tok_per_s']:,.0f} | "
            f"{ratio} | {r['peak_gib']:.1f} | {r['loss_first']:.4f}, {r['loss_mean']:.4f} | "
            f"{(r['first_step_s'] or 0):.1f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- the results file
# The packages a result depends on, by distribution name (read from their metadata, so none is imported here).
PACKAGES = {"transformers": "transformers", "trl": "trl", "peft": "peft", "accelerate": "accelerate",
            "datasets": "datasets", "bitsandbytes": "bitsandbytes", "liger_kernel": "liger-kernel",
            "triton": "triton", "flash_attn": "flash-attn"}


def environment() -> dict[str, str]:
    """The machine and the versions a figure depends on; "absent" for a package that is not installed."""
    from importlib import metadata

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        machine = f"{props.name} ({fmt_bytes(props.total_memory)}), {os.cpu_count()} CPU cores"
    else:
        machine = f"CPU only ({platform.machine()}), {os.cpu_count()} CPU cores"
    env = {"machine": machine, "python": platform.python_version(), "torch": torch.__version__,
           "cuda": str(torch.version.cuda) if torch.version.cuda else "none"}
    for key, dist in PACKAGES.items():
        try:
            env[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[key] = "absent"
    return env


def git_commit() -> str:
    """The commit the benchmarks run from: $NBKIT_GIT_COMMIT when set (a copy of the tree without its .git), else
    ``git rev-parse HEAD`` with "-dirty" when tracked files differ from it; "unknown" when neither is there."""
    if os.environ.get("NBKIT_GIT_COMMIT"):
        return os.environ["NBKIT_GIT_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def parse_path(spec: str) -> tuple[str, dict[str, Any]]:
    """``fastsft[a=1;b=False]`` -> ("fastsft", {"a": 1, "b": False}): a path name and the switches it changes."""
    m = re.fullmatch(r"([\w]+)(?:\[(.*)\])?", spec.strip())
    if not m:
        raise ValueError(f"bad path {spec!r}")
    overrides: dict[str, Any] = {}
    for item in filter(None, (m.group(2) or "").split(";")):
        key, _, value = item.partition("=")
        low = value.strip().lower()
        overrides[key.strip()] = {"true": True, "false": False}.get(low, int(low) if low.isdigit() else value.strip())
    return m.group(1), overrides


def split_paths(paths: str) -> list[str]:
    """``"sft,fastsft[a=1;b=2]"`` -> ``["sft", "fastsft[a=1;b=2]"]`` (commas inside brackets do not split)."""
    return [p for p in re.split(r",(?![^\[]*\])", paths) if p]


def write_results(benchmark: str, figures: Sequence[dict] | Mapping[str, Any], notes: str = "", *,
                  argv: Sequence[str] | None = None, name: str | None = None,
                  environment_of: Mapping[str, Any] | None = None) -> dict:
    """The one results writer: every benchmark's JSON has the same top-level shape (``benchmarks/README.md``)::

        {"benchmark", "date", "command", "git_commit", "environment", "figures", "notes"}

    ``benchmark`` is the module under ``benchmarks/`` (``command`` is ``python -m benchmarks.<benchmark>`` and
    ``argv``, default ``sys.argv[1:]``); ``figures`` the measured rows, one dict per path / config / try. A mapping
    with ``"rows"`` is taken as rows plus run-level values, which are copied into every row (its "env", "args" and
    rendered "table" are dropped: the environment and the command line are recorded here, a table is derived).
    Writes ``$OUT/<name or benchmark>.json`` when $OUT is set; returns the payload either way. ``environment_of``:
    an earlier results payload whose machine, versions and commit these figures come from (figures merged on
    another machine from runs made there).
    """
    if isinstance(figures, Mapping):
        run_level = {k: v for k, v in figures.items() if k not in ("rows", "env", "args", "table")}
        figures = [{**run_level, **row} for row in figures["rows"]]
    argv = sys.argv[1:] if argv is None else argv
    payload = {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": " ".join(["python", "-m", f"benchmarks.{benchmark}", *map(shlex.quote, argv)]),
        "git_commit": environment_of["git_commit"] if environment_of else git_commit(),
        "environment": dict(environment_of["environment"]) if environment_of else environment(),
        "figures": list(figures),
        "notes": notes,
    }
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name or benchmark}.json"), "w") as f:
            json.dump(payload, f, indent=1, default=str)
    return payload


def run_workers(jobs: Sequence[dict], parallel: int, module: str, finished: Callable[[dict, int, str], None]) -> None:
    """Each job in its own process (a fresh CUDA context and global state), ``parallel`` at a time:
    ``python -m <module> --worker <spec>``, the spec the job written as ``<work>/<key>.json`` and its output logged to
    ``<work>/<key>.log``. ``finished(job, returncode, log tail)`` is called as each one ends."""
    pending, active = list(jobs), []
    while pending or active:
        while pending and len(active) < parallel:
            job = pending.pop(0)
            spec = Path(job["work"]) / f"{job['key']}.json"
            spec.write_text(json.dumps(job))
            log = open(Path(job["work"]) / f"{job['key']}.log", "w")  # noqa: SIM115
            cmd = [sys.executable, "-m", module, "--worker", str(spec)]
            active.append((job, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(0.5)
        for item in [a for a in active if a[1].poll() is not None]:
            job, proc, log = item
            active.remove(item)
            log.close()
            finished(job, proc.returncode, (Path(job["work"]) / f"{job['key']}.log").read_text()[-2000:])
