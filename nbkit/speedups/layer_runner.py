"""The one nbkit wrapper on a decoder layer: it runs each layer as its ``LayerPlan`` says, and makes the plan.

Why one: a checkpointed layer used to pass three wrappers (graphs on ``forward``; selective checkpointing and offload
both on ``_gradient_checkpointing_func``), with the tiled MLP and the dequantized weights beside them, their order
fixed by a table and their memory budgeted five times. Here one object holds the run's layers, one plan per layer
(``layer_plan``) and one budget (``layer_budget``); the modes are engines it drives and never wrap anything:

- ``offload`` (``offload.OffloadedCheckpointing``): a checkpointed layer's input kept in host memory;
- ``graphs`` (``cuda_graphs.CudaGraphs``): a kept or checkpointed layer replayed as CUDA graphs;
- ``tiled`` (``tiled_mlp.TiledMLP``): the MLP over tiles of the sequence where it would crowd the GPU;
- ``keep`` (``selective_checkpointing.SelectiveCheckpointing``): which layers may keep their activations, and the
  longest micro-batch they are sized for;
- ``dequant`` (``dequant_cache.DequantCache``): which 4-bit weights may be kept dequantized.
A mode that is None (its switch off) is never used: the plan never chooses it.

How a run goes:

- ``attach(model)`` (when ``train()`` or ``evaluate()`` starts): each decoder layer's ``forward`` and its MLP's
  ``forward`` become the runner's, through the ledger. Outside training they call the layer's own (the MLP tiled
  where the ``tiled`` mode says).
- ``begin_training()`` (when training begins: transformers has enabled gradient checkpointing by then): the layers
  checkpointed as the user asked are taken over. Their flag stays on (``model.is_gradient_checkpointing`` reads as
  under ``SFTTrainer``, and transformers still drops a cache argument as it does for a checkpointed layer); the
  function transformers calls with it becomes ``run_as_is`` through the ledger, and the runner calls the user's
  checkpoint function (with its arguments) itself, for the layers its plan checkpoints. Step 1's plan is what the
  user asked: checkpointed layers checkpointed (offloaded where the offload mode engages at the first call), the
  others kept (and graphed). With ``cuda_graphs_checkpointed``, checkpointed layers, offloaded or not, are graphed
  from the first look on (step 1 measures them eagerly), where the user's checkpoint function is torch's own
  (``torch.utils.checkpoint.checkpoint``, as transformers installs it): their graphs save the input as checkpoint
  does, and the offload packs it; the looks hold back what their pool will hold. Layers with the MLP recomputed run
  eagerly.
- Step 1 measures, in each checkpointed layer's recompute, what it saves for backward (a ``saved_tensors_hooks``
  pack hook chained before checkpoint's own, counting distinct storages that are not parameters; the MLP's share
  apart): what it would keep un-checkpointed, measured where it is held anyway, no value changed.
- At the first layer call of micro-batch 2: the first look. Each layer's cost at the longest micro-batch (linear in
  tokens; as tokens squared under eager attention), the budget's first look, ``layer_plan.spend``, the weights
  dequantized where the plan says, and the plan said in one line.
- After the first optimizer step that ran with the plan (the trainer's ``on_optimizer_step`` calls
  ``optimizer_stepped``), at the next micro-batch's first layer call: the second look, from the peak the plan made.
  A hand-written loop gets the first look only.

Contract: the same losses and gradients as the user's checkpointing (a kept layer's saved tensors are the ones the
recompute would have made); ``detach()`` puts every forward, function and kept copy back and is safe twice.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..model_parts import decoder_layers, unwrap_model
from ..say_once import SayOnce
from .layer_budget import Budget, Look
from .layer_plan import CHECKPOINTED, KEPT, MLP_RECOMPUTED, OFFLOADED, UNSIZED, Allowed, LayerCost, LayerPlan, describe, spend
from .ledger import PatchLedger

logger = logging.getLogger(__name__)


def run_as_is(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """What transformers calls, instead of the user's checkpoint function, for a layer the runner took over: the
    layer's forward as it is. The runner is inside it and checkpoints the layer itself where its plan says so."""
    return function(*args, **kwargs)


def _torch_checkpoint(function: Optional[Callable]) -> bool:
    """Whether a checkpoint function is torch's own with keyword arguments alone (transformers' partial): what the
    recompute graphs reproduce. Not transformers' ``offload=True`` variant, nor a user's own."""
    return isinstance(function, functools.partial) and function.func is checkpoint and not function.args


FFN_NAMES = ("mlp", "feed_forward", "block_sparse_moe")  # a decoder layer's feed-forward submodule, by family


