"""The command-line arguments of the trainer-level workload (``e2e`` and ``unsloth_e2e`` share it): model shape,
rows, steps, precision. Only argparse here: ``unsloth_e2e`` parses them before Unsloth is imported, which must come
before transformers."""

from __future__ import annotations

import argparse

# --tokens, --steps and --warmup when not given: Unsloth's notebook recipe (``--recipe unsloth``) has its own
DEFAULTS = {"tokens": "16384", "steps": 5, "warmup": 2}
RECIPE_DEFAULTS = {"unsloth": {"tokens": "2048", "steps": 60, "warmup": 4}}


def workload_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the workload's arguments: --shape, --layers, --tokens (``N@G``: capped at G GiB), --steps,
    --warmup, --fp16. Those left out are None until ``resolve_defaults`` fills them for the recipe."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shape", default="1.7b", choices=["1.7b", "14b"])
    parser.add_argument("--layers", type=int, default=None, help="shrink the model (default: all layers)")
    parser.add_argument("--tokens", default=None,
                        help="tokens per step (--recipe unsloth: the max_length rows are cut at); a comma list runs "
                             "each; N@G caps the process at G GiB for that row (torch's per-process memory "
                             "fraction, as on a smaller card). Default 16384 (--recipe unsloth: 2048)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps after --warmup (--recipe unsloth: max_steps, warm-up included). Default 5 "
                             "(--recipe unsloth: 60)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps left out of the median. Default 2 (--recipe unsloth: 4)")
    parser.add_argument("--fp16", action="store_true", help="float16 compute and training, as on a T4")
    return parser


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill --tokens, --steps and --warmup left out with the defaults of ``args.recipe`` (none: the packed
    workload's); returns ``args``."""
    defaults = RECIPE_DEFAULTS.get(getattr(args, "recipe", None) or "", DEFAULTS)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args
