"""The trainer's FLOPs estimate per micro-step without walking the model's parameters each time.

Why: transformers' ``Trainer.floating_point_ops`` (its documented override point) returns ``6 x tokens x
model.num_parameters(exclude_embeddings=True)`` after every micro-step, and ``num_parameters`` walks every module
and parameter of the model each time (thousands of tensors for a QLoRA model) for a number that does not change
while training: host time in every step of a short, host-bound row.

Contract: the same value as transformers' (``state.total_flos`` equal); the count is taken once per ``train()``
call, so adapters added between two runs are counted.
"""

from __future__ import annotations

from typing import Any


class CachedFlops:
    """Trainer mixin: ``floating_point_ops`` with the parameter count taken once per run."""

    _nbkit_param_count: int | None = None

    def train(self, *args: Any, **kwargs: Any):
        self._nbkit_param_count = None
        return super().train(*args, **kwargs)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        model = self.model
        main = getattr(model, "main_input_name", "input_ids")
        if main not in inputs or not hasattr(model, "num_parameters"):
            return super().floating_point_ops(inputs)
        if self._nbkit_param_count is None:
            self._nbkit_param_count = model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main].numel() * self._nbkit_param_count
