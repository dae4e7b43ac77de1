"""The merge's logit checks, held to what the saved dtype must cost the model at hand, and what a failure says to do.

Why measured, not a fixed tolerance: a merged weight ``W + s * B @ A`` is rounded to the saved dtype, and how far that
rounding moves the logits depends on the model (its depth, its weights' scale, the prompts): on a trained
SmolLM2-135M, bfloat16 alone moved them by more than a fixed 5e-2 would allow, so a correct merge was rejected.

Contract (``MergeCheck``, on held-out prompts, logits in float32 on the CPU; figures as ``compare.compare``):
1. ``reference(adapter_model)``: the adapter model's logits (unmerged, on the base weights the merge uses) and, with
   the adapter disabled, the base's: how far the adapter moves the logits (``effect``).
2. ``merged(model)``: the merged model while still float32 against the adapter model: the same numbers up to
   summation order (``MERGE_TOLERANCE``); past it ``ExportCheckError``, before anything is saved. This is what
   tells a wrong merge (a dropped adapter, a wrong scale, an adapter merged twice) from rounding, whatever the dtype.
3. ``rounded(model)``: the same merged model after only rounding its weights to the saved dtype (in place):
   ``floor``, how far the rounding alone moves this model's logits.
4. ``saved(logits)``: the saved folder, reloaded, against the adapter model, within ``FLOOR_MARGIN`` times the
   floor plus ``MERGE_TOLERANCE``. A correct merge lands on the floor itself (the saved weights are the rounded
   ones), so it passes with that margin; past it ``ExportCheckError``.
A failure says how the merged model's change relates to the adapter's (none: dropped; k times: a wrong scale or a
double merge) and what to do. When the rounding moves the logits by as much as the adapter does (``effect`` below
``FLOOR_MARGIN`` times the floor), a note says the saved dtype keeps little of the training and to save in float32.
"""

from __future__ import annotations

import logging

import torch

from .compare import ExportCheckError, LogitCheck, check, compare, logits_of

logger = logging.getLogger(__name__)

# float32 merged weights against the unmerged adapter model: float32 summation order only
MERGE_TOLERANCE = 1e-4
# the saved folder may differ from the adapter model by this many times the saved dtype's measured rounding floor
FLOOR_MARGIN = 2.0