def ffn_of(layer: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The layer's feed-forward submodule, if it has a known one."""
    for name in FFN_NAMES:
        sub = layer._modules.get(name)
        if isinstance(sub, torch.nn.Module):
            return sub
    return None


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of a tensor's storage; a tensor without a plain one (a subclass) is keyed by itself."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t), t.numel() * t.element_size()


def _tokens(x: Any) -> int:
    return x.numel() // x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() >= 2 else 0


@dataclass
class Layer:
    """One decoder layer as the runner holds it."""

    index: int
    module: torch.nn.Module
    original: Callable  # its forward as found
    name: str
    mlp: Optional[torch.nn.Module] = None
    mlp_original: Optional[Callable] = None
    checkpointed: bool = False  # as the user asked, when training began
    checkpoint: Optional[Callable] = None  # the user's checkpoint function (transformers' partial)
    graphable: bool = False  # checkpointed by torch's own checkpoint: its graphs may stand for it
    # step 1's measurement: tokens of the call, bytes saved in the recompute, of them the MLP's, and the MLP's input
    tokens: int = 0
    saved: int = 0
    mlp_saved: int = 0
    mlp_input: int = 0
    input: int = 0
    measured: bool = False
    bases: list = field(default_factory=list)  # the 4-bit LoRA bases the dequant mode may keep dequantized


class _Measure:
    """A checkpointed layer's function at step 1, measuring what it saves at its second run (the recompute; with
    reentrant checkpointing the first runs without grad and saves nothing)."""

    def __init__(self, runner: LayerRunner, layer: Layer, function: Callable) -> None:
        self.runner, self.layer, self.function, self.runs = runner, layer, function, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.runs += 1
        top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if self.runs != 2 or not torch.is_grad_enabled() or top_hooks is None:
            return self.function(*args, **kwargs)
        top = top_hooks(False)  # checkpoint's recompute hooks (None with reentrant checkpointing): chained
        inner_pack, inner_unpack = top if top is not None else (lambda t: t, lambda t: t)
        params, seen, in_mlp = self.runner._param_storages, {}, {}
        runner = self.runner

        def pack(t: torch.Tensor) -> Any:
            key, size = _storage(t)
            if key not in params:
                seen[key] = max(size, seen.get(key, 0))
                if runner._in_mlp:
                    in_mlp[key] = seen[key]
            return inner_pack(t)

        runner._measuring_mlp = self.layer
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
                return self.function(*args, **kwargs)
        finally:  # also when checkpoint stops the recompute early: every saved tensor was seen by then
            runner._measuring_mlp = None
            self.layer.saved, self.layer.mlp_saved, self.layer.measured = sum(seen.values()), sum(in_mlp.values()), True


class LayerRunner:
    """Runs every decoder layer by its plan, and plans (see the module docstring). Modes: ``keep``, ``offload``,
    ``graphs``, ``tiled``, ``dequant`` (None: off). ``readings``: the budget's memory readings (tests)."""

    name = "decoder_layers"

    def __init__(self, keep: Any = None, offload: Any = None, graphs: Any = None, tiled: Any = None,
                 dequant: Any = None, readings: Optional[Callable] = None) -> None:
        self.keep, self.offload, self.graphs, self.tiled, self.dequant = keep, offload, graphs, tiled, dequant
        self._readings = readings
        self._ledger = PatchLedger(self.name)
        self._say = SayOnce(logger, "nbkit")
        self._reset()

    def _reset(self) -> None:
        self.layers: list[Layer] = []
        self.plans: list[LayerPlan] = []
        self.costs: list[LayerCost] = []
        self.budget: Optional[Budget] = None
        self.training = False
        self.forwards = 0  # training forwards since begin_training
        self.planned = False  # the first look was taken
        self.kept_by_first: Optional[int] = None
        self.added: Optional[int] = None  # layers the second look upgraded; None until it looked
        self.max_tokens = 0
        self._second_pending = False
        self._steps_since_plan = 0
        self._longest = 0  # tokens of the longest micro-batch since step 1
        self._param_storages: set[int] = set()
        self._quadratic = False
        self._in_mlp = False
        self._measuring_mlp: Optional[Layer] = None
        self._weights_4bit = False
        self.line: Optional[str] = None  # the plan, said in one line

    @property
    def modes(self) -> list[Any]:
        return [m for m in (self.keep, self.offload, self.graphs, self.tiled, self.dequant) if m is not None]

    # ------------------------------------------------------------------------------------------------ attach/detach
    def attach(self, model: torch.nn.Module) -> bool:
        self.detach()
        found = decoder_layers(model)
        if found is None:
            self._say("old", "this transformers has no decoder layer class; the layers run as they are")
            return False
        if not found or not self.modes:
            return False
        base = unwrap_model(model)
        kind, _ = Counter(type(m) for m in found).most_common(1)[0]  # the decoder stack, not a vision tower's
        modules = [m for m in found if type(m) is kind]
        param = next(base.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        self.budget = Budget(device, self._readings)
        self._quadratic = getattr(getattr(base, "config", None), "_attn_implementation", None) == "eager"
        names = {id(m): n for n, m in base.named_modules()}
        self.layers = [Layer(i, m, m.forward, names.get(id(m), type(m).__name__)) for i, m in enumerate(modules)]
        for mode in list(self.modes):
            prepare = getattr(mode, "prepare", None)
            if prepare is not None and not prepare(self, base):
                self._drop(mode)
        if not self.modes:
            self.layers = []
            return False
        for layer in self.layers:
            self._ledger.set(layer.module, "forward", self._layer_forward(layer))
            layer.mlp = ffn_of(layer.module)
            if layer.mlp is not None:
                layer.mlp_original = layer.mlp.forward
                self._ledger.set(layer.mlp, "forward", self._mlp_forward(layer))
        self.plans = [LayerPlan(KEPT, graphed=self.graphs is not None) for _ in self.layers]
        return True

    def _drop(self, mode: Any) -> None:
        for role in ("keep", "offload", "graphs", "tiled", "dequant"):
            if getattr(self, role) is mode:
                setattr(self, role, None)

    def detach(self) -> None:
        for mode in self.modes:
            release = getattr(mode, "release", None)
            if release is not None:
                release()
        self._ledger.undo()
        self._reset()

    def reset(self) -> None:
        """After a step that raised (an OOM): give back the GPU memory the offload held for it."""
        if self.offload is not None:
            self.offload.reset()

    # --------------------------------------------------------------------------------------------------- training
    def begin_training(self, model: Any = None) -> bool:
        """Take over the layers checkpointed as the user asked; step 1's plan. Returns whether a mode is left."""
        if not self.layers or self.training:
            return bool(self.layers)
        for layer in self.layers:
            m = layer.module
            layer.checkpointed = m.gradient_checkpointing is True and callable(
                getattr(m, "_gradient_checkpointing_func", None))
            if layer.checkpointed:
                layer.checkpoint = m._gradient_checkpointing_func
                layer.graphable = _torch_checkpoint(layer.checkpoint)
                self._ledger.set(m, "_gradient_checkpointing_func", run_as_is)
        checkpointed = [layer for layer in self.layers if layer.checkpointed]
        if self.offload is not None and not self.offload.take(self, checkpointed):
            self._drop(self.offload)
        if self.keep is not None and not self.keep.take(self, checkpointed):
            self._drop(self.keep)
        if self.dequant is not None and not self.dequant.take(self):
            self._drop(self.dequant)
        self._weights_4bit = any(layer.bases for layer in self.layers) or self._any_4bit()
        if checkpointed:
            base = unwrap_model(model) if model is not None else None
            params = [*base.parameters(), *base.buffers()] if base is not None else \
                [t for layer in self.layers for t in (*layer.module.parameters(), *layer.module.buffers())]
            self._param_storages = {_storage(t)[0] for t in params}
        self.plans = [LayerPlan(CHECKPOINTED if layer.checkpointed else KEPT,
                                graphed=self.graphs is not None and not layer.checkpointed) for layer in self.layers]
        self.training = True
        return bool(self.modes)

    def _any_4bit(self) -> bool:
        from .nf4_weights import is_linear4bit

        return any(is_linear4bit(m) for layer in self.layers for m in layer.module.modules())

    def optimizer_stepped(self) -> None:
        """An optimizer step ended (the trainer's ``on_optimizer_step``): the second look may come."""
        if self.planned:
            self._steps_since_plan += 1

    def _forward_starts(self, x: torch.Tensor) -> None:
        """At the first layer call of a training forward: step 1's setup, or a look."""
        self.forwards += 1
        tokens = _tokens(x)
        if self.forwards == 1:
            if self.budget is not None:
                self.budget.start()
            if self.offload is not None and self.offload.engages(x):
                self.plans = [replace(p, activations=OFFLOADED) if p.activations == CHECKPOINTED else p
                              for p in self.plans]
        elif not self.planned:
            self._first_look()
        elif self._second_pending and self._steps_since_plan >= 1:
            self._second_look()
        self._longest = max(self._longest, tokens)

    # -------------------------------------------------------------------------------------------------------- calls
    def _layer_forward(self, layer: Layer) -> Callable:
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not (self.training and layer.module.training and torch.is_grad_enabled()):
                return layer.original(hidden_states, *args, **kwargs)
            if layer.index == 0:
                self._forward_starts(hidden_states)
            plan = self.plans[layer.index]
            if plan.activations in (KEPT, MLP_RECOMPUTED):
                if plan.graphed and self.graphs is not None:
                    return self.graphs.call(self, layer, hidden_states, args, kwargs)
                return layer.original(hidden_states, *args, **kwargs)
            graphed = None
            if plan.graphed and self.graphs is not None:
                def graphed(x: torch.Tensor) -> Optional[torch.Tensor]:
                    return self.graphs.call_checkpointed(self, layer, x, args, kwargs)
            function = layer.original
            if not self.planned and not layer.measured:
                layer.tokens, layer.input = _tokens(hidden_states), hidden_states.numel() * hidden_states.element_size()
                function = _Measure(self, layer, function)
            if plan.activations == OFFLOADED and self.offload is not None:
                return self.offload.checkpoint(layer, function, hidden_states, args, kwargs, graphed)
            out = graphed(hidden_states) if graphed is not None else None
            if out is not None:
                return out
            return layer.checkpoint(functools.partial(function, **kwargs), hidden_states, *args)

        return forward

    def _mlp_forward(self, layer: Layer) -> Callable:
        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs:
                return layer.mlp_original(x, *args, **kwargs)
            function = layer.mlp_original
            if self.tiled is not None and self.tiled.wants(self, layer, x):
                function = self.tiled.bind(layer, function)
            elif (self.training and self.plans[layer.index].activations == MLP_RECOMPUTED
                  and layer.module.training and torch.is_grad_enabled()):
                return checkpoint(function, x, use_reentrant=False)
            if self._measuring_mlp is layer:  # step 1's recompute: what the MLP saves, and its input
                layer.mlp_input = x.numel() * x.element_size()
                self._in_mlp = True
                try:
                    return function(x)
                finally:
                    self._in_mlp = False
            return function(x)

        return forward

    # ------------------------------------------------------------------------------------------------------- looks
    def _layer_costs(self) -> list[LayerCost]:
        """Each layer's bytes at the longest micro-batch, from step 1's measurement (an unmeasured layer: the
        largest measured; no measurement: zero activations, weights only)."""
        measured = [layer for layer in self.layers if layer.measured and layer.tokens]
        self.max_tokens = max([self.keep.max_tokens if self.keep is not None and self.keep.max_tokens else 0,
                               self._longest, *(layer.tokens for layer in measured)])
        power = 2 if self._quadratic else 1
        worst = max(measured, key=lambda layer: layer.saved / layer.tokens, default=None)
        costs = []
        for layer in self.layers:
            weights = self.dequant.bytes_of(layer) if self.dequant is not None else 0
            source = layer if layer.measured and layer.tokens else worst
            if source is None:  # nothing measured (no backward ran): a checkpointed layer is never kept unsized
                unsized = UNSIZED if layer.checkpointed else 0
                costs.append(LayerCost(unsized, unsized, 0, weights))
                continue
            scale = self.max_tokens / source.tokens
            kept = int(source.saved * scale * scale ** (power - 1))
            mlp_part = int(source.mlp_saved * scale)
            split = kept - mlp_part + int(source.mlp_input * scale) if source.mlp_saved else kept
            costs.append(LayerCost(kept, split, int(source.input * scale), weights))
        return costs

    def _allowed(self) -> Allowed:
        keep = self.keep is not None
        return Allowed(keep=keep, split=keep and self.keep.split, dequantize=self.dequant is not None, onload=keep)

    def _first_look(self) -> None:
        self.planned = True
        self.costs = self._layer_costs()
        look = self._held_back(self.budget.first_look() if self.budget is not None else None)
        forced = (self.keep is not None and self.keep.mode is True) or \
            (self.dequant is not None and self.dequant.mode is True)
        budget = look.spend if look is not None else (sum(c.kept + c.weights for c in self.costs) if forced else 0)
        self._apply(spend(self.plans, self.costs, budget, self._allowed())[0])
        if self.dequant is not None and self.dequant.mode is True:
            self._apply([replace(p, dequantized=True) for p in self.plans])
        self.kept_by_first = self.kept
        self._second_pending = look is not None and self._more_to_plan()
        why = look.why if look is not None else "no memory counters on this device: as the modes force"
        self._say_plan("first", why)

    def _held_back(self, look: Optional[Look]) -> Optional[Look]:
        """``look`` less what the checkpointed layers' graphs will hold for good (``CudaGraphs.recompute_reserve``):
        one budget for the activations the plan keeps and the graphs' pool."""
        reserve = self.graphs.recompute_reserve(self) if look is not None and self.graphs is not None else 0
        if not reserve:
            return look
        return Look(max(0, look.spend - reserve), f"{look.why}, less {reserve / 2**30:.2f} GiB held back for the "
                    "checkpointed layers' graphs")

    def _more_to_plan(self) -> bool:
        """Whether a later look could upgrade a layer: activations not all kept, or weights left 4-bit."""
        allowed = self._allowed()
        return any((allowed.keep and p.activations != KEPT) or (allowed.dequantize and c.weights and not p.dequantized)
                   for p, c in zip(self.plans, self.costs))

    def _second_look(self) -> None:
        self._second_pending = False
        before = self.kept
        scale = self.max_tokens / self._longest if self._longest else 1.0
        look = self._held_back(self.budget.second_look(scale) if self.budget is not None else None)
        if look is None:
            self.added = 0
            return
        self._apply(spend(self.plans, self.costs, look.spend, self._allowed())[0])
        self.added = self.kept - before
        self._say_plan("second", "second look, with the plan's peak measured: " + look.why)

    def _apply(self, plans: list[LayerPlan]) -> None:
        """Take ``plans``: kept layers graphed where the graphs mode runs, and checkpointed ones where torch's
        checkpoint is theirs; weights dequantized where newly planned."""
        graphs = self.graphs is not None
        checkpointed = graphs and self.graphs.checkpointed
        plans = [replace(p, graphed=graphs and (p.activations == KEPT or (checkpointed and layer.graphable and
                                                                            p.activations in (CHECKPOINTED, OFFLOADED))))
                 for p, layer in zip(plans, self.layers)]
        for layer, old, new in zip(self.layers, self.plans, plans):
            if new.dequantized and not old.dequantized and self.dequant is not None:
                self.dequant.keep_layer(self._ledger, layer)
        self.plans = plans

    def _say_plan(self, key: str, why: str) -> None:
        self.line = describe(self.plans, self._weights_4bit)
        mean = [c.kept for c in self.costs if c.kept]
        sized = (f"; a layer keeps ~{sum(mean) // len(mean) / 2**20:.0f} MiB at the longest micro-batch of "
                 f"{self.max_tokens} tokens{' (eager attention: as tokens squared)' if self._quadratic else ''}"
                 if mean else "")
        self._say(f"plan:{key}", f"{self.line} ({why}{sized})", logging.INFO)

    # ------------------------------------------------------------------------------------------------------ results
    @property
    def kept(self) -> int:
        """Layers whose activations are kept (whole, or all but the MLP's)."""
        return sum(p.activations in (KEPT, MLP_RECOMPUTED) and layer.checkpointed
                   for p, layer in zip(self.plans, self.layers))

    def engaged_modes(self) -> list[str]:
        """The switches whose mode did something this run, by name."""
        names = []
        if self.tiled is not None:
            names.append(self.tiled.name)
        if self.offload is not None and (self.offload.engaged or any(p.activations == OFFLOADED for p in self.plans)):
            names.append(self.offload.name)
        if self.keep is not None and self.kept:
            names.append(self.keep.name)
        if self.dequant is not None and self.dequant.engaged:
            names.append(self.dequant.name)
        if self.graphs is not None and self.graphs.engaged:
            names.append(self.graphs.name)
        return names

    def stats(self) -> dict:
        """What the run did, for benchmarks and the dashboard: the plan's line, and each mode's counters."""
        out: dict[str, Any] = {"plan": self.line, "layers": len(self.layers)}
        if self.graphs is not None:
            out.update(self.graphs.counters())
        if self.offload is not None:
            out["offload_packs"] = self.offload.stats.packs
        return out


def standalone(mode: Any, role: str, model: torch.nn.Module, readings: Optional[Callable] = None) -> LayerRunner:
    """A runner with ``mode`` alone as ``role``, attached to ``model`` and its training begun (for a mode used on
    its own, outside FastSFT: ``mode.attach(model)``). Where ``mode`` takes no part, the runner is detached again:
    nothing is left wrapped (the mode's ``attach`` reads ``getattr(runner, role) is mode`` as its result)."""
    runner = LayerRunner(**{role: mode}, readings=readings)
    if not (runner.attach(model) and runner.begin_training(model)):
        runner.detach()
    if not runner.layers:
        runner._drop(mode)
    return runner
