"""The side-by-side table of Unsloth's notebook recipe (``--recipe unsloth``): plain TRL, FastSFT and Unsloth, mode
by mode, from the results files ``e2e`` and ``unsloth_e2e`` wrote.

A mode is the shape, the compute dtype and the process's memory cap (``1.7b fp16@15``: float16 under a 15 GiB cap).
Each trainer's line: its whole ``train()`` in seconds, its speed against Unsloth's over the whole run (Unsloth's
``train()`` seconds over this one's, in the same mode: above 1x is faster than Unsloth), the median step after the
warm-up with its min-max, the first 4 steps, peak allocated GiB, first and last loss. Standard library only, so it
runs in either environment and here on the files brought back:

    python -m benchmarks.recipe_table                  # the files in $OUT
    python -m benchmarks.recipe_table DIR [DIR ...]    # the files in these folders (several calls' $OUT)
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

RECIPE = "unsloth"  # unsloth_recipe.RECIPE (not imported: that module is for the trainers' processes)
ORDER = ("sft", "fastsft", "unsloth")  # the trainers' order in a mode; other paths after them
BASELINE = "unsloth"


def load_rows(folders: Sequence[str | os.PathLike]) -> list[dict]:
    """Every row of the recipe in the ``*.json`` results files of ``folders`` (files in name order; other
    benchmarks' files and rows of other recipes are skipped)."""
    rows = []
    for folder in folders:
        for path in sorted(Path(folder).glob("*.json")):
            try:
                payload = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(payload, dict):
                continue
            rows += [r for r in payload.get("figures", []) if isinstance(r, dict) and r.get("recipe") == RECIPE]
    return rows


def mode(row: dict) -> str:
    """``<shape> <compute>[@<cap GiB>]``, e.g. ``1.7b bf16`` or ``14b fp16@15``."""
    cap = row.get("cap_gib")
    return f"{row.get('shape', '?')} {row.get('compute', '?')}" + (f"@{cap:g}" if cap else "")


def mode_order(row: dict) -> tuple:
    """Modes sort by shape, then uncapped before capped, the smaller cap first (``bf16``, ``fp16@15``, ``bf16@22``),
    then by compute dtype."""
    cap = row.get("cap_gib")
    return str(row.get("shape", "")), cap is not None, cap or 0.0, str(row.get("compute", ""))


def speed_vs(row: dict, baseline: dict | None) -> float | None:
    """``baseline``'s ``train()`` seconds over ``row``'s (above 1: ``row`` trained faster); None when either has no
    time."""
    if not baseline or baseline.get("error") or row.get("error"):
        return None
    ours, theirs = row.get("train_s"), baseline.get("train_s")
    if not ours or not theirs:
        return None
    return theirs / ours


def _order(row: dict) -> int:
    path = str(row.get("path", ""))
    return ORDER.index(path) if path in ORDER else len(ORDER)


def _num(value: object, fmt: str) -> str:
    if isinstance(value, int | float) and not math.isnan(value):
        return format(value, fmt)
    return "-"


def table(rows: Sequence[dict]) -> str:
    """The markdown table: modes in ``mode_order``, the trainers of each in ``ORDER`` (rows of one mode and trainer
    in the order given)."""
    modes: dict[str, list[dict]] = {}
    for row in sorted(rows, key=mode_order):
        modes.setdefault(mode(row), []).append(row)
    head = ("| mode | trainer | train() s | speed vs Unsloth | median step ms (min-max) | first 4 steps ms | "
            "peak GiB | loss first / last |")
    lines = [head, "|" + "---|" * 8]
    for name, found in modes.items():
        found = sorted(found, key=_order)  # stable: reruns keep their files' order
        baseline = next((r for r in found if r.get("path") == BASELINE and not r.get("error")), None)
        for r in found:
            if r.get("error"):
                lines.append(f"| {name} | {r.get('path')} | failed: {str(r['error'])[:80]} |" + " |" * 5)
                continue
            ratio = speed_vs(r, baseline)
            first = "; ".join(_num(ms, ",.0f") for ms in r.get("first_steps_ms", []))
            lines.append(
                f"| {name} | {r.get('path')} | {_num(r.get('train_s'), ',.1f')} | "
                f"{'-' if ratio is None else f'{ratio:.2f}x'} | {_num(r.get('step_ms'), ',.0f')} "
                f"({_num(r.get('step_ms_min'), ',.0f')}-{_num(r.get('step_ms_max'), ',.0f')}) | {first or '-'} | "
                f"{_num(r.get('peak_gib'), '.1f')} | {_num(r.get('loss_first'), '.4f')} / "
                f"{_num(r.get('loss_last'), '.4f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    """Print (and return) the table of the results files in the folders given, $OUT when none is."""
    argv = sys.argv[1:] if argv is None else list(argv)
    folders = argv or ([os.environ["OUT"]] if os.environ.get("OUT") else [])
    if not folders:
        raise SystemExit("usage: python -m benchmarks.recipe_table [DIR ...] (default: $OUT)")
    text = table(load_rows(folders))
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
