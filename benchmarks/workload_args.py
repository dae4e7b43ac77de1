"""The command-line arguments of the trainer-level workload (``e2e`` and ``unsloth_e2e`` share it): model shape,
rows, steps, precision. Only argparse here: ``unsloth_e2e`` parses them before Unsloth is imported, which must come
before transformers."""

from __future__ import annotations

import argparse


def workload_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the workload's arguments: --shape, --layers, --tokens (``N@G``: capped at G GiB), --steps,
    --warmup, --fp16."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shape", default="1.7b", choices=["1.7b", "14b"])
    parser.add_argument("--layers", type=int, default=None, help="shrink the model (default: all layers)")
    parser.add_argument("--tokens", default="16384",
                        help="tokens per step; a comma list runs each; N@G caps the process at G GiB for that row "
                             "(torch's per-process memory fraction, as on a smaller card)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--fp16", action="store_true", help="float16 compute and training, as on a T4")
    return parser
