"""Offloaded gradient checkpointing with a reusable pinned pool and double-buffered prefetch.

Why: with non-reentrant gradient checkpointing the only activation a checkpointed layer keeps is its input (the
hidden states, ``tokens x hidden`` values). At long context those inputs, one per layer, are what fills the GPU.
This module keeps them in CPU memory instead, and hides the copies behind compute:

- Forward: the installed checkpoint function wraps ``torch.utils.checkpoint.checkpoint`` (non-reentrant, with the
  user's ``gradient_checkpointing_kwargs``) in ``saved_tensors_hooks``. Non-reentrant checkpoint saves exactly its
  positional tensor inputs through those hooks (keyword arguments such as the shared cos/sin position embeddings are
  bound in a ``functools.partial`` by transformers and never saved, so they are never copied). The first positional
  tensor (transformers' convention: the hidden states) is copied into a slot of a host pool on a side CUDA stream,
  after an event on the compute stream; the GPU tensor is dropped once the copy's event has completed. The pool is
  allocated during the first step, reused afterwards, and grows only if a larger input comes.
- Backward: when a layer's input is unpacked (its recompute starts), it is served from one of two GPU buffers; the
  previous layer's input (the one packed just before it) is then copied into the other buffer on the side stream
  while this layer recomputes and back-propagates. Events order the streams (the side stream waits for the compute
  stream's last use of a buffer, the compute stream waits for the copy); no allocation per layer in steady state.
  The two buffers exist only during the backward: after the last restore they go back to torch's caching allocator
  (which hands the same blocks back at the next backward), so the forward does not carry them.

On CPU (``mode=True``) the same pack / unpack / prefetch code runs with host buffers and synchronous copies, which
is what lets CPU tests prove loss and gradient parity with plain checkpointing.

Fallbacks, each said once, never a crash: one GPU buffer when VRAM is tight; pageable host memory when memory cannot
be pinned (WSL caps it); the input stays on the GPU when host memory runs out.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from nbkit.speedup import unwrap_model

logger = logging.getLogger("nbkit.offload")

Mode = Union[bool, Literal["auto"]]
_MiB = 2**20


@dataclass
class OffloadStats:
    """Counters that let tests and benchmarks see what the offload did."""

    packs: int = 0  # layer inputs sent to host memory
    kept: int = 0  # layer inputs left where they were (shared with a live tensor, or host memory exhausted)
    unpacks: int = 0  # layer inputs brought back for a recompute
    prefetch_issued: int = 0  # copies started ahead of their unpack
    prefetch_hits: int = 0  # unpacks served from a buffer filled ahead of time
    host_allocs: int = 0  # host slots allocated (pool growth)
    host_bytes: int = 0  # bytes held by the host pool
    buffer_allocs: int = 0  # GPU (or, on CPU, host) restore buffers allocated
    buffer_busy: int = 0  # a buffer was still referenced when a copy wanted it: a fresh one was taken instead
    pinned: Optional[bool] = None  # host pool page-locked (None: not decided / CPU)
    buffers: int = 0  # restore buffers in use (2 = double buffering, 1 = single)


# --------------------------------------------------------------------------------------------------------------- host


@functools.lru_cache(maxsize=1)
def _cudart_lib() -> Optional[ctypes.CDLL]:
    """The CUDA runtime torch loaded, to clear the error a failed ``cudaHostRegister`` leaves behind."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        return ctypes.CDLL(sorted(paths)[0]) if paths else None
    except (OSError, IndexError):
        return None


_HOST_RESERVE = 4 * 2**30  # host memory the pool leaves to everything else
_PAGE = 4096


def _unregister_all(registered: dict, stream: Optional[torch.cuda.Stream]) -> None:
    """Unpin what is still registered (detach frees slots; this covers a pool dropped without detach)."""
    if not registered:
        return
    try:
        if stream is not None:
            stream.synchronize()  # no copy may still use the pages (teardown only)
        for ptr in list(registered):
            if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0 and _cudart_lib() is not None:
                _cudart_lib().cudaGetLastError()
    except Exception:  # interpreter shutdown: the CUDA runtime may already be gone
        pass
    registered.clear()


