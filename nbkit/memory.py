"""Memory readings and their formatting, in one place: the dashboard, the OOM message, the offload pool, the demo,
the notebooks and the per-rank gather all read memory through here, so every figure a user sees means the same.

- ``device_memory(device)``: one CUDA device's allocated / reserved / peak / total bytes (None off CUDA). Peak is
  ``torch.cuda.max_memory_allocated``: since process start, the user's last reset, or the first training step of a
  FastSFT run whose memory budget reads it (``restart_peak``: the only reset here).
- ``meminfo()``: ``/proc/meminfo`` in bytes; ``host_memory()``: (used, total) host RAM; ``process_rss()`` and
  ``peak_rss()``: this process's resident set now and at its peak.
- ``fmt_bytes(n)``: "812 MiB" / "3.46 GiB" ("--" for None); ``fmt_bytes(n, 1)``: "3.5 GiB".

What the speedups size by (no host sync: the allocator's counters are host-side, the device's free memory is one
driver query):

- ``gpu_limit(device)``: the one definition of how much this process may use on a GPU: its per-process fraction of
  the device (``torch.cuda.set_per_process_memory_fraction``), and no more than what its allocator holds plus what
  the device has free (another process, the CUDA context and non-torch allocations are not ours).
- ``memory_readings(device)``: (limit, peak allocated, allocated now), the three numbers a speedup decides by;
  ``restart_peak(device)`` starts the peak over, so that it is the run's own and not one an earlier cell left.
- ``gpu_in_use(device)``: bytes held by tensors now; ``gpu_reserved(device)``: bytes the allocator holds, graph
  pools included; ``room_for(device, n)``: whether ``n`` more bytes can be had
  from the allocator's cache, or twice that below the limit; ``shares_host_memory(device)``: an integrated GPU.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class DeviceMemory:
    """One CUDA device's memory in bytes."""

    index: int
    name: str
    allocated: int
    reserved: int
    peak: int
    total: int

    def describe(self) -> str:
        return (f"cuda:{self.index} ({self.name}): {fmt_bytes(self.allocated)} allocated, "
                f"{fmt_bytes(self.reserved)} reserved, {fmt_bytes(self.total)} total, "
                f"peak {fmt_bytes(self.peak)} allocated")


def cuda_index(device: Any = None) -> Optional[int]:
    """The CUDA index ``device`` names (a torch.device, "cuda:1", an int; None: the current one), or None when it is
    not a CUDA device or CUDA is absent."""
    import torch

    if not torch.cuda.is_available():
        return None
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def device_memory(device: Any = None) -> Optional[DeviceMemory]:
    """CUDA memory of ``device`` (default: the current CUDA device); None when it is not a CUDA device."""
    import torch

    index = cuda_index(device)
    if index is None:
        return None
    return DeviceMemory(
        index=index,
        name=torch.cuda.get_device_name(index),
        allocated=int(torch.cuda.memory_allocated(index)),
        reserved=int(torch.cuda.memory_reserved(index)),
        peak=int(torch.cuda.max_memory_allocated(index)),
        total=int(torch.cuda.get_device_properties(index).total_memory),
    )


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty off Linux)."""
    out: dict[str, int] = {}
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


def host_memory() -> tuple[Optional[int], Optional[int]]:
    """(used, total) bytes of host RAM, used = total - available; (None, None) where it cannot be read."""
    info = meminfo()
    if "MemTotal" in info:
        total = info["MemTotal"]
        return total - info.get("MemAvailable", info.get("MemFree", 0)), total
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total - vm.available), int(vm.total)
    except Exception:
        return None, None


def process_rss() -> Optional[int]:
    """This process's resident set in bytes, now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss() -> int:
    """This process's peak resident set in bytes."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def peak_bytes(device: Any) -> int:
    """Peak allocated bytes on a CUDA ``device``; on a CPU, this process's peak resident set."""
    reading = device_memory(device)
    return reading.peak if reading is not None else peak_rss()


