"""Offloaded gradient checkpointing with a reusable pinned pool and a prefetch timed after each layer's MLP backward.

Why: with non-reentrant gradient checkpointing the only activation a checkpointed layer keeps is its input (the
hidden states, ``tokens x hidden`` values). At long context those inputs, one per layer, are what fills the GPU.
This speedup keeps them in CPU memory instead, and hides the copies behind compute:

- Forward: the installed checkpoint function wraps ``torch.utils.checkpoint.checkpoint`` (non-reentrant, with the
  user's ``gradient_checkpointing_kwargs``) in ``saved_tensors_hooks``. Non-reentrant checkpoint saves exactly its
  positional tensor inputs through those hooks (keyword arguments such as the shared cos/sin position embeddings are
  bound in a ``functools.partial`` by transformers and never saved, so they are never copied). The first positional
  tensor (transformers' convention: the hidden states) is copied into a slot of a host pool on a side CUDA stream,
  after an event on the compute stream; the GPU tensor is dropped once the copy's event has completed. The pool is
  allocated during the first step, reused afterwards, and grows only if a larger input comes.
- Backward, double buffering: layer i's backward starts with its recompute, which restores its input; the input of
  layer i-1 (packed just before it) is copied back on the side stream *after layer i's MLP backward*, while the rest
  of layer i's backward (attention, q/k/v/o) runs. The trigger is a gradient hook on the MLP's input, set by a forward
  pre-hook on the layer's ``mlp`` submodule that exists only while nbkit's checkpoint call runs. Why then: the MLP
  backward is a layer's memory peak (the intermediate-size tensors); a second input restored before it would sit on
  top of that peak, one input above ``save_on_cpu``. When the layer has no ``mlp`` submodule (or its input needs no
  gradient) the prefetch is issued when the layer's own input is restored; when the hook never fires, the next
  restore is a synchronous copy.
- Restore buffers come from torch's caching allocator, one per restore, and go back to it as soon as their layer is
  done: in the steady state they are cache hits (no cudaMalloc, no sync), and the second buffer exists only between
  a layer's MLP backward and the end of that layer. Events order the streams (the side stream waits for an event
  recorded where the prefetch is issued, the compute stream waits for the copy's event); timed events also measure,
  per prefetch, the copy time, the compute time it could hide behind, and how long compute waited for it.

On CPU (``mode=True``) the same pack / unpack / prefetch code runs with host buffers and synchronous copies, which
is what lets CPU tests prove loss and gradient parity with plain checkpointing and the order of events.

Fallbacks, each said once, never a crash: no prefetch when VRAM is tight; pageable host memory when memory cannot
be pinned (WSL caps it); the input stays on the GPU when host memory runs out.
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
from ..model_parts import is_decoder_layer, unwrap_model
from ..ops.offload_lanes import OffloadStats, _Lane, _Packed
from ..say_once import SayOnce
from ..settings import check_value
from .ledger import PatchLedger

logger = logging.getLogger(__name__)

Mode = Union[bool, Literal["auto"]]
_MiB = 2**20
_FFN_NAMES = ("mlp", "feed_forward", "block_sparse_moe")  # a decoder layer's feed-forward submodule, by family


def _ffn_of(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The layer's feed-forward submodule (whose backward is the layer's memory peak), if it has a known one."""
    for name in _FFN_NAMES:
        sub = module._modules.get(name)
        if isinstance(sub, torch.nn.Module):
            return sub
    return None


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


