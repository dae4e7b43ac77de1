"""Offloaded checkpointing: a checkpointed layer's input kept in host memory, restored ahead of its recompute.

Why: with non-reentrant gradient checkpointing the only activation a checkpointed layer keeps is its input (the
hidden states, ``tokens x hidden`` values). At long context those inputs, one per layer, are what fills the GPU.
This engine keeps them in host memory instead, and hides the copies behind compute.

An engine of the layer runner (``layer_runner``), which holds the layers and calls it; it wraps nothing. When
training begins the runner takes over the layers checkpointed as the user asked and hands them to ``take``, which
keeps each one's checkpoint arguments (the user's ``gradient_checkpointing_kwargs``, read from the checkpoint
function transformers set on the layer) and refuses what it cannot run: reentrant checkpointing, a checkpoint
function it does not recognise. At the first training call ``engages`` decides for the run (True: always; 'auto':
a CUDA GPU that does not share host memory, and one layer input of at least ``min_bytes``), and the runner's plan
offloads every checkpointed layer; with the keep mode beside it, a later look of the plan may put some inputs back
on the GPU where the budget allows (``layer_plan``). For each layer its plan offloads, the runner calls ``checkpoint``:

- Forward: ``torch.utils.checkpoint.checkpoint`` (non-reentrant, the user's kwargs) inside ``saved_tensors_hooks``.
  Non-reentrant checkpoint saves exactly its positional tensor inputs through those hooks; the layer's keyword
  arguments (the mask, the cos/sin position embeddings every layer shares) are bound in a ``functools.partial``, as
  transformers binds them, and are never saved, so never copied. The layer's input (the runner passes it first) is
  copied into a slot of a host pool on a side CUDA stream, after an event on the compute stream; the GPU tensor is
  dropped once the copy's event has completed. The pool is allocated during the first step, reused afterwards, and
  grows only if a larger input comes.
- Backward, double buffering: layer i's backward starts with its recompute, which restores its input; the input of
  layer i-1 (packed just before it) is copied back on the side stream *after layer i's MLP backward*, while the rest
  of layer i's backward (attention, q/k/v/o) runs. The trigger is a gradient hook on the MLP's input, set by a forward
  pre-hook on the layer's feed-forward submodule (the runner's ``Layer.mlp``) that exists only while the offloaded
  call runs. Why then: the MLP backward is a layer's memory peak (the intermediate-size tensors); a second input
  restored before it would sit on top of that peak, one input above ``save_on_cpu``. When the layer has no MLP (or
  its input needs no gradient) the prefetch is issued when the layer's own input is restored; when the hook never
  fires, the next restore is a synchronous copy.
- Restore buffers come from torch's caching allocator, one per restore, and go back to it as soon as their layer is
  done: in the steady state they are cache hits (no cudaMalloc, no sync), and the second buffer exists only between
  a layer's MLP backward and the end of that layer. Events order the streams (the side stream waits for an event
  recorded where the prefetch is issued, the compute stream waits for the copy's event); timed events also measure,
  per prefetch, the copy time, the compute time it could hide behind, and how long compute waited for it.
- A call it declines (no grad, inference mode, an input that is already offloaded and still alive) runs the user's
  checkpoint, untouched. The bytes moved are ``ops.offload_lanes``'s.

On CPU (``mode=True``) the same pack / unpack / prefetch code runs with host buffers and synchronous copies, which
is what lets CPU tests prove loss and gradient parity with plain checkpointing and the order of events.

Fallbacks, each said once, never a crash: no prefetch when VRAM is tight; pageable host memory when memory cannot
be pinned (WSL caps it); the input stays on the GPU when host memory (or ``max_host_bytes``) runs out.

Outside FastSFT, ``attach(model)`` (gradient checkpointing enabled) runs this engine alone in a runner of its own
(``layer_runner.standalone``); ``detach()`` puts the model back and frees the host pool and GPU buffers.
"""

from __future__ import annotations

import collections
import functools
import logging
import weakref
from dataclasses import asdict
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..memory import shares_host_memory
from ..ops.offload_lanes import OffloadStats, _Lane, _Packed
from ..say_once import SayOnce
from ..settings import check_value

logger = logging.getLogger(__name__)

Mode = Union[bool, Literal["auto"]]
_MiB = 2**20


def _arm_after_ffn(lane: _Lane, site: list, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """Forward pre-hook on the MLP, present only during nbkit's checkpointed forward of its layer.

    Passes the MLP a view of its input and hooks that view's gradient: the hook fires when the MLP backward is done,
    whoever else uses the input. The view is an identity (same bytes, no copy); it saves nothing, so the recompute
    (which runs without this hook) saves the same tensors as the forward.
    """
    ref = site[0]
    p = ref() if ref is not None else None
    if p is None or p.trigger:
        return None
    if args:
        x, key = args[0], None
    else:
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs), None)
        x = kwargs.get(key) if key is not None else None
    if not isinstance(x, torch.Tensor) or not x.requires_grad:
        return None  # no backward through it: the prefetch is issued at unpack instead
    x = x.view_as(x)
    x.register_hook(lambda grad: lane.after_ffn(ref))
    p.trigger = True
    if key is None:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, key: x}