def _host_available() -> Optional[int]:
    """MemAvailable from /proc/meminfo (Linux, WSL); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _HostPool:
    """Host slots for layer inputs: taken at pack, returned when the saved input dies, reused across steps.

    On CUDA each slot is page-locked in place with ``cudaHostRegister`` (exact size; torch's pinned allocator would
    round every slot up to a power of two), else with torch's pinned allocator, else left pageable.
    """

    def __init__(self, lane: "_Lane") -> None:
        self.lane = lane
        self.free: list[torch.Tensor] = []
        self.registered: dict[int, torch.Tensor] = {}  # slots we page-locked: kept alive until unregistered
        self.closed = False
        weakref.finalize(self, _unregister_all, self.registered, lane.side)

    def acquire(self, nbytes: int) -> Optional[torch.Tensor]:
        fits = [s for s in self.free if s.numel() >= nbytes]
        if fits:
            slot = min(fits, key=torch.Tensor.numel)
            self.free.remove(slot)
            return slot
        if self.free:  # larger inputs than before: replace an idle slot instead of adding one
            self._free_memory(self.free.pop(self.free.index(max(self.free, key=torch.Tensor.numel))))
        try:
            slot = self._alloc(nbytes)
        except RuntimeError as err:  # host memory exhausted: the caller keeps the input where it is
            self.lane.owner._say("host", f"host memory exhausted ({err}); remaining layer inputs stay on the GPU")
            return None
        self.lane.owner.stats.host_allocs += 1
        self.lane.owner.stats.host_bytes += slot.numel()
        return slot

    def release(self, slot: torch.Tensor) -> None:
        with self.lane.lock:
            if self.closed:
                self._free_memory(slot)
            else:
                self.free.append(slot)

    def close(self) -> None:
        """Free the idle slots now; slots still held by saved inputs are freed when those die."""
        self.closed = True
        for slot in self.free:
            self._free_memory(slot)
        self.free.clear()

    def _alloc(self, nbytes: int) -> torch.Tensor:
        avail = _host_available()
        if avail is not None and nbytes > avail - _HOST_RESERVE:  # overcommitted pages would get us OOM-killed
            raise RuntimeError(f"{nbytes / _MiB:.0f} MiB wanted, {avail / _MiB:.0f} MiB available")
        if not self.lane.cuda:
            return torch.empty(nbytes, dtype=torch.uint8)
        owner, stats = self.lane.owner, self.lane.owner.stats
        if stats.pinned is not False:
            raw = torch.empty(nbytes + 2 * _PAGE, dtype=torch.uint8)
            start = -raw.data_ptr() % _PAGE  # page-aligned pages that belong to this slot alone
            slot = raw[start:start + nbytes]
            if self._register(slot):
                stats.pinned = True
                return slot
            try:  # torch's pinned allocator (rounds up to a power of two)
                slot = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                stats.pinned = True
                return slot
            except RuntimeError as err:
                stats.pinned = False
                owner._say("pinned", f"cannot pin host memory ({err}); using pageable memory, copies will not overlap")
        return torch.empty(nbytes, dtype=torch.uint8)

    def _register(self, slot: torch.Tensor) -> bool:
        lib = _cudart_lib()
        if lib is None:  # no way to clear a failed call's error: leave pinning to torch's allocator
            return False
        size = -(-slot.numel() // _PAGE) * _PAGE
        err = int(torch.cuda.cudart().cudaHostRegister(slot.data_ptr(), size, 0))
        if err != 0:
            lib.cudaGetLastError()  # the failure must not surface in an unrelated later kernel launch
            return False
        self.registered[slot.data_ptr()] = slot
        return True

    def _free_memory(self, slot: torch.Tensor) -> None:
        ptr = slot.data_ptr()
        if ptr in self.registered:
            _unregister_all({ptr: self.registered.pop(ptr)}, self.lane.side)
        self.lane.owner.stats.host_bytes -= slot.numel()


# --------------------------------------------------------------------------------------------------------- buffers


def _storage_refs(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (0 where torch cannot tell)."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    return int(fn(t.untyped_storage()._cdata)) if fn is not None else 0


class _Buffer:
    """One restore buffer: the bytes of one layer input, and which packed input they currently hold."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.idle_refs = _storage_refs(data)  # use count with no view of it alive
        self.holder: Optional[weakref.ref] = None  # the _Packed whose bytes are here
        self.ready: Optional[torch.cuda.Event] = None  # side-stream event: the copy into it has finished

    def busy(self) -> bool:
        return _storage_refs(self.data) > self.idle_refs


