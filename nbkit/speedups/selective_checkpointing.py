"""Selective checkpointing: the last decoder layers whose activations fit in free GPU memory are not checkpointed.

Why: with gradient checkpointing every decoder layer's forward runs twice, once in the forward and once as the
recompute in backward. On short rows the step is bound by the host's Python, not the GPU, and the activations of
many or all layers would fit in memory anyway: their recompute is pure host time. This speedup leaves as many
layers un-checkpointed as fit, and the rest checkpointed as the user asked.

How (each step):

- Step 1 (the first training micro-batch) runs as the user asked, every layer checkpointed. nbkit's checkpoint
  function, installed on each checkpointed layer through the ledger around the one found, measures what the layer
  saves for backward: during the layer's recompute it chains a ``saved_tensors_hooks`` pack hook in front of
  checkpoint's own, which sums the bytes of the distinct storages saved (parameters left out) and hands every
  tensor on unchanged. That is exactly what the layer keeps when it is not checkpointed, measured where it is held
  anyway: no extra memory, no extra compute, no value changed.
- Before the next micro-batch (the trainer's ``before_micro_batch`` call; else at its first layer call) it decides,
  once: ``n`` = the most of the LAST layers whose saved bytes, scaled to the longest micro-batch the config allows
  (``max_tokens``), fit in ``SHARE`` of the memory left: the
  limit torch sees (the per-process fraction applied) less ``MARGIN`` of it, less the peak allocated so far, less
  what persistent memory grew since step 1 began (optimizer state). The last layers, because backward frees their
  activations first. Those layers get ``gradient_checkpointing = False`` (transformers' ``GradientCheckpointingLayer``
  checkpoints a layer when that instance flag is set and it trains), through the ledger. The readings are the
  allocator's host-side counters and one driver query of the device's free memory (``memory_readings``): no host
  sync.
- A second look, once, at the first micro-batch after an optimizer step that ran with the plan (``accumulation``:
  the micro-batches of an optimizer step). The first budget was a prediction (``SHARE`` of what step 1 left, which
  keeps a quarter back for what step 1 could not show); this one reads the peak the plan actually made, with the
  optimizer state in it. The peak's part above the memory held between micro-batches is scaled to the longest
  micro-batch (it was reached at the longest seen so far), the allocator's reserved memory counts where it is more
  (CUDA graphs' pools), and the layers just before the kept ones that fit in ``SHARE`` of what is left of the limit
  less ``MARGIN`` are un-checkpointed too. Only through the trainer's call; a hand-written loop gets one decision.

Beside offloaded checkpointing: an un-checkpointed layer keeps its activations on the GPU and is not offloaded; the
layers still checkpointed offload as before. Step 1's peak is the offloaded one, so on long rows, where offloading
is what made the row fit, the budget is small and few or no layers are un-checkpointed; on short rows on a large GPU
(where offload's "auto" engages from one layer input of 16 MiB) every layer may be.

Sizing: a layer's saved bytes scale with its tokens, linearly (the varlen and SDPA kernels save O(tokens)), or with
their square when the model runs eager attention (its probabilities are tokens x tokens: a conservative bound for a
layer whose other activations are linear). The peak is ``torch.cuda.max_memory_allocated`` as the process has it
(never reset here): after a larger run in the same process (a notebook kernel) it is that run's, and fewer layers
are un-checkpointed than would fit.

Modes: True (engage wherever it can: also off CUDA, where there are no memory counters to size by and every layer
is un-checkpointed; for tests), "auto" (a CUDA model). It does not attach without checkpointed layers; it does not
engage when ``max_tokens`` is unknown (``max_length=None`` and no tokenized map-style dataset: FastSFT bounds it
by batch size x the longest example otherwise, the padding-free unpacked recipe), said once. What it decided is
said once, by name (each of the two looks); ``engaged`` says whether any layer was un-checkpointed.

Contract: the same losses and gradients as plain checkpointing (the same forward, its saved tensors kept instead of
recomputed); ``detach()`` puts every flag and checkpoint function back, and is safe twice.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Literal, Optional, Union

import torch

from ..memory import fmt_bytes, gpu_in_use, gpu_reserved, memory_readings
from ..model_parts import decoder_layers, unwrap_model
from ..say_once import SayOnce
from ..settings import check_value
from .ledger import PatchLedger

logger = logging.getLogger(__name__)

Mode = Union[bool, Literal["auto"]]
MARGIN = 0.10  # of the GPU's limit, never planned for: allocator fragmentation, kernels' workspaces
SHARE = 0.75  # of what is left after the margin and the peak: what un-checkpointed layers may take


def layers_to_keep(saved_bytes: list[int], budget: int) -> int:
    """How many of the last layers (``saved_bytes`` in layer order, each at the longest micro-batch) fit in
    ``budget`` bytes together."""
    total, n = 0, 0
    for size in reversed(saved_bytes):
        if total + size > budget:
            break
        total, n = total + size, n + 1
    return n


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of a tensor's storage; a tensor without a plain one (a subclass) is keyed by itself."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t), t.numel() * t.element_size()


def _tokens(args: tuple, function: Callable) -> Optional[int]:
    """Tokens of a layer call: its hidden states, positional (transformers' convention) or bound by keyword."""
    x = args[0] if args else getattr(function, "keywords", {}).get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    return x.numel() // x.shape[-1]


class _Measure:
    """The layer's checkpointed function, measuring what it saves at its second run (the recompute; with reentrant
    checkpointing, the first runs without grad and saves nothing)."""

    def __init__(self, owner: SelectiveCheckpointing, index: int, function: Callable) -> None:
        self.owner, self.index, self.function, self.runs = owner, index, function, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.runs += 1
        top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if self.runs != 2 or not torch.is_grad_enabled() or top_hooks is None:
            return self.function(*args, **kwargs)
        # the hooks on top now are checkpoint's recompute hooks (None with reentrant checkpointing): chain them
        top = top_hooks(False)
        inner_pack, inner_unpack = top if top is not None else (lambda t: t, lambda t: t)
        params, seen = self.owner._param_storages, {}

        def pack(t: torch.Tensor) -> Any:
            key, size = _storage(t)
            if key not in params:
                seen[key] = max(size, seen.get(key, 0))
            return inner_pack(t)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
                return self.function(*args, **kwargs)
        finally:  # also when checkpoint stops the recompute early: every saved tensor was seen by then
            self.owner._saved[self.index] = sum(seen.values())


class _Installed:
    """What nbkit puts in a layer's ``_gradient_checkpointing_func``: the function found, measured at step 1."""

    def __init__(self, owner: SelectiveCheckpointing, index: int, layer: torch.nn.Module, previous: Callable) -> None:
        self.owner, self.index, self.layer, self.previous = owner, index, layer, previous

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        if owner._look_again_pending:  # the second look scales the measured peak by the longest call seen
            owner._longest = max(owner._longest, _tokens(args, function) or 0)
        if owner.kept is None:
            if self.index not in owner._tokens:  # step 1: checkpointed as asked, measured
                owner._first_call(self.index, _tokens(args, function))
                return self.previous(_Measure(owner, self.index, function), *args, **kwargs)
            owner._decide()  # called again: step 1's forward and backward are done
        if self.layer.gradient_checkpointing is False:  # un-checkpointed by the decision just made
            return function(*args, **kwargs)
        return self.previous(function, *args, **kwargs)


class SelectiveCheckpointing:
    """Leave the last decoder layers that fit in free GPU memory un-checkpointed, decided after the first step.

    ``max_tokens``: the most tokens one micro-batch can hold (batch size x max_length, or x the dataset's longest
    example); None: unknown, stays off. ``accumulation``: micro-batches per optimizer step (the second look waits
    for one optimizer step after the plan, so that the optimizer state is in the peak it reads).
    After the decision, ``kept`` is the number of layers un-checkpointed (the second look adds to it; ``added`` says
    how many it added) and ``per_token`` their measured saved bytes per token, layer by layer.
    """

    name = "selective_checkpointing"

    def __init__(self, mode: Mode = "auto", max_tokens: Optional[int] = None, accumulation: int = 1) -> None:
        check_value("selective_checkpointing", mode)
        self.mode, self.max_tokens, self.accumulation = mode, max_tokens, max(1, int(accumulation))
        self._ledger = PatchLedger(self.name)
        self._say = SayOnce(logger, "nbkit selective_checkpointing")
        self._reset()

    def _reset(self) -> None:
        self._layers: list[torch.nn.Module] = []
        self._installed: list[_Installed] = []
        self._param_storages: set[int] = set()
        self._device = torch.device("cpu")
        self._quadratic = False
        self._tokens: dict[int, int] = {}
        self._saved: dict[int, int] = {}
        self._allocated_at_start: Optional[int] = None
        self.kept: Optional[int] = None
        self.added: Optional[int] = None  # by the second look; None until it looked
        self.per_token: list[float] = []
        self.planned_bytes = 0
        self._need: list[int] = []
        self._max_tokens_planned = 0
        self._planned_at: Optional[int] = None  # the micro-batch before which the plan was made
        self._look_again_pending = False
        self._longest = 0

    @property
    def engaged(self) -> bool:
        """Whether any layer is un-checkpointed now (False before the decision and when none fit)."""
        return bool(self.kept)

    # ------------------------------------------------------------------------------------------------ attach/detach
    def attach(self, model: torch.nn.Module) -> bool:
        self.detach()
        if self.mode is False:
            self._say("off", "off (selective_checkpointing=False)", logging.INFO)
            return False
        found = decoder_layers(model)
        if found is None:
            self._say("old", "this transformers has no per-layer checkpointing flag; stays off")
            return False
        base = unwrap_model(model)
        layers = [m for m in found
                  if m.gradient_checkpointing is True and callable(getattr(m, "_gradient_checkpointing_func", None))]
        if not layers:
            self._say("nogc", f"no checkpointed layer in {type(base).__name__}; nothing to do", logging.INFO)
            return False
        if self.max_tokens is None:
            self._say("unbounded", "the longest micro-batch is unknown (max_length=None and no tokenized dataset "
                      "to bound it), so what fits cannot be sized; every layer stays checkpointed")
            return False
        param = next(base.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if self.mode == "auto" and memory_readings(device) is None:
            self._say("auto", f"off (model on {device.type}; 'auto' sizes by CUDA memory)", logging.INFO)
            return False
        # the decoder stack: the most common checkpointed layer class (a vision tower's blocks are left as they are)
        kind, _ = Counter(type(m) for m in layers).most_common(1)[0]
        self._layers = [m for m in layers if type(m) is kind]
        self._device = device
        self._quadratic = getattr(getattr(base, "config", None), "_attn_implementation", None) == "eager"
        self._param_storages = {_storage(t)[0] for t in (*base.parameters(), *base.buffers())}
        for i, layer in enumerate(self._layers):
            inst = _Installed(self, i, layer, layer._gradient_checkpointing_func)
            self._ledger.set(layer, "_gradient_checkpointing_func", inst)
            self._installed.append(inst)
        return True

    def detach(self) -> None:
        self._ledger.undo()
        self._reset()

    # ------------------------------------------------------------------------------------------------------ policy
    def before_micro_batch(self, index: int, reserved: int = 0) -> int:
        """Called by the trainer before each training micro-batch: decide before the second (step 1 measured), so
        that what spends memory after this (``dequant_cache``) sees the plan; return the bytes the kept layers take
        at the longest micro-batch. Without the call the decision comes at the next layer call, as before."""
        if self.kept is None and index >= 2 and self._tokens and self._saved:
            self._decide()
        if self.kept is not None and self._planned_at is None:
            self._planned_at = index  # decided here, or at a layer call of the micro-batch before this one
        if self._look_again_pending and self._planned_at is not None and index > self._planned_at:
            # the first micro-batch after the optimizer step that closed the plan's first micro-batch
            step_end = -(-self._planned_at // self.accumulation) * self.accumulation
            if index > step_end:
                self._look_again()
        return self.planned_bytes

    def _first_call(self, index: int, tokens: Optional[int]) -> None:
        if not self._tokens and self._device.type == "cuda":
            self._allocated_at_start = gpu_in_use(self._device)
        self._tokens[index] = tokens or 0
        self._longest = max(self._longest, tokens or 0)

    def _decide(self) -> None:
        self.kept = 0
        per_token = {i: self._saved[i] / self._tokens[i] for i in self._saved if self._tokens.get(i)}
        if not per_token:
            self._say("decide", "every layer stays checkpointed (step 1 saved nothing it could measure)")
            return
        worst = max(per_token.values())
        self.per_token = [per_token.get(i, worst) for i in range(len(self._layers))]  # unmeasured: the worst
        tokens = max(self.max_tokens or 0, *self._tokens.values())
        measured_at = {i: self._tokens[i] for i in per_token}
        shortest = min(measured_at.values())
        power = 2 if self._quadratic else 1
        need = [int(p * tokens * (tokens / measured_at.get(i, shortest)) ** (power - 1))
                for i, p in enumerate(self.per_token)]
        readings = memory_readings(self._device)
        if readings is None:  # mode=True off CUDA: no counters to size by
            budget, sized = sum(need), f"no memory counters on {self._device.type}: all of them"
        else:
            limit, peak, allocated = readings
            grown = max(0, allocated - (self._allocated_at_start or allocated))
            budget = max(0, int(SHARE * (limit * (1 - MARGIN) - peak - grown)))
            sized = (f"{fmt_bytes(budget)} to spend: {SHARE:.0%} of the {fmt_bytes(limit)} limit less "
                     f"{MARGIN:.0%}, the {fmt_bytes(peak)} peak and {fmt_bytes(grown)} grown since step 1")
        self.kept = layers_to_keep(need, budget)
        self.planned_bytes = sum(need[len(need) - self.kept:]) if self.kept else 0
        for layer in self._layers[len(self._layers) - self.kept:]:
            self._ledger.set(layer, "gradient_checkpointing", False)
        self._need, self._max_tokens_planned = need, tokens
        self._look_again_pending = readings is not None and self.kept < len(self._layers)
        mean = sum(self.per_token) / len(self.per_token)
        self._say("decide", f"{self.kept} of {len(self._layers)} layers un-checkpointed (the last ones; the rest "
                  f"recompute as before): a layer saves {mean / 1024:.1f} KiB per token for backward, "
                  f"{fmt_bytes(sum(need) // len(need))} at the longest micro-batch of {tokens} tokens "
                  f"({'scaled as tokens squared: eager attention; ' if self._quadratic else ''}{sized})",
                  logging.INFO)

    def _look_again(self) -> None:
        """The second look: more of the layers before the kept ones, in ``SHARE`` of the room the plan's measured
        peak left (see the module docstring)."""
        self._look_again_pending, self.added = False, 0
        readings = memory_readings(self._device)
        if readings is None:
            return
        limit, peak, allocated = readings
        scale = max(1.0, self._max_tokens_planned / self._longest) if self._longest else 1.0
        projected = allocated + int(max(0, peak - allocated) * scale)
        used = max(projected, gpu_reserved(self._device))
        budget = max(0, int(SHARE * (limit * (1 - MARGIN) - used)))
        checkpointed = len(self._layers) - self.kept
        self.added = layers_to_keep(self._need[:checkpointed], budget)
        newly = self._layers[checkpointed - self.added:checkpointed]
        for layer in newly:
            self._ledger.set(layer, "gradient_checkpointing", False)
        self.kept += self.added
        self.planned_bytes += sum(self._need[checkpointed - self.added:checkpointed])
        self._say("again", f"second look, with the plan's peak measured: {self.added} more of {len(self._layers)} "
                  f"layers un-checkpointed, {self.kept} in all ({fmt_bytes(budget)} to spend: {SHARE:.0%} of the "
                  f"{fmt_bytes(limit)} limit less {MARGIN:.0%} and the {fmt_bytes(used)} the plan's peak comes to at "
                  f"{self._max_tokens_planned} tokens, reserved memory counted where it is more)", logging.INFO)
