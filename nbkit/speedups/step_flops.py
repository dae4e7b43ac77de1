"""The trainer's FLOPs estimate per micro-step without walking the model's parameters each time.

Why: transformers' ``Trainer.floating_point_ops`` (its documented override point) returns ``6 x tokens x
model.num_parameters(exclude_embeddings=True)`` after every micro-step, and ``num_parameters`` walks every module
and parameter of the model each time (thousands of tensors for a QLoRA model) for a number that does not change
while training: host time in every step of a short, host-bound row.

Contract: the same value as transformers' (``state.total_flos`` equal); the count is taken once per attach (one
``train()`` call), so adapters added between two runs are counted. Attached to the trainer (``stage="trainer"``):
``floating_point_ops`` is set on the trainer instance through the ledger, the class's own is the fallback. It
reproduces transformers' ``Trainer.floating_point_ops`` (``MIRRORS``: its source fingerprint, the same in 5.15 to
5.25); on a transformers whose code differs, nothing is attached, said once per process, by name.
"""

from __future__ import annotations

import logging
from typing import Any

from ..say_once import SayOnce
from ..trl_seam import mirror_differs
from .ledger import PatchLedger

logger = logging.getLogger(__name__)

MIRRORS = {"transformers.trainer:Trainer.floating_point_ops": frozenset({"deacad1a134ba25f"})}
SAY_ONCE = SayOnce(logger, "nbkit: step_flops")


class CachedFlops:
    """``floating_point_ops`` with the parameter count taken once per attach."""

    name = "step_flops"

    def __init__(self) -> None:
        self._ledger = PatchLedger(self.name)
        self.param_count: int | None = None

    def attach(self, trainer: Any) -> bool:
        self.detach()
        if mirror_differs(MIRRORS):
            import transformers

            SAY_ONCE("mirror", f"transformers {transformers.__version__}'s Trainer.floating_point_ops differs from "
                     "the releases this reproduces; its own count is used")
            return False
        own = trainer.floating_point_ops

        def floating_point_ops(inputs: dict[str, Any]) -> int:
            model = trainer.model
            main = getattr(model, "main_input_name", "input_ids")
            if main not in inputs or not hasattr(model, "num_parameters"):
                return own(inputs)
            if self.param_count is None:
                self.param_count = model.num_parameters(exclude_embeddings=True)
            return 6 * inputs[main].numel() * self.param_count

        self._ledger.set(trainer, "floating_point_ops", floating_point_ops)
        return True

    def detach(self) -> None:
        self._ledger.undo()
        self.param_count = None