def _offloaded_checkpoint(owner: OffloadedCheckpointing, layer: Any, function: Callable, x: torch.Tensor,
                          args: tuple, kwargs: dict, graphed: Optional[Callable] = None) -> Any:
    """One offloaded checkpointed call: non-reentrant checkpoint with the layer's input packed into the host pool.
    ``graphed``: the layer's recompute graphs for this call (``x`` -> output, or None where they decline it), which
    save the input alone as checkpoint does; then no MLP hook (a graph would not run it): the next input is
    prefetched when this one is restored."""
    lane = owner._lane_for(x)
    if lane is None:  # not this call: the user's checkpoint, untouched (or the graphs that stand for it)
        out = graphed(x) if graphed is not None else None
        return out if out is not None else layer.checkpoint(functools.partial(function, **kwargs), x, *args)
    # The saved tensor keeps its pack hook alive: the hook must not keep the input alive, so it holds it in a list
    # that is emptied once the input is packed.
    target = [x]
    site: list = [None]  # weakref to this call's _Packed, for the MLP pre-hook
    name = layer.name

    def pack(t: torch.Tensor) -> Any:
        x = target[0]
        same = x is not None and (t is x or (t.data_ptr(), t.shape, t.dtype) == (x.data_ptr(), x.shape, x.dtype))
        if same:
            target[0] = None
            packed = lane.pack(t, name)
            if packed is not None:
                site[0] = weakref.ref(packed)
                return packed
            owner.stats.kept += 1
        return t

    handle = None
    ckpt_kwargs = owner._ckpt_kwargs.get(id(layer), {"use_reentrant": False})
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = graphed(x) if graphed is not None else None
            if out is not None:
                return out
            # Scoped to this call: the recompute (in backward) runs without it.
            if layer.mlp is not None and lane.nbuf > 1:
                handle = layer.mlp.register_forward_pre_hook(functools.partial(_arm_after_ffn, lane, site),
                                                             with_kwargs=True)
            # the layer's kwargs bound as transformers binds them: never saved, and never read as checkpoint's own
            return torch_checkpoint(functools.partial(function, **kwargs), x, *args, **ckpt_kwargs)
    finally:
        target[0] = None
        if handle is not None:
            handle.remove()


def _unpack(obj: Any) -> torch.Tensor:
    return obj.lane.unpack(obj) if isinstance(obj, _Packed) else obj


def _checkpoint_kwargs(func: Callable) -> Optional[dict]:
    """The kwargs of transformers' installed checkpoint function, or None when it is not one we understand."""
    if not isinstance(func, functools.partial) or func.args:
        return None
    inner = func.func
    if inner is torch_checkpoint:
        return dict(func.keywords)
    # transformers' `gradient_checkpointing_enable(offload=True)`: `save_on_cpu` around checkpoint; ours replaces it
    if getattr(inner, "__qualname__", "").endswith("gradient_checkpointing_enable.<locals>.checkpoint_func"):
        return dict(func.keywords)
    return None