class _Packed:
    """What the pack hook returns for an offloaded layer input."""

    __slots__ = ("lane", "slot", "nbytes", "dtype", "shape", "prev", "src", "buffer", "unpacked", "__weakref__")

    def __init__(self, lane: "_Lane", slot: torch.Tensor, x: torch.Tensor, prev: Optional["_Packed"]) -> None:
        self.lane = lane
        self.slot = slot
        self.nbytes = x.numel() * x.element_size()
        self.dtype, self.shape = x.dtype, x.shape
        self.prev = weakref.ref(prev) if prev is not None else None  # the input packed just before: next to restore
        self.src = weakref.ref(x)  # alive after our copy only if someone else holds the tensor
        self.buffer: Optional[_Buffer] = None
        self.unpacked = 0
        weakref.finalize(self, lane.pool.release, slot)

    def loaded(self) -> Optional[_Buffer]:
        b = self.buffer
        return b if b is not None and b.holder is not None and b.holder() is self else None


class _Lane:
    """Per-device state: side stream, host pool, restore buffers, copies in flight."""

    def __init__(self, owner: "OffloadedCheckpointing", device: torch.device) -> None:
        self.owner, self.device = owner, device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.pool = _HostPool(self)
        self.buffers: list[_Buffer] = []
        self.nbuf = 2 if owner.double_buffer else 1
        self.recent: Optional[_Buffer] = None  # buffer returned by the latest unpack
        self.pending: collections.deque = collections.deque()  # (event, gpu tensor) whose D2H copy may be running
        self.last: Optional[weakref.ref] = None  # latest packed input
        self.lock = threading.RLock()
        owner.stats.buffers = self.nbuf

    # forward ----------------------------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor) -> Optional[_Packed]:
        with self.lock:
            self._reap()
            src = x.detach()
            src = src if src.is_contiguous() else src.contiguous()
            nbytes = src.numel() * src.element_size()
            slot = self.pool.acquire(nbytes)
            if slot is None:
                return None
            raw = src.reshape(-1).view(torch.uint8)
            if self.cuda:
                compute = torch.cuda.current_stream(self.device)
                self.side.wait_stream(compute)  # an event on the compute stream, waited on by the side stream
                with torch.cuda.stream(self.side):
                    slot[:nbytes].copy_(raw, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.side)
                self.pending.append((done, src))  # the GPU copy lives until `done`
                while len(self.pending) > self.owner.max_inflight:  # bound how far the host runs ahead
                    ev, _ = self.pending.popleft()
                    ev.synchronize()
            else:
                slot[:nbytes].copy_(raw)
            prev = self.last() if self.last is not None else None
            if prev is not None and prev.unpacked:
                prev = None  # a new forward: the chain starts again
            packed = _Packed(self, slot, x, prev)
            self.last = weakref.ref(packed)
            self.owner.stats.packs += 1
            return packed

    def _reap(self) -> None:
        while self.pending and self.pending[0][0].query():
            self.pending.popleft()

    # backward ---------------------------------------------------------------------------------------------------
    def unpack(self, p: _Packed) -> torch.Tensor:
        with self.lock:
            if self.pending:  # backward started: let the allocator free the last sources once their copies finish
                for _, src in self.pending:
                    src.record_stream(self.side)
                self.pending.clear()
            stats = self.owner.stats
            compute = torch.cuda.current_stream(self.device) if self.cuda else None
            buf = p.loaded()
            if buf is not None:
                stats.prefetch_hits += 1
            else:
                buf = self._load(p, compute, avoid=self.recent)
            if self.cuda:
                compute.wait_event(buf.ready)
            out = buf.data[: p.nbytes].view(p.dtype).view(p.shape)
            self.recent = buf
            p.unpacked += 1
            stats.unpacks += 1
            nxt = p.prev() if p.prev is not None else None
            if nxt is None:  # the first input of this forward: the backward's last restore
                self._release_buffers()
            elif self.nbuf > 1 and not nxt.unpacked and nxt.loaded() is None:
                if self._load(nxt, compute, avoid=buf, prefetch=True) is not None:
                    stats.prefetch_issued += 1
            return out

    def _release_buffers(self) -> None:
        """Hand the buffers back to the caching allocator between backwards, so the forward does not carry them.

        The view just returned keeps its storage until the layer's backward is done; the next backward takes the
        same blocks back from the allocator's cache (one allocation per buffer per step, none per layer).
        """
        for b in self.buffers:
            if self.cuda:
                b.data.record_stream(self.side)
        self.buffers.clear()
        self.recent = None

    def _load(self, p: _Packed, compute, avoid: Optional[_Buffer], prefetch: bool = False) -> Optional[_Buffer]:
        """Copy ``p``'s bytes into a buffer other than ``avoid``; the copy waits for the buffer's last reader."""
        i = self._pick(p.nbytes, avoid, prefetch)
        if i is None:
            return None
        buf = self.buffers[i]
        if buf.busy():  # a tensor from its last use is still alive: never overwrite it, take a fresh buffer
            self.owner.stats.buffer_busy += 1
            buf = self._replace(i, max(buf.data.numel(), p.nbytes))
        if self.cuda:
            self.side.wait_stream(compute)  # everything enqueued so far, including the buffer's last reader
            with torch.cuda.stream(self.side):
                buf.data[: p.nbytes].copy_(p.slot[: p.nbytes], non_blocking=True)
            buf.ready = torch.cuda.Event()
            buf.ready.record(self.side)
        else:
            buf.data[: p.nbytes].copy_(p.slot[: p.nbytes])
        buf.holder = weakref.ref(p)
        p.buffer = buf
        return buf

    def _pick(self, nbytes: int, avoid: Optional[_Buffer], prefetch: bool) -> Optional[int]:
        for i, b in enumerate(self.buffers):
            if b is not avoid:
                if b.data.numel() < nbytes:
                    self._replace(i, nbytes)
                return i
        if len(self.buffers) >= self.nbuf:  # single buffer: the only one is `avoid` only when prefetching
            return None if prefetch else 0
        if self.buffers and not self._room_for(nbytes):
            self._single(f"VRAM is tight (a second {nbytes / _MiB:.0f} MiB buffer does not fit comfortably)")
            return None if prefetch else 0
        try:
            self.buffers.append(self._new_buffer(nbytes))
        except torch.cuda.OutOfMemoryError:
            if not self.buffers:
                raise
            self._single("out of memory allocating the second buffer")
            return None if prefetch else 0
        return len(self.buffers) - 1

    def _room_for(self, nbytes: int) -> bool:
        """Second buffer only with clear headroom: free plus cached-but-unused memory for it and 4 more inputs."""
        if not self.cuda:
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        slack = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free + slack >= 5 * nbytes

    def _single(self, why: str) -> None:
        self.nbuf = 1
        self.owner.stats.buffers = 1
        self.owner._say("single", f"{why}; falling back to one restore buffer (no prefetch)")

    def _new_buffer(self, nbytes: int) -> _Buffer:
        self.owner.stats.buffer_allocs += 1
        return _Buffer(torch.empty(nbytes, dtype=torch.uint8, device=self.device))

    def _replace(self, i: int, nbytes: int) -> _Buffer:
        old = self.buffers[i]
        if self.cuda:
            old.data.record_stream(self.side)  # the side stream wrote it: free only after those copies
        self.buffers[i] = self._new_buffer(nbytes)
        if self.recent is old:
            self.recent = self.buffers[i]
        return self.buffers[i]

    def live_offloaded(self, x: torch.Tensor) -> bool:
        """``x`` was already offloaded by an earlier layer and is still alive elsewhere (shared): keep it."""
        last = self.last() if self.last is not None else None
        while last is not None:
            if last.src() is x:
                return True
            last = last.prev() if last.prev is not None else None
        return False

    def close(self) -> None:
        with self.lock:
            if self.cuda:
                self.side.synchronize()
            self.pending.clear()
            self.buffers.clear()
            self.recent = None
            self.pool.close()