def fmt_bytes(value: Optional[int], gib_digits: int = 2) -> str:
    """Bytes for people: whole MiB below 1 GiB, GiB with ``gib_digits`` decimals above ("--" for None). Compact
    displays (the dashboard) pass 1."""
    if value is None:
        return "--"
    if abs(value) >= GiB:
        return f"{value / GiB:.{gib_digits}f} GiB"
    return f"{value / MiB:.0f} MiB"


class MemoryReadings(NamedTuple):
    """What a speedup sizes by, in bytes (see ``memory_readings``)."""

    limit: int
    peak: int
    allocated: int


def _indexed(device: Any) -> Any:
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # torch's per-process fraction needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def process_cap(device: Any) -> Optional[int]:
    """The per-process cap on a CUDA device: its total memory times this process's fraction; None off CUDA."""
    import torch

    device = _indexed(device)
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return int(total * fraction(device)) if fraction is not None else int(total)


def gpu_limit(device: Any) -> Optional[int]:
    """The most this process can reach on a CUDA device (see the module docstring); None off CUDA."""
    import torch

    cap = process_cap(device)
    if cap is None:
        return None
    device = _indexed(device)
    free, _ = torch.cuda.mem_get_info(device)
    return min(cap, int(torch.cuda.memory_reserved(device)) + int(free))


def gpu_in_use(device: Any) -> int:
    """Bytes held by tensors on a CUDA ``device`` (the caching allocator's host-side counter); 0 off CUDA."""
    import torch

    device = _indexed(device)
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def gpu_reserved(device: Any) -> int:
    """Bytes the caching allocator holds on a CUDA ``device``, CUDA-graph pools included (their memory is reserved
    for the graphs whether or not a tensor holds it now); 0 off CUDA."""
    import torch

    device = _indexed(device)
    return int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else 0


def pool_reserved(segments: Optional[list] = None) -> dict[tuple, int]:
    """Bytes the caching allocator holds in each private pool (CUDA graphs' pools), by pool id, from its snapshot
    (``torch.cuda.memory_snapshot()``, or ``segments`` given); {} off CUDA. A host-side walk of every segment: for
    reports, not for a step's hot path."""
    import torch

    if segments is None:
        if not torch.cuda.is_available():
            return {}
        segments = torch.cuda.memory_snapshot()
    held: dict[tuple, int] = {}
    for segment in segments:
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        if pool != (0, 0):
            held[pool] = held.get(pool, 0) + int(segment["total_size"])
    return held


def memory_readings(device: Any) -> Optional[MemoryReadings]:
    """(limit, peak allocated, allocated now) on a CUDA device; None off CUDA."""
    import torch

    limit = gpu_limit(device)
    if limit is None:
        return None
    device = _indexed(device)
    return MemoryReadings(limit, int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.memory_allocated(device)))


def restart_peak(device: Any) -> None:
    """Start the peak memory statistics of a CUDA ``device`` over (``torch.cuda.reset_peak_memory_stats``); nothing
    off CUDA. Why: the peak is the process's, and in a notebook an earlier cell (a larger run, a step that ran out of
    memory) leaves one that a new run's budget would read as its own and spend nothing."""
    import torch

    device = _indexed(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def room_for(device: Any, nbytes: int) -> bool:
    """Whether ``nbytes`` more can be allocated on ``device`` without pressing on the limit: a hit in the allocator's
    cache (reserved but unused), or twice ``nbytes`` between what it has reserved and ``gpu_limit``. Always True
    off CUDA."""
    import torch

    device = _indexed(device)
    if device.type != "cuda":
        return True
    reserved = int(torch.cuda.memory_reserved(device))
    if reserved - int(torch.cuda.memory_allocated(device)) >= nbytes:
        return True  # before gpu_limit's driver query: a hit is the common case on the per-layer paths
    return gpu_limit(device) - reserved >= 2 * nbytes


def shares_host_memory(device: Any) -> bool:
    """Whether ``device`` is an integrated GPU (its memory is the host's)."""
    import torch

    device = _indexed(device)
    return device.type == "cuda" and bool(torch.cuda.get_device_properties(device).is_integrated)