class OffloadedCheckpointing:
    """Keep checkpointed layer inputs in CPU memory; restore each one ahead of its recompute, after the MLP peak.

    An engine of the layer runner (``layer_runner``): the runner calls ``checkpoint`` for each layer its plan
    offloads. ``take`` says whether it can (non-reentrant checkpointing with the user's kwargs kept; 'auto': a CUDA
    GPU that is not integrated), ``engages`` decides at the first training call ('auto': one layer input of at least
    ``min_bytes``, said once). Outside FastSFT, ``attach(model)`` (gradient checkpointing enabled) runs it alone on
    every checkpointed decoder layer (False, the model left as it was, when refused); ``detach()`` puts the model back
    and frees the host pool and GPU buffers.

    ``mode``: True (always, CPU included), False (never), "auto". Eval and no-grad / inference mode always take the
    plain path. ``trace``: keep the last ``trace`` events (``("unpack", layer, "hit"|"miss")``,
    ``("ffn_backward_done", layer, "")``, ``("prefetch", layer, "after_ffn"|"at_unpack")``) in ``self.trace``, for
    tests and benchmarks; 0 keeps none.
    """

    name = "offload_checkpointing"

    def __init__(
        self, mode: Mode = "auto", double_buffer: bool = True, min_bytes: int = 16 * _MiB, max_inflight: int = 2,
        trace: int = 0, max_host_bytes: Optional[int] = None,
    ) -> None:
        check_value("offload_checkpointing", mode)
        check_value("offload_max_host_bytes", max_host_bytes)
        self.mode, self.double_buffer, self.min_bytes = mode, double_buffer, int(min_bytes)
        self.max_host_bytes = max_host_bytes
        self.max_inflight = max(1, int(max_inflight))  # D2H copies the host may run ahead of before waiting
        self.stats = OffloadStats()
        self.trace: Optional[collections.deque] = collections.deque(maxlen=trace) if trace else None
        self._lanes: dict[torch.device, _Lane] = {}
        self._ckpt_kwargs: dict[int, dict] = {}
        self._decided: Optional[bool] = None if mode == "auto" else bool(mode)
        self._taken = False
        self._runner: Any = None
        self._say = SayOnce(logger, "nbkit offload")

    @property
    def active(self) -> bool:
        """Taken by a runner and not switched off by the first step's 'auto' decision."""
        return self._taken and self._decided is not False

    @property
    def engaged(self) -> bool:
        return self.stats.packs > 0

    # ---------------------------------------------------------------------------------------------- the runner's
    def take(self, runner: Any, checkpointed: list) -> bool:
        """Whether the offload can run ``checkpointed`` layers (the runner's ``Layer`` records)."""
        self._runner = runner
        if self.mode is False:
            self._say("off", "off (offload_checkpointing=False)", logging.INFO)
            return False
        if not checkpointed:
            self._say("nogc", "gradient checkpointing is not enabled on the decoder layers; offload stays off")
            return False
        if self.mode == "auto":
            why = self._auto_refusal(runner.budget.device)
            if why:
                self._say("auto", f"off ({why})", logging.INFO)
                return False
        kwargs_of = {}
        for layer in checkpointed:
            kwargs = _checkpoint_kwargs(layer.checkpoint)
            if kwargs is None:
                self._say("func", f"{type(layer.module).__name__} has a custom checkpoint function "
                          f"({layer.checkpoint!r}); offload stays off")
                return False
            if kwargs.get("use_reentrant", False):
                self._say("reentrant", "gradient_checkpointing_kwargs has use_reentrant=True; offload needs "
                          "non-reentrant checkpointing and stays off")
                return False
            kwargs_of[id(layer)] = {**kwargs, "use_reentrant": False}
        self._ckpt_kwargs, self._taken = kwargs_of, True
        timed = sum(layer.mlp is not None for layer in checkpointed)
        self._say("on", f"ready for {len(checkpointed)} checkpointed layers "
                  f"({'double' if self.double_buffer else 'single'} buffer, mode={self.mode!r}; "
                  f"{timed} of {len(checkpointed)} prefetch after their MLP backward)", logging.INFO)
        return True

    def engages(self, x: torch.Tensor) -> bool:
        """At the first training call: whether checkpointed inputs go to host memory this run."""
        if self._decided is None:  # 'auto', first training step
            nbytes = x.numel() * x.element_size()
            self._decided = x.is_cuda and not shares_host_memory(x.device) and nbytes >= self.min_bytes
            self._say("decide", f"{'on' if self._decided else 'off'}: one layer input is {nbytes / _MiB:.1f} MiB on "
                      f"{x.device} (threshold {self.min_bytes / _MiB:.0f} MiB)", logging.INFO)
        return bool(self._decided)

    def checkpoint(self, layer: Any, function: Callable, x: torch.Tensor, args: tuple, kwargs: dict,
                   graphed: Optional[Callable] = None) -> Any:
        """Run ``function`` (the layer's forward) checkpointed, or ``graphed`` (its recompute graphs, where they
        take the call), its input ``x`` offloaded."""
        return _offloaded_checkpoint(self, layer, function, x, args, kwargs, graphed)

    def release(self) -> None:
        """The runner detaches: free the host pool and the GPU buffers."""
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._ckpt_kwargs, self._taken = {}, False
        self._decided = None if self.mode == "auto" else bool(self.mode)

    # ----------------------------------------------------------------------------------------------- on its own
    def attach(self, model: torch.nn.Module) -> bool:
        """Outside FastSFT: a layer runner with this engine alone (gradient checkpointing enabled on ``model``)."""
        from .layer_runner import standalone

        self.detach()
        runner = standalone(self, "offload", model)
        if runner.offload is not self or not runner.layers:  # refused, or no decoder layer: the model as it was
            runner.detach()
            self._runner = None
            return False
        self._runner = runner
        return True

    def detach(self) -> None:
        if self._runner is not None and self._runner.offload is self:
            self._runner.detach()
        self.release()
        self._runner = None

    def reset(self) -> None:
        """After a step that raised (an OOM): give back the GPU memory held for it; the host pool stays for reuse."""
        for lane in self._lanes.values():
            lane.reset()

    # ------------------------------------------------------------------------------------------------------ policy
    def _auto_refusal(self, device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return f"model on {device.type}; 'auto' offloads only from CUDA GPUs"
        if shares_host_memory(device):
            return "integrated GPU shares host memory; nothing to gain"
        return None

    def _lane_for(self, x: Any) -> Optional[_Lane]:
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return None
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return None
        if not self.engages(x):
            return None
        lane = self._lanes.get(x.device)
        if lane is None:
            lane = self._lanes[x.device] = _Lane(self, x.device)
        if lane.live_offloaded(x):
            self.stats.kept += 1
            return None
        return lane

    def _trace(self, kind: str, layer: str, detail: str) -> None:
        if self.trace is not None:
            self.trace.append((kind, layer, detail))

    def stats_dict(self) -> dict:
        """The counters, with every finished prefetch's timing folded in (waits for those events only)."""
        for lane in self._lanes.values():
            with lane.lock:
                lane._resolve_timings(block=True)
        return asdict(self.stats)
