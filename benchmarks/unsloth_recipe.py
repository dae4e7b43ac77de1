"""Unsloth's notebook recipe, the one most notebook users run, as ``e2e`` and ``unsloth_e2e`` run it with
``--recipe unsloth``: its settings, its data and its row.

The recipe (Unsloth's notebooks): NF4 4-bit + LoRA r=16, alpha 16, dropout 0, no bias, on all 7 projections;
batch 2 x 4 accumulation steps, no packing, rows cut at ``max_length`` = 2,048 tokens, 5 warmup steps, learning rate
2e-4 (linear), ``adamw_8bit``, weight decay 0.01, seed 3407, a log line every step, 60 steps; gradient checkpointing
on. The data: token-id documents whose lengths are drawn log-uniformly between 100 and 3,000 tokens (scaled with
``max_length``: about 11% of them longer than it, so the cut matters), the same documents (seed 3407) for every
trainer.

The row is timed as the user waits: the whole ``train()`` (synchronized before and after), and every optimizer
step's wall time in order, from one step's end to the next (each step's end synchronized by ``common.StepTimer``;
data loading and callbacks between steps included), the first 4 also reported on their own (compilation, graph
capture and the allocator's growth land there). Only the standard library at import: ``unsloth_e2e`` imports this
before Unsloth, which must come before transformers.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping
from typing import Any

RECIPE = "unsloth"
MAX_LENGTH = 2048
FIRST_STEPS = 4  # the first steps reported one by one
SEED = 3407
LORA = dict(r=16, lora_alpha=16, lora_dropout=0.0, bias="none")
# SFTConfig's values in Unsloth's notebooks (max_steps, max_length and the precision come from the command line)
SFT = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, warmup_steps=5, learning_rate=2e-4,
           optim="adamw_8bit", weight_decay=0.01, lr_scheduler_type="linear", seed=SEED, logging_steps=1,
           packing=False)
# document lengths at max_length = 2,048, drawn log-uniformly between them
SHORTEST, LONGEST = 100, 3000


def document_lengths(n_docs: int, max_length: int = MAX_LENGTH, seed: int = SEED) -> list[int]:
    """``n_docs`` lengths, log-uniform between 100 and 3,000 tokens at ``max_length`` 2,048 (both ends scaled with
    it, the shortest at least 8)."""
    rng = random.Random(seed)
    low = max(8, round(SHORTEST * max_length / MAX_LENGTH))
    high = max(low + 1, round(LONGEST * max_length / MAX_LENGTH))
    return [round(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(n_docs)]


def documents(n_docs: int, vocab_size: int, max_length: int = MAX_LENGTH, seed: int = SEED) -> Any:
    """The recipe's data: a ``datasets.Dataset`` of ``input_ids`` documents of ``document_lengths`` (uncut: the
    trainer cuts them at ``max_length``)."""
    from datasets import Dataset

    rng = random.Random(seed + 1)
    return Dataset.from_list([{"input_ids": [rng.randrange(10, vocab_size) for _ in range(n)]}
                              for n in document_lengths(n_docs, max_length, seed)])


def n_documents(steps: int) -> int:
    """Documents for ``steps`` optimizer steps of 2 x 4 rows, and two steps more."""
    return SFT["per_device_train_batch_size"] * SFT["gradient_accumulation_steps"] * (steps + 2)


def recipe_row(path: str, times: Any, train_s: float, setup_s: float, peak_bytes: int, warmup: int,
               extra: Mapping[str, Any] | None = None) -> dict:
    """One trainer's row from its ``common.StepTimes``: ``train_s`` (the whole ``train()``), ``setup_s`` (building
    the trainer: LoRA, data preparation), every step's wall ms (``step_wall_ms_all``), the first 4
    (``first_steps_ms``), the median after ``warmup`` steps with its min and max (``step_ms``), the same from the
    step's CUDA events (``event_step_ms``), peak allocated GiB, first and last loss."""
    ends = list(times.step_end_s)
    wall = [(b - a) * 1000.0 for a, b in zip([0.0] + ends[:-1], ends, strict=True)]
    timed = wall[warmup:] or wall
    events = list(times.step_ms[warmup:] or times.step_ms)
    nan = float("nan")
    row = {
        "path": path,
        "train_s": train_s,
        "setup_s": setup_s,
        "steps": len(wall),
        "step_ms": statistics.median(timed) if timed else nan,
        "step_ms_min": min(timed) if timed else nan,
        "step_ms_max": max(timed) if timed else nan,
        "first_steps_ms": wall[:FIRST_STEPS],
        "event_step_ms": statistics.median(events) if events else nan,
        "peak_gib": peak_bytes / 2**30,
        "loss_first": times.losses[0] if times.losses else nan,
        "loss_last": times.losses[-1] if times.losses else nan,
        "losses": list(times.losses),
        "first_step_s": times.first_step_s,
        "warmup": warmup,
        "step_wall_ms_all": wall,
        "step_event_ms_all": list(times.step_ms),
        "tokens_all": list(times.tokens),
    }
    row.update(extra or {})
    return row


def batching(trainer: Any) -> dict:
    """How the trainer batched the rows in the end (Unsloth may turn padding-free on by itself)."""
    args = getattr(trainer, "args", None)
    return {"packing": getattr(args, "packing", None), "padding_free": getattr(args, "padding_free", None)}


def capture_stats(trainer: Any) -> dict:
    """Whatever layer-capture statistics the trainer exposes (``nbkit_layer_stats``, e.g. ``capture_s`` and
    ``captures``), as JSON-able values; {} when it exposes none. Never raises: a statistic is not worth a row."""
    try:
        stats = getattr(trainer, "nbkit_layer_stats", None)
        if stats is None:
            return {}
        if callable(stats):
            stats = stats()
        if isinstance(stats, Mapping):
            found = dict(stats)
        elif hasattr(stats, "__dict__"):
            found = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
        else:
            found = {"value": stats}
        found = {str(k): _plain(v) for k, v in found.items()}
        row = {"nbkit_layer_stats": found}
        row.update({k: found[k] for k in ("capture_s", "captures") if k in found})
        return row
    except Exception as exc:  # noqa: BLE001
        return {"nbkit_layer_stats_error": f"{type(exc).__name__}: {exc}"[:200]}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    try:
        return float(value)  # a 0-d tensor, a numpy scalar
    except (TypeError, ValueError):
        return str(value)