class _InstalledCheckpoint:
    """What nbkit puts in a layer's ``_gradient_checkpointing_func``: the user's checkpoint, offloaded when on."""

    def __init__(self, owner: OffloadedCheckpointing, module: torch.nn.Module, name: str, previous: Callable,
                 ckpt_kwargs: dict) -> None:
        self.owner, self.previous, self.ckpt_kwargs = owner, previous, ckpt_kwargs
        self.name = name
        self.ffn = _ffn_of(module)

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        plan = self.owner._plan(args)
        if plan is None:
            return self.previous(function, *args, **kwargs)  # the plain path, untouched
        lane, x = plan
        # The saved tensor keeps its pack hook alive: the hook must not keep the input alive, so it holds it in a
        # list that is emptied once the input is packed.
        target = [x]
        site: list = [None]  # weakref to this call's _Packed, for the MLP pre-hook
        del plan, x

        def pack(t: torch.Tensor) -> Any:
            x = target[0]
            same = x is not None and (t is x or (t.data_ptr(), t.shape, t.dtype) == (x.data_ptr(), x.shape, x.dtype))
            if same:
                target[0] = None
                packed = lane.pack(t, self.name)
                if packed is not None:
                    site[0] = weakref.ref(packed)
                    return packed
                self.owner.stats.kept += 1
            return t

        # Scoped to this call: the recompute (in backward) runs without it.
        handle = None
        if self.ffn is not None and lane.nbuf > 1:
            handle = self.ffn.register_forward_pre_hook(functools.partial(_arm_after_ffn, lane, site),
                                                        with_kwargs=True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                return torch_checkpoint(function, *args, **{**self.ckpt_kwargs, **kwargs})
        finally:
            target[0] = None
            if handle is not None:
                handle.remove()


def _unpack(obj: Any) -> torch.Tensor:
    return obj.lane.unpack(obj) if isinstance(obj, _Packed) else obj


def _is_layer(module: torch.nn.Module) -> bool:
    return is_decoder_layer(module) is not False  # a transformers without the layer class: every checkpointed module


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

    Contract: call ``attach(model)`` after gradient checkpointing is enabled on ``model`` (a transformers model, or
    a PEFT / accelerate wrapper of one). It installs nbkit's checkpoint function on exactly the modules that are
    checkpointed (``every_n_layers`` respected), keeping the user's checkpoint kwargs, and returns whether it is
    active. ``detach()`` restores the previous functions and frees the host pool and GPU buffers.

    ``mode``: True (always, CPU included), False (never), "auto" (CUDA, not an integrated GPU, and one layer input of
    at least ``min_bytes``, decided at the first training step and said once). Eval and no-grad / inference mode
    always take the plain path. ``trace``: keep the last ``trace`` events (``("unpack", layer, "hit"|"miss")``,
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
        self._installed: list[_InstalledCheckpoint] = []
        self._ledger = PatchLedger(self.name)
        self._lanes: dict[torch.device, _Lane] = {}
        self._decided: Optional[bool] = None if mode == "auto" else bool(mode)
        self._say = SayOnce(logger, "nbkit offload")

    @property
    def active(self) -> bool:
        """Installed and not switched off by the first step's 'auto' decision."""
        return bool(self._installed) and self._decided is not False

    # ------------------------------------------------------------------------------------------------ attach/detach
    def attach(self, model: torch.nn.Module) -> bool:
        self.detach()
        if self.mode is False:
            self._say("off", "off (offload_checkpointing=False)", logging.INFO)
            return False
        base = unwrap_model(model)
        targets = [
            (name, m)
            for name, m in base.named_modules()
            if getattr(m, "gradient_checkpointing", False) is True
            and callable(getattr(m, "_gradient_checkpointing_func", None))
        ]
        if not targets:
            self._say("nogc", f"gradient checkpointing is not enabled on {type(base).__name__}; offload stays off")
            return False
        if self.mode == "auto":
            why = self._auto_refusal(base)
            if why:
                self._say("auto", f"off ({why})", logging.INFO)
                return False
        plans = []
        for name, m in targets:
            prev = m._gradient_checkpointing_func
            kwargs = _checkpoint_kwargs(prev)
            if kwargs is None:
                self._say("func", f"{type(m).__name__} has a custom checkpoint function ({prev!r}); offload stays off")
                return False
            if kwargs.get("use_reentrant", False):
                self._say("reentrant", "gradient_checkpointing_kwargs has use_reentrant=True; offload needs "
                          "non-reentrant checkpointing and stays off")
                return False
            kwargs["use_reentrant"] = False
            plans.append((name, m, prev, kwargs))
        for name, m, prev, kwargs in plans:
            inst = _InstalledCheckpoint(self, m, name or type(m).__name__, prev, kwargs)
            self._ledger.set(m, "_gradient_checkpointing_func", inst)
            self._installed.append(inst)
        layers = sum(_is_layer(m) for _, m, _, _ in plans)
        timed = sum(inst.ffn is not None for inst in self._installed)
        self._say("on", f"installed on {layers} checkpointed layers of {type(base).__name__} "
                  f"({'double' if self.double_buffer else 'single'} buffer, mode={self.mode!r}; "
                  f"{timed} of {len(plans)} prefetch after their MLP backward)", logging.INFO)
        return True

    def detach(self) -> None:
        self._ledger.undo()
        self._installed.clear()
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._decided = None if self.mode == "auto" else bool(self.mode)

    def reset(self) -> None:
        """After a step that raised (an OOM): give back the GPU memory held for it; the host pool stays for reuse."""
        for lane in self._lanes.values():
            lane.reset()

    # ------------------------------------------------------------------------------------------------------ policy
    def _auto_refusal(self, base: torch.nn.Module) -> Optional[str]:
        param = next(base.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if device.type != "cuda":
            return f"model on {device.type}; 'auto' offloads only from CUDA GPUs"
        if shares_host_memory(device):
            return "integrated GPU shares host memory; nothing to gain"
        return None

    def _plan(self, args: tuple) -> Optional[tuple[_Lane, torch.Tensor]]:
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return None
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return None
        if self._decided is None:  # 'auto', first training step
            nbytes = x.numel() * x.element_size()
            integrated = shares_host_memory(x.device)
            self._decided = x.is_cuda and not integrated and nbytes >= self.min_bytes
            self._say("decide", f"{'on' if self._decided else 'off'}: one layer input is {nbytes / _MiB:.1f} MiB on "
                      f"{x.device} (threshold {self.min_bytes / _MiB:.0f} MiB)", logging.INFO)
        if not self._decided:
            return None
        lane = self._lanes.get(x.device)
        if lane is None:
            lane = self._lanes[x.device] = _Lane(self, x.device)
        if lane.live_offloaded(x):
            self.stats.kept += 1
            return None
        return lane, x


    def _trace(self, kind: str, layer: str, detail: str) -> None:
        if self.trace is not None:
            self.trace.append((kind, layer, detail))

    def stats_dict(self) -> dict:
        """The counters, with every finished prefetch's timing folded in (waits for those events only)."""
        for lane in self._lanes.values():
            with lane.lock:
                lane._resolve_timings(block=True)
        return asdict(self.stats)
