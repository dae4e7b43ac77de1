"""``generate_answers``: greedy answers to many chat prompts in left-padded batches (the entry point the demo and
the notebooks import; the code is ``nbkit.decode.batch``)."""

from __future__ import annotations

from .decode.batch import generate_answers

__all__ = ["generate_answers"]
