"""The offload machinery behind ``speedups.offload``: a reusable host pool and one lane per device that packs a
layer input to host memory on a side stream and restores it, double-buffered, ahead of its recompute.

Pure torch (no transformers): ``speedups.offload`` decides what is offloaded and when (its module doc argues the
design); a ``_Lane`` only moves bytes. The lane's owner (``OffloadedCheckpointing``) provides ``stats``
(``OffloadStats``), ``double_buffer``, ``max_inflight``, ``_say`` (one message per key) and ``_trace``.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..memory import meminfo, room_for

_MiB = 2**20



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
    info = meminfo() if info is None else info
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

    def __init__(self, lane: _Lane) -> None:
        self.lane = lane
        self.free: list[torch.Tensor] = []
        self.registered: dict[int, torch.Tensor] = {}  # slots we page-locked: kept alive until unregistered
        self.closed = False
        weakref.finalize(self, _unregister_all, self.registered, lane.side)

    def acquire(self, nbytes: int) -> Optional[torch.Tensor]:
        """The smallest idle slot that holds ``nbytes``, else a new one (replacing the largest idle slot); None when
        the host budget or host memory is spent.

        Slots are taken out of ``free`` by position: ``list.remove`` / ``list.index`` compare tensors by value, which
        raises once idle slots differ in size (fewer layers checkpointed after step 1, rows longer than before)."""
        sizes = [s.numel() for s in self.free]
        fits = [i for i, size in enumerate(sizes) if size >= nbytes]
        if fits:
            return self.free.pop(min(fits, key=sizes.__getitem__))
        if self.free:  # larger inputs than before: replace an idle slot instead of adding one
            self._free_memory(self.free.pop(max(range(len(sizes)), key=sizes.__getitem__)))
        owner = self.lane.owner
        cap = owner.max_host_bytes
        if cap is not None and owner.stats.host_bytes + slot_bytes(nbytes) > cap:  # the user's host budget
            owner._say("host_cap", f"offload_max_host_bytes ({cap / _MiB:.0f} MiB) reached; remaining layer inputs "
                       "stay on the GPU")
            return None
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
        info = meminfo()
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

    def __init__(self, lane: _Lane, slot: torch.Tensor, x: torch.Tensor, prev: Optional[_Packed],
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

    def __init__(self, owner: Any, device: torch.device) -> None:
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
        return room_for(self.device, nbytes)

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
