"""One run's GPU memory budget for its decoder layers: the readings and the margins in one place.

Why one budget: what a decoder layer keeps between its forward and its backward (activations, a graph's pool, a
dequantized weight) is spent from the same memory. Each decision reads it here, with the same margin, at a moment
the layer plan chooses, so two decisions never count the same free bytes twice.

The readings are the allocator's host-side counters and one driver query of the device's free memory
(``nbkit.memory.memory_readings``: the per-process fraction applied): no host sync. Off CUDA there are none and
every method says so (None), except where a test hands in its own ``readings``.

- ``start()``: at the first training micro-batch, what tensors hold (the model, before any optimizer state); the
  device's peak statistics start over there (``memory.restart_peak``), so every look reads this run's peak, not
  one an earlier cell of the notebook left.
- ``first_look()``: after step 1, what the plan may spend: ``SHARE`` of the limit less ``MARGIN`` of it, less the peak
  so far and what persistent memory grew since ``start`` (optimizer state). ``SHARE`` keeps a quarter back for what
  step 1 could not show (a longer row, the optimizer's first step).
- ``second_look(scale)``: after the first optimizer step the plan ran, the same from the peak the plan made, its part
  above what is held between micro-batches scaled to the longest micro-batch (``scale``), the allocator's reserved
  memory counted where it is more (graph pools keep theirs reserved). Only the step's own peak (``step_peak``) is
  scaled: a peak a capture set is its pool's, captured at the largest bucket already, and counts as it is.
- ``graphs_room(need)``: whether ``need`` more bytes of graph pools fit now; the pools' memory is reserved for good, so
  the room is the limit less what is reserved, and the step's own peak above the present must stay free. The step's
  own: a peak set while a graph was captured (``capturing()``) is that capture's allocations in its pool, which stay
  reserved and are counted there, not a second time as the step's (``step_peak``). Given what
  the pools reserve (``pools``), what is held is what tensors hold plus the pools: the allocator's cached blocks are
  where the step's own peak comes from, so they are not counted a second time; a capture cannot take them, though,
  so they are given back first where they are in its way (``cache_in_the_way(need, pools)``). A pool that stands in
  for the step's own eager allocations (checkpointed layers' recompute graphs: the recompute no longer comes from
  the allocator's cache) counts from what tensors hold instead, the cache likewise given back first where it is in
  the way (``cache_in_the_way(need)``).
- ``crowded(need, in_use)``: whether a call that needs ``need`` more bytes would take the GPU past the margin (the tiled
  MLP's test; calls below ``COUNTS_FROM`` of the limit are never crowded).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..memory import MemoryReadings, fmt_bytes, gpu_in_use, gpu_limit, gpu_reserved, memory_readings, restart_peak

MARGIN = 0.10  # of the limit, never planned for: allocator fragmentation, kernels' workspaces
SHARE = 0.75  # of what is left at a look: what the plan may spend
COUNTS_FROM = 1 / 16  # of the limit: a call needing less is never crowded


@dataclass(frozen=True)
class Look:
    """What a look found: ``spend`` bytes for the plan, and ``why`` in words (for the plan's line)."""

    spend: int
    why: str


class Budget:
    """The memory budget of one run on one device. ``readings``: where the numbers come from (tests pass their
    own; default ``nbkit.memory.memory_readings``)."""

    def __init__(self, device: torch.device,
                 readings: Optional[Callable[[torch.device], Optional[MemoryReadings]]] = None) -> None:
        self.device = device
        self._readings = readings or memory_readings
        self._allocated_at_start: Optional[int] = None
        self._capture_peak: Optional[int] = None  # the peak read as the last graph capture ended
        self._own_peak = 0  # the highest peak read outside graph captures, up to the last one's start

    @property
    def measured(self) -> bool:
        """Whether this device has memory counters (a CUDA GPU, or a test's readings)."""
        return self.read() is not None

    def read(self) -> Optional[MemoryReadings]:
        return self._readings(self.device)

    def start(self) -> None:
        """Note what tensors hold as training starts and start the peak over (once: a later call changes nothing)."""
        if self._allocated_at_start is None:
            restart_peak(self.device)
            readings = self.read()
            self._allocated_at_start = readings[2] if readings is not None else 0

    def first_look(self) -> Optional[Look]:
        readings = self.read()
        if readings is None:
            return None
        limit, peak, allocated = readings
        grown = max(0, allocated - (self._allocated_at_start if self._allocated_at_start is not None else allocated))
        spend = max(0, int(SHARE * (limit * (1 - MARGIN) - peak - grown)))
        return Look(spend, f"{fmt_bytes(spend)} to spend: {SHARE:.0%} of the {fmt_bytes(limit)} limit less "
                           f"{MARGIN:.0%}, the {fmt_bytes(peak)} peak and {fmt_bytes(grown)} grown since step 1")

    def second_look(self, scale: float) -> Optional[Look]:
        readings = self.read()
        if readings is None:
            return None
        limit, peak, allocated = readings
        own, reserved = self.step_peak(peak), gpu_reserved(self.device)
        projected = allocated + int(max(0, own - allocated) * max(1.0, scale))
        used = max(projected, peak, reserved)
        spend = max(0, int(SHARE * (limit * (1 - MARGIN) - used)))
        return Look(spend, f"{fmt_bytes(spend)} to spend: {SHARE:.0%} of the {fmt_bytes(limit)} limit less "
                           f"{MARGIN:.0%} and the {fmt_bytes(used)} the plan's peak comes to at the longest "
                           f"micro-batch, the most of: the step's own {fmt_bytes(own)} peak scaled x{max(1.0, scale):.2f} "
                           f"above the {fmt_bytes(allocated)} held ({fmt_bytes(projected)}), the device's "
                           f"{fmt_bytes(peak)} peak, {fmt_bytes(reserved)} reserved")

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a graph capture: what it allocates goes into its pool, reserved for good and counted as reserved,
        so a peak it sets is the pool's, not the step's own (``step_peak``)."""
        before = self.read()
        if before is not None and (self._capture_peak is None or before[1] > self._capture_peak):
            self._own_peak = max(self._own_peak, before[1])  # the peak rose outside a capture since the last one
        try:
            yield
        finally:
            after = self.read()
            if after is not None:
                self._capture_peak = after[1]

    def step_peak(self, peak: int) -> int:
        """Of the device's ``peak``, the step's own: the peak itself before any capture or once it has risen above the
        last capture's; else the highest read outside the captures. A peak of the step's that stays below a capture's
        does not show in the counters; the one read before the captures stands for it: the same micro-batches with
        their layers eager, whose activations the graphs now keep in their pools."""
        if self._capture_peak is None or peak > self._capture_peak:
            return peak
        return self._own_peak

    def graphs_room(self, need: int, stands_in: bool = False, pools: Optional[int] = None) -> Optional[str]:
        """None when ``need`` more bytes of graph pools fit now; else why not, in words. ``stands_in``: the pool
        stands in for allocations the step makes from the allocator's cache, whose cached blocks then do not count.
        ``pools``: what the graph pools reserve (their tensors are counted twice: a bound from above)."""
        readings = self.read()
        if readings is None:
            return None
        limit, peak, allocated = readings
        if stands_in:
            reserved = allocated
        elif pools is not None:
            reserved = min(allocated + pools, max(gpu_reserved(self.device), allocated))
        else:
            reserved = max(gpu_reserved(self.device), allocated)
        headroom = max(MARGIN * limit, self.step_peak(peak) - allocated)  # what the step may need beyond what it holds
        if limit - reserved - need < headroom:
            return (f"no memory for more graphs ({(limit - reserved) / 2**30:.1f} GiB not reserved, the graphs take "
                    f"~{need / 2**30:.2f} GiB and {headroom / 2**30:.1f} GiB stay free for the step)")
        return None

    def cache_in_the_way(self, need: int, pools: Optional[int] = None) -> bool:
        """Whether ``need`` bytes of graph pools fit only once the allocator's cache is given back: a pool that stands
        in (``pools`` None), or kept graphs beside pools that reserve ``pools`` (a capture's pool cannot take the
        cache's blocks: the allocator gives none back while a capture is under way)."""
        fits = self.graphs_room(need, stands_in=True) if pools is None else self.graphs_room(need, pools=pools)
        return fits is None and self.graphs_room(need) is not None

    def crowded(self, need: int, extra: int = 0) -> bool:
        """Whether ``need`` more bytes (plus ``extra`` that the call adds beside them) would take the GPU past
        ``1 - MARGIN`` of its limit; False off CUDA and for calls below ``COUNTS_FROM`` of the limit."""
        limit = gpu_limit(self.device) if self.device.type == "cuda" else None
        if limit is None or need < COUNTS_FROM * limit:
            return False
        return gpu_in_use(self.device) + extra + need > (1 - MARGIN) * limit