# ---------------------------------------------------------------------------------------------------- installation


class _InstalledCheckpoint:
    """What nbkit puts in a layer's ``_gradient_checkpointing_func``: the user's checkpoint, offloaded when on."""

    def __init__(self, owner: "OffloadedCheckpointing", previous: Callable, ckpt_kwargs: dict) -> None:
        self.owner, self.previous, self.ckpt_kwargs = owner, previous, ckpt_kwargs

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        plan = self.owner._plan(args)
        if plan is None:
            return self.previous(function, *args, **kwargs)  # the plain path, untouched
        lane, x = plan
        # The saved tensor keeps its pack hook alive: the hook must not keep the input alive, so it holds it in a
        # list that is emptied once the input is packed.
        target = [x]
        del plan, x

        def pack(t: torch.Tensor) -> Any:
            x = target[0]
            same = x is not None and (t is x or (t.data_ptr(), t.shape, t.dtype) == (x.data_ptr(), x.shape, x.dtype))
            if same:
                target[0] = None
                packed = lane.pack(t)
                if packed is not None:
                    return packed
                self.owner.stats.kept += 1
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                return torch_checkpoint(function, *args, **{**self.ckpt_kwargs, **kwargs})
        finally:
            target[0] = None


def _unpack(obj: Any) -> torch.Tensor:
    return obj.lane.unpack(obj) if isinstance(obj, _Packed) else obj