SKIP = "check_logits=False (--no-check from the command line) skips this check"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _cat(logits: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(logits) if logits else torch.zeros(0)


def scale_of_change(base: list[torch.Tensor], reference: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    """How many times the adapter's change of the logits ``got`` carries: the least-squares ``k`` in
    ``got - base ~= k * (reference - base)`` (1 for a right merge, 0 for a dropped adapter, ~2 for one merged twice);
    NaN when the adapter changes nothing."""
    want, have = _cat(reference) - _cat(base), _cat(got) - _cat(base)
    norm = float((want * want).sum())
    return float((have * want).sum()) / norm if norm > 0 else float("nan")


def diagnosis(k: float) -> str:
    """What a merged model carrying ``k`` times the adapter's change of the logits looks like."""
    if k != k:
        return "the adapter itself changes nothing on the check prompts"
    if abs(k) < 0.25:
        return (f"it carries {k:.2f} times the adapter's change of the logits: the adapter looks dropped (the base "
                "was saved without it, or the adapter did not load onto the base)")
    if abs(k - 1) < 0.25:
        return f"it carries {k:.2f} times the adapter's change of the logits: the direction is right, the values not"
    return (f"it carries {k:.2f} times the adapter's change of the logits: the adapter's scale looks wrong (lora_alpha "
            "/ r, or lora_alpha / sqrt(r) with use_rslora, as adapter_config.json says), or it was merged twice")


class MergeCheck:
    """The checks of one merge, in the order of the module docstring; each figure is kept for the report."""

    def __init__(self, rows: list[list[int]], dtype: torch.dtype) -> None:
        self.rows, self.dtype = rows, dtype
        self.reference_logits: list[torch.Tensor] = []
        self.base_logits: list[torch.Tensor] | None = None
        self.merged_logits: list[torch.Tensor] = []
        self.effect: LogitCheck | None = None
        self.merge: LogitCheck | None = None
        self.floor: LogitCheck | None = None
        self.check: LogitCheck | None = None
        self.notes: list[str] = []

    def reference(self, model: torch.nn.Module) -> None:
        """The adapter model's logits and, where it is a PEFT model, the base's with the adapter disabled."""
        self.reference_logits = logits_of(model, self.rows)
        if hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                self.base_logits = logits_of(model, self.rows)
            self.effect = compare("base vs adapter model (what the adapter changes)", self.reference_logits,
                                  self.base_logits, None)
            print(self.effect.line(), flush=True)

    def _scale(self, got: list[torch.Tensor]) -> str:
        return "" if self.base_logits is None else "; " + diagnosis(
            scale_of_change(self.base_logits, self.reference_logits, got))

    def merged(self, model: torch.nn.Module) -> None:
        """The float32 merged model against the adapter model; raises past ``MERGE_TOLERANCE``."""
        self.merged_logits = logits_of(model, self.rows)
        self.merge = compare("merged in float32 vs adapter model", self.reference_logits, self.merged_logits,
                             MERGE_TOLERANCE)
        print(self.merge.line(), flush=True)
        if not self.merge.ok:
            raise ExportCheckError(
                f"{self.merge.line()}. Before any rounding, the merged weights do not compute what the adapter model "
                f"computes{self._scale(self.merged_logits)}. Nothing was saved. Check that the adapter folder and "
                f"its base are the pair that was trained; {SKIP}.")

    def rounded(self, model: torch.nn.Module) -> None:
        """``model`` (the float32 merge) rounded to the saved dtype in place; measures the floor. Only what is saved
        is rounded (parameters, persistent buffers): a reloaded model recomputes the others (rotary frequencies)."""
        with torch.no_grad():
            for tensor in model.state_dict().values():
                if tensor.is_floating_point():
                    tensor.copy_(tensor.to(self.dtype))
        got = logits_of(model, self.rows)
        if not all(bool(t.isfinite().all()) for t in got):
            raise ExportCheckError(
                f"rounded to {dtype_name(self.dtype)} the merged model computes non-finite logits (its values do not "
                "fit the type): save in bfloat16 or float32 (dtype=, --dtype).")
        self.floor = compare(f"merged rounded to {dtype_name(self.dtype)} vs merged in float32 (the rounding floor)",
                             self.merged_logits, got, None)
        print(self.floor.line(), flush=True)
        if self.effect is not None and self.effect.rel < FLOOR_MARGIN * self.floor.rel:
            note = (f"rounding to {dtype_name(self.dtype)} moves the logits by {self.floor.rel:.2e} (relative), the "
                    f"adapter by {self.effect.rel:.2e}: in {dtype_name(self.dtype)} the merged model keeps little of "
                    "what training changed; save in float32 (dtype=torch.float32, --dtype float32) to keep it")
            self.notes.append(note)
            logger.warning("nbkit export: %s", note)

    def tolerance(self) -> float:
        return FLOOR_MARGIN * (self.floor.rel if self.floor else 0.0) + MERGE_TOLERANCE

    def saved(self, logits: list[torch.Tensor]) -> LogitCheck:
        """The reloaded folder's logits against the adapter model's; raises past ``tolerance()``."""
        name = dtype_name(self.dtype)
        result = compare(f"merged (reloaded) vs adapter model, {name} floor x{FLOOR_MARGIN:g}",
                         self.reference_logits, logits, self.tolerance())
        try:
            self.check = check(result)
        except ExportCheckError as error:
            floor = f"{self.floor.rel:.2e}" if self.floor else "not measured"
            raise ExportCheckError(
                f"{error} Rounding to {name} alone moves this model's logits by {floor}; the saved folder is further "
                f"than {FLOOR_MARGIN:g} times that from the adapter model{self._scale(logits)}. The files differ from "
                f"the merge that was checked: merge again (save in float32, dtype=torch.float32 or --dtype float32, "
                f"to rule out rounding); {SKIP}.") from None
        return self.check
