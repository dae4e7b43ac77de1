"""Offloaded gradient checkpointing with a reusable pinned pool and a prefetch timed after each layer's MLP backward.

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
_FFN_NAMES = ("mlp", "feed_forward", "block_sparse_moe")  # a decoder layer's feed-forward submodule, by family


@dataclass
class OffloadStats:
    """Counters that let tests and benchmarks see what the offload did."""

    packs: int = 0  # layer inputs sent to host memory
    kept: int = 0  # layer inputs left where they were (shared with a live tensor, or host memory exhausted)
    host_short: int = 0  # of those, kept because host memory ran short
    unpacks: int = 0  # layer inputs brought back for a recompute
    prefetch_issued: int = 0  # copies started ahead of their unpack
    prefetch_after_ffn: int = 0  # of those, issued by the hook after a layer's MLP backward (the rest: at unpack)
    prefetch_hits: int = 0  # unpacks served from a buffer filled ahead of time
    prefetch_skipped: int = 0  # prefetches not issued because VRAM was tight (the restore then waits for its copy)
    prefetch_hidden: int = 0  # prefetched copies done before the compute stream needed them (CUDA, timed events)
    copy_ms: float = 0.0  # side-stream time of the prefetched host-to-device copies
    lead_ms: float = 0.0  # compute-stream time between each prefetch's issue and its use: what the copy hides behind
    wait_ms: float = 0.0  # compute-stream time spent waiting for prefetched copies (0: all hidden)
    host_allocs: int = 0  # host slots allocated (pool growth)
    host_bytes: int = 0  # bytes held by the host pool
    buffer_allocs: int = 0  # restore buffers taken from the allocator (one per restore; cached blocks on CUDA)
    pinned: Optional[bool] = None  # host pool page-locked (None: not decided / CPU)
    buffers: int = 0  # restore buffers a layer can have (2 = double buffering, 1 = single)


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


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty off Linux)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _torch_host_cache_idle() -> int:
    """Pinned bytes torch's caching host allocator keeps but no caller uses (``save_on_cpu`` leaves them behind)."""
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return 0
        s = torch.cuda.host_memory_stats()
        return max(0, int(s.get("allocated_bytes.current", 0)) - int(s.get("active_bytes.current", 0)))
    except Exception:  # older torch without host stats
        return 0


def release_host_cache() -> None:
    """Give torch's cached, unused pinned host blocks back to the OS (what ``torch.cuda.empty_cache`` is for VRAM)."""
    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    fn = fn or getattr(torch._C, "_host_emptyCache", None)
    if fn is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        fn()


def host_available(info: Optional[dict] = None) -> Optional[int]:
    """Host bytes a new allocation can take without swapping or the OOM killer; None where it cannot be told.

    MemAvailable (free memory plus the page cache and slab the kernel can reclaim) plus the pinned blocks torch's
    host allocator caches for nobody (``release_host_cache`` gives them back; ``save_on_cpu`` leaves tens of GiB
    there). Not counted: RAM the kernel does not show (a balloon may never give it back: the OOM killer would).
    """
    info = _meminfo() if info is None else info
    if "MemAvailable" not in info:
        return None
    return info["MemAvailable"] + _torch_host_cache_idle()