def _is_layer(module: torch.nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: count every checkpointed module
        return True
    return isinstance(module, GradientCheckpointingLayer)


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
    """Keep checkpointed layer inputs in CPU memory; restore them double-buffered ahead of the recompute.

    Contract: call ``attach(model)`` after gradient checkpointing is enabled on ``model`` (a transformers model, or
    a PEFT / accelerate wrapper of one). It installs nbkit's checkpoint function on exactly the modules that are
    checkpointed (``every_n_layers`` respected), keeping the user's checkpoint kwargs, and returns whether it is
    active. ``detach()`` restores the previous functions and frees the host pool and GPU buffers.

    ``mode``: True (always, CPU included), False (never), "auto" (CUDA, not an integrated GPU, and one layer input of
    at least ``min_bytes``, decided at the first training step and said once). Eval and no-grad / inference mode
    always take the plain path.
    """

    name = "offload_checkpointing"

    def __init__(
        self, mode: Mode = "auto", double_buffer: bool = True, min_bytes: int = 64 * _MiB, max_inflight: int = 2
    ) -> None:
        if mode not in (True, False, "auto"):
            raise ValueError(f"mode={mode!r}: use True, False or 'auto'")
        self.mode, self.double_buffer, self.min_bytes = mode, double_buffer, int(min_bytes)
        self.max_inflight = max(1, int(max_inflight))  # D2H copies the host may run ahead of before waiting
        self.stats = OffloadStats()
        self._installed: list[tuple[torch.nn.Module, Callable, _InstalledCheckpoint]] = []
        self._lanes: dict[torch.device, _Lane] = {}
        self._decided: Optional[bool] = None if mode == "auto" else bool(mode)
        self._said: set[str] = set()

    @classmethod
    def from_config(cls, args: Any) -> "OffloadedCheckpointing":
        """Build from a ``FastSFTConfig`` (its ``offload_*`` switches)."""
        return cls(
            mode=args.offload_checkpointing,
            double_buffer=args.offload_double_buffer,
            min_bytes=args.offload_min_bytes,
        )

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
            m
            for m in base.modules()
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
        for m in targets:
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
            plans.append((m, prev, kwargs))
        for m, prev, kwargs in plans:
            inst = _InstalledCheckpoint(self, prev, kwargs)
            m._gradient_checkpointing_func = inst
            self._installed.append((m, prev, inst))
        layers = sum(_is_layer(m) for m, _, _ in plans)
        self._say("on", f"installed on {layers} checkpointed layers of {type(base).__name__} "
                  f"({'double' if self.double_buffer else 'single'} buffer, mode={self.mode!r})", logging.INFO)
        return True

    def detach(self) -> None:
        for m, prev, inst in self._installed:
            if m.__dict__.get("_gradient_checkpointing_func") is inst:
                m._gradient_checkpointing_func = prev
        self._installed.clear()
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._decided = None if self.mode == "auto" else bool(self.mode)

    # ------------------------------------------------------------------------------------------------------ policy
    def _auto_refusal(self, base: torch.nn.Module) -> Optional[str]:
        param = next(base.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if device.type != "cuda":
            return f"model on {device.type}; 'auto' offloads only from CUDA GPUs"
        if torch.cuda.get_device_properties(device).is_integrated:
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
            integrated = x.is_cuda and torch.cuda.get_device_properties(x.device).is_integrated
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

    def _say(self, key: str, msg: str, level: int = logging.WARNING) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.log(level, "nbkit offload: %s", msg)

    def stats_dict(self) -> dict:
        return asdict(self.stats)
