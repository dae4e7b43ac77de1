"""Selective checkpointing: the last decoder layers whose activations fit in free GPU memory are not recomputed.

Why: with gradient checkpointing every decoder layer's forward runs twice, once in the forward and once as the
recompute in backward. On short rows the step is bound by the host, not the GPU, and the activations of many or all
layers would fit in memory anyway: their recompute is pure host time. This mode lets the layer plan
(``layer_plan``, run by ``layer_runner``) keep as many layers' activations as fit, the last layers first (backward
frees them first), and where a whole layer does not fit, the attention's activations with the MLP recomputed.

What it holds is the policy's input only: ``max_tokens``, the most tokens one micro-batch can hold (batch size x
max_length, or x the dataset's longest example; the plan sizes each layer at it), and whether the MLP-only recompute
may be chosen (``split``). The measurement (step 1's recompute), the two looks and the plan's line are the runner's.

Beside offloaded checkpointing: a kept layer keeps its activations on the GPU and is not offloaded; the layers still
checkpointed offload as before (and get their inputs back on the GPU where the budget allows). Step 1's peak is the
offloaded one, so on long rows, where offloading is what made the row fit, few or no layers are kept.

Modes: True (keep wherever it can: also off CUDA, where there are no memory counters to size by and every layer is
kept; for tests), "auto" (a CUDA model), False. It takes no part without checkpointed layers, or when ``max_tokens``
is unknown (``max_length=None`` and no tokenized map-style dataset), said once. ``kept`` / ``added`` read the plan.
Contract: the same losses and gradients as plain checkpointing.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional, Union

import torch

from ..say_once import SayOnce
from ..settings import check_value

logger = logging.getLogger(__name__)

Mode = Union[bool, Literal["auto"]]


class SelectiveCheckpointing:
    """The keep mode of the layer plan (see the module docstring). ``accumulation`` is kept for callers that pass
    it: the second look waits for the trainer's optimizer step itself."""

    name = "selective_checkpointing"

    def __init__(self, mode: Mode = "auto", max_tokens: Optional[int] = None, accumulation: int = 1,
                 split: bool = True) -> None:
        check_value("selective_checkpointing", mode)
        self.mode, self.max_tokens, self.accumulation = mode, max_tokens, max(1, int(accumulation))
        self.split = split
        self._say = SayOnce(logger, "nbkit selective_checkpointing")
        self._runner: Any = None

    # ---------------------------------------------------------------------------------------------- the runner's
    def take(self, runner: Any, checkpointed: list) -> bool:
        """Whether this mode takes part in ``runner``'s plan (checkpointed layers, a known longest micro-batch, and
        for 'auto' a device with memory counters)."""
        self._runner = runner
        if self.mode is False:
            return False
        if not checkpointed:
            self._say("nogc", "no checkpointed layer; nothing to do", logging.INFO)
            return False
        if self.max_tokens is None:
            self._say("unbounded", "the longest micro-batch is unknown (max_length=None and no tokenized dataset "
                      "to bound it), so what fits cannot be sized; every layer stays checkpointed")
            return False
        if self.mode == "auto" and not runner.budget.measured:
            self._say("auto", f"off (model on {runner.budget.device.type}; 'auto' sizes by CUDA memory)", logging.INFO)
            return False
        return True

    # ----------------------------------------------------------------------------------------------- on its own
    def attach(self, model: torch.nn.Module) -> bool:
        """Outside FastSFT: a layer runner with this mode alone (gradient checkpointing enabled on ``model``)."""
        from .layer_runner import standalone

        self.detach()
        self._runner = standalone(self, "keep", model)
        return self._runner.keep is self

    def detach(self) -> None:
        if self._runner is not None and self._runner.keep is self:
            self._runner.detach()
        self._runner = None

    @property
    def runner(self) -> Any:
        return self._runner

    @property
    def kept(self) -> Optional[int]:
        """Layers whose activations the plan keeps (None before the first look)."""
        r = self._runner
        return r.kept if r is not None and r.planned else None

    @property
    def added(self) -> Optional[int]:
        """Layers the second look kept on top (None until it looked)."""
        return self._runner.added if self._runner is not None else None

    @property
    def engaged(self) -> bool:
        return bool(self.kept)