def slot_bytes(nbytes: int) -> int:
    """Host slot size for an input of ``nbytes``: 1/16 headroom in whole pages, so packed rows that vary by a few
    tokens from step to step fit the slots of the first step (a regrown slot costs a page-locking call)."""
    return -(-(nbytes + nbytes // 16) // 4096) * 4096


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
            # headroom: packed rows vary by a few tokens step to step; a slot that fits them is never regrown
            slot = self._alloc(slot_bytes(nbytes))
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
        info = _meminfo()
        if "MemAvailable" in info and nbytes > info["MemAvailable"] - _HOST_RESERVE:
            release_host_cache()  # pinned blocks torch caches for nobody (save_on_cpu leaves them) go back first
            avail = host_available()
            if avail is not None and nbytes > avail - _HOST_RESERVE:  # overcommitted pages: the OOM killer
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


# ----------------------------------------------------------------------------------------------------- restores


def _timed_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class _Packed:
    """What the pack hook returns for an offloaded layer input."""

    __slots__ = ("lane", "slot", "nbytes", "dtype", "shape", "prev", "src", "name", "trigger", "unpacked",
                 "__weakref__")

    def __init__(self, lane: "_Lane", slot: torch.Tensor, x: torch.Tensor, prev: Optional["_Packed"],
                 name: str) -> None:
        self.lane = lane
        self.slot = slot
        self.nbytes = x.numel() * x.element_size()
        self.dtype, self.shape = x.dtype, x.shape
        self.prev = weakref.ref(prev) if prev is not None else None  # the input packed just before: next to restore
        self.src = weakref.ref(x)  # alive after our copy only if someone else holds the tensor
        self.name = name  # the checkpointed module (for the trace)
        self.trigger = False  # a hook after this layer's MLP backward will prefetch `prev`
        self.unpacked = 0
        weakref.finalize(self, lane.pool.release, slot)


class _Staged:
    """A prefetched input: the buffer, the packed input it holds, and the events of its copy."""

    __slots__ = ("holder", "data", "issue", "start", "ready")

    def __init__(self, holder: _Packed, data: torch.Tensor, issue: Any, start: Any, ready: Any) -> None:
        self.holder = weakref.ref(holder)
        self.data, self.issue, self.start, self.ready = data, issue, start, ready


class _Lane:
    """Per-device state: side stream, host pool, the one prefetched buffer, copies in flight."""

    def __init__(self, owner: "OffloadedCheckpointing", device: torch.device) -> None:
        self.owner, self.device = owner, device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.pool = _HostPool(self)
        self.nbuf = 2 if owner.double_buffer else 1
        self.staged: Optional[_Staged] = None  # the prefetched input, until its unpack takes it
        self.pending: collections.deque = collections.deque()  # (event, gpu tensor) whose D2H copy may be running
        self.timings: collections.deque = collections.deque()  # (issue, start, ready, need) events of served prefetches
        self.last: Optional[weakref.ref] = None  # latest packed input
        self.closed = False
        self.lock = threading.RLock()
        owner.stats.buffers = self.nbuf

    # forward ----------------------------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor, name: str) -> Optional[_Packed]:
        with self.lock:
            self._reap()
            if self.staged is not None and self.staged.holder() is None:  # left by a backward that did not finish
                self._drop_staged()
            src = x.detach()
            src = src if src.is_contiguous() else src.contiguous()
            nbytes = src.numel() * src.element_size()
            slot = self.pool.acquire(nbytes)
            if slot is None:
                self.owner.stats.host_short += 1
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
            packed = _Packed(self, slot, x, prev, name)
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
            self._resolve_timings(block=False)
            stats = self.owner.stats
            staged, self.staged = self.staged, None
            if staged is not None and staged.holder() is p:
                data = staged.data
                stats.prefetch_hits += 1
                if self.cuda:
                    compute = torch.cuda.current_stream(self.device)
                    need = _timed_event()
                    need.record(compute)
                    compute.wait_event(staged.ready)
                    self.timings.append((staged.issue, staged.start, staged.ready, need))
                how = "hit"
            else:
                if staged is not None:
                    self._drop(staged)
                data = self._restore_now(p)
                how = "miss"
            out = data[: p.nbytes].view(p.dtype).view(p.shape)
            del data, staged  # the buffer now lives exactly as long as the autograd graph uses `out`
            p.unpacked += 1
            stats.unpacks += 1
            self.owner._trace("unpack", p.name, how)
            if not p.trigger:  # no hook after this layer's MLP backward: prefetch the next input now
                self.prefetch_next(p, "at_unpack")
            return out

    def after_ffn(self, ref: weakref.ref) -> None:
        """Gradient hook on a layer's MLP input: the MLP backward (the layer's peak) is done; prefetch the next."""
        with self.lock:
            p = ref()
            if p is None or self.closed:
                return
            self.owner._trace("ffn_backward_done", p.name, "")
            self.prefetch_next(p, "after_ffn")

    def prefetch_next(self, p: _Packed, why: str) -> None:
        """Start copying the input restored after ``p``'s (the one packed before it) into a fresh buffer."""
        nxt = p.prev() if p.prev is not None else None
        if self.nbuf < 2 or nxt is None or nxt.unpacked >= p.unpacked:  # single, the last restore, or already done
            return
        if self.staged is not None:
            if self.staged.holder() is nxt:
                return
            self._drop_staged()
        stats = self.owner.stats
        if not self._room_for(nxt.nbytes):
            stats.prefetch_skipped += 1
            self.owner._say("tight", f"VRAM is tight (no room for a second {nxt.nbytes / _MiB:.0f} MiB buffer); "
                            "restoring without prefetch while it stays tight")
            return
        try:
            data = self._new_buffer(nxt.nbytes)
        except torch.cuda.OutOfMemoryError:
            stats.prefetch_skipped += 1
            self.owner._say("tight", "out of memory allocating a prefetch buffer; restoring without prefetch")
            return
        issue = start = ready = None
        if self.cuda:
            issue, start, ready = _timed_event(), _timed_event(), _timed_event()
            issue.record(torch.cuda.current_stream(self.device))  # the buffer's block may have just been freed
            self.side.wait_event(issue)
            start.record(self.side)
            with torch.cuda.stream(self.side):
                data[: nxt.nbytes].copy_(nxt.slot[: nxt.nbytes], non_blocking=True)
            ready.record(self.side)
        else:
            data[: nxt.nbytes].copy_(nxt.slot[: nxt.nbytes])
        self.staged = _Staged(nxt, data, issue, start, ready)
        stats.prefetch_issued += 1
        stats.prefetch_after_ffn += why == "after_ffn"
        self.owner._trace("prefetch", nxt.name, why)

    def _restore_now(self, p: _Packed) -> torch.Tensor:
        """Synchronous restore (no prefetch was ready): the copy runs on the compute stream itself."""
        data = self._new_buffer(p.nbytes)
        if self.cuda:
            data[: p.nbytes].copy_(p.slot[: p.nbytes], non_blocking=True)
        else:
            data[: p.nbytes].copy_(p.slot[: p.nbytes])
        return data

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        self.owner.stats.buffer_allocs += 1
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _drop(self, staged: _Staged) -> None:
        """Forget a prefetched buffer nobody consumed; the allocator reuses it only after its copy."""
        if self.cuda:
            staged.data.record_stream(self.side)

    def _drop_staged(self) -> None:
        staged, self.staged = self.staged, None
        if staged is not None:
            self._drop(staged)

    def _room_for(self, nbytes: int) -> bool:
        """A cache hit (enough reserved-but-unused memory), or free VRAM for it and one more input."""
        if not self.cuda:
            return True
        slack = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if slack >= nbytes:
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        return free >= 2 * nbytes

    def _resolve_timings(self, block: bool) -> None:
        """Fold the events of served prefetches into the stats once they have completed."""
        stats = self.owner.stats
        while self.timings:
            issue, start, ready, need = self.timings[0]
            if block:
                need.synchronize()
                ready.synchronize()
            elif not (need.query() and ready.query()):
                return
            self.timings.popleft()
            late = need.elapsed_time(ready)  # > 0: the compute stream reached the restore before the copy ended
            stats.copy_ms += start.elapsed_time(ready)
            stats.lead_ms += issue.elapsed_time(need)
            stats.wait_ms += max(0.0, late)
            stats.prefetch_hidden += late <= 0

    def live_offloaded(self, x: torch.Tensor) -> bool:
        """``x`` was already offloaded by an earlier layer and is still alive elsewhere (shared): keep it."""
        last = self.last() if self.last is not None else None
        while last is not None:
            if last.src() is x:
                return True
            last = last.prev() if last.prev is not None else None
        return False

    def reset(self) -> None:
        """After a step that raised: wait for our copies, drop the GPU memory we hold, keep the host pool."""
        with self.lock:
            if self.cuda:
                self.side.synchronize()
            self.pending.clear()
            self.staged = None  # the side stream is idle: no stream bookkeeping needed
            self._resolve_timings(block=True)

    def close(self) -> None:
        with self.lock:
            self.reset()
            self.closed = True
            self.pool.close()


# ---------------------------------------------------------------------------------------------------- installation


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

    def __init__(self, owner: "OffloadedCheckpointing", module: torch.nn.Module, name: str, previous: Callable,
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
        self, mode: Mode = "auto", double_buffer: bool = True, min_bytes: int = 64 * _MiB, max_inflight: int = 2,
        trace: int = 0,
    ) -> None:
        if mode not in (True, False, "auto"):
            raise ValueError(f"mode={mode!r}: use True, False or 'auto'")
        self.mode, self.double_buffer, self.min_bytes = mode, double_buffer, int(min_bytes)
        self.max_inflight = max(1, int(max_inflight))  # D2H copies the host may run ahead of before waiting
        self.stats = OffloadStats()
        self.trace: Optional[collections.deque] = collections.deque(maxlen=trace) if trace else None
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
            m._gradient_checkpointing_func = inst
            self._installed.append((m, prev, inst))
        layers = sum(_is_layer(m) for _, m, _, _ in plans)
        timed = sum(inst.ffn is not None for _, _, inst in self._installed)
        self._say("on", f"installed on {layers} checkpointed layers of {type(base).__name__} "
                  f"({'double' if self.double_buffer else 'single'} buffer, mode={self.mode!r}; "
                  f"{timed} of {len(plans)} prefetch after their MLP backward)", logging.INFO)
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

    def _trace(self, kind: str, layer: str, detail: str) -> None:
        if self.trace is not None:
            self.trace.append((kind, layer, detail))

    def stats_dict(self) -> dict:
        """The counters, with every finished prefetch's timing folded in (waits for those events only)."""
        for lane in self._lanes.values():
            with lane.lock:
                lane._resolve_timings(block=True)
        return asdict(self.stats)
