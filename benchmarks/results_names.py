"""A results file's name under $OUT, from what sets its run apart: the benchmark, the recipe, the model shape, the
compute dtype, the memory caps of its rows and its paths, e.g. ``e2e_recipe-unsloth_1.7b_fp16_cap15_fastsft`` or
``e2e_1.7b_bf16_uncapped_sft+fastsft``.

Why every part: two runs written to one $OUT must not share a file (a later process would silently replace an
earlier one's rows), and a benchmark rewrites its own file after each row, so the name must be fixed before the
first. Only the standard library: ``unsloth_e2e`` imports this before Unsloth, which must come before transformers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def cap_label(cap_gib: float | None) -> str:
    """``cap15`` for a process capped at 15 GiB, ``uncapped`` for none."""
    return f"cap{cap_gib:g}" if cap_gib else "uncapped"


def results_name(benchmark: str, shape: str, compute: str, caps: Sequence[float | None],
                 paths: Sequence[str] = (), recipe: str | None = None) -> str:
    """The name (without .json): ``recipe`` None for the packed rows; ``caps`` one per row, each named once."""
    parts = [benchmark, *([f"recipe-{recipe}"] if recipe else []), shape, compute,
             "+".join(dict.fromkeys(cap_label(c) for c in caps))]
    if paths:
        parts.append("+".join(re.sub(r"[^\w.=-]+", "-", p).strip("-") for p in paths))
    return "_".join(parts)
