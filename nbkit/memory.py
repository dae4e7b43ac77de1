"""Memory readings and their formatting, in one place: the dashboard, the OOM message, the offload pool, the demo,
the notebooks and the per-rank gather all read memory through here, so every figure a user sees means the same.

- ``device_memory(device)``: one CUDA device's allocated / reserved / peak / total bytes (None off CUDA). Peak is
  ``torch.cuda.max_memory_allocated``: since process start or the user's last reset (never reset here).
- ``meminfo()``: ``/proc/meminfo`` in bytes; ``host_memory()``: (used, total) host RAM; ``process_rss()`` and
  ``peak_rss()``: this process's resident set now and at its peak.
- ``fmt_bytes(n)``: "812 MiB" / "3.46 GiB" ("--" for None); ``fmt_bytes(n, 1)``: "3.5 GiB".
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

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
