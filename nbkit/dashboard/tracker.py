"""What the dashboard shows: memory readings and a ``Snapshot`` of the run, computed by ``RunTracker`` from the
trainer's events. No I/O here and no clock of its own: times come in as arguments, so tests drive it exactly."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..memory import cuda_index, device_memory, host_memory

if TYPE_CHECKING:
    from ..distributed import RankMemory


@dataclass(frozen=True)
class MemoryReading:
    """Bytes in use. GPU fields are None when training does not run on CUDA; host fields when unreadable."""

    gpu_name: Optional[str] = None
    allocated: Optional[int] = None
    reserved: Optional[int] = None
    peak: Optional[int] = None
    total: Optional[int] = None
    host_used: Optional[int] = None
    host_total: Optional[int] = None


def read_memory(index: Optional[int]) -> MemoryReading:
    """Host RAM, plus CUDA device ``index``'s memory when it is not None (both through ``nbkit.memory``)."""
    used, host_total = host_memory()
    cuda = device_memory(index) if index is not None else None
    if cuda is None:
        return MemoryReading(host_used=used, host_total=host_total)
    return MemoryReading(gpu_name=cuda.name, allocated=cuda.allocated, reserved=cuda.reserved, peak=cuda.peak,
                         total=cuda.total, host_used=used, host_total=host_total)


def default_memory_reader(device: Any = None) -> Callable[[], MemoryReading]:
    """A reader for ``device`` (a torch.device, "cuda:1", an index or None): CUDA numbers only when it names a CUDA
    device (None does not), host RAM always. Peak is ``torch.cuda.max_memory_allocated`` since process start or
    the user's last reset (never reset here, so other measurements are not disturbed)."""
    index = cuda_index(device) if device is not None else None
    return lambda: read_memory(index)


@dataclass(frozen=True)
class Snapshot:
    """Everything one render shows. Times in seconds of the dashboard's clock; None means not known yet.

    ``epoch_bound``: the run ends after ``num_epochs`` epochs (no ``max_steps``), so "epoch 2.00/3" is its
    progress; otherwise the epoch count is only how much of the data has been seen. ``world_size``: processes
    of the job (token counts are already the sum over them); ``ranks``: every rank's memory (a multi-process
    run's gather, empty otherwise).
    """

    now: float
    phase: str  # "training", "evaluating" or "done"
    step: int
    max_steps: int
    epoch: Optional[float]
    num_epochs: Optional[float]
    elapsed: float
    eta: Optional[float]
    steps_per_s: Optional[float]
    tokens: Optional[int]
    tokens_per_s: Optional[float]
    tokens_per_s_mean: Optional[float]
    loss: Optional[float]
    loss_ema: Optional[float]
    train_loss: Optional[float]
    learning_rate: Optional[float]
    grad_norm: Optional[float]
    eval_loss: Optional[float]
    eval_step: int
    eval_total: Optional[int]
    memory: MemoryReading
    history: tuple[tuple[int, float, float], ...] = field(default=(), repr=False)  # (step, loss, ema)
    epoch_bound: bool = True
    world_size: int = 1
    ranks: tuple[RankMemory, ...] = ()

    @property
    def vram_percent(self) -> Optional[float]:
        """Reserved memory as a percentage of the device total: what the process holds from the GPU's view."""
        m = self.memory
        return None if not m.total or m.reserved is None else 100.0 * m.reserved / m.total

    @property
    def allocated_percent(self) -> Optional[float]:
        m = self.memory
        return None if not m.total or m.allocated is None else 100.0 * m.allocated / m.total


class RunTracker:
    """Records one training run's events and derives rates, ETA and the smoothed loss. No I/O, clock-driven.

    - ETA: remaining steps times the mean step time since the first finished step (the first step, which
      carries warm-up and compilation, is left out once a second one exists).
    - tokens/s now: over the latest logs spanning at least ``rate_window`` seconds (the last interval when 0);
      mean: all tokens of this run over the time from ``on_train_begin`` to the latest log.
    - smoothed loss: EMA with factor ``ema``, divided by (1 - ema**n) so early values are not biased to zero.
    - history: (step, loss, ema) per logged loss, halved when it exceeds ``max_points`` (memory stays bounded).
    """

    def __init__(self, t_begin: float, step: int, max_steps: int, tokens_base: Optional[dict[str, int]] = None,
                 ema: float = 0.9, rate_window: float = 5.0, max_points: int = 512, epoch_bound: bool = True,
                 world_size: int = 1) -> None:
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema={ema}: use 0 <= ema < 1")
        self.t_begin = t_begin
        self.step_begin = step
        self.step = step
        self.max_steps = max_steps
        self.epoch_bound = epoch_bound
        self.world_size = world_size
        self.epoch: Optional[float] = None
        self.num_epochs: Optional[float] = None
        self.first_step: Optional[tuple[float, int]] = None  # (time, step) of the first finished step
        self.last_step_time: Optional[float] = None
        self.ema_factor = ema
        self.ema_raw = 0.0
        self.n_losses = 0
        self.loss: Optional[float] = None
        self.loss_ema: Optional[float] = None
        self.train_loss: Optional[float] = None
        self.learning_rate: Optional[float] = None
        self.grad_norm: Optional[float] = None
        self.eval_loss: Optional[float] = None
        self.phase = "training"
        self.eval_step = 0
        self.eval_total: Optional[int] = None
        self.tokens_base = dict(tokens_base or {})
        self.tokens_key: Optional[str] = None
        self.tokens: Optional[int] = None
        self.token_points: deque[tuple[float, int]] = deque()
        self.tokens_per_s: Optional[float] = None
        self.tokens_per_s_mean: Optional[float] = None
        self.rate_window = rate_window
        self.max_points = max_points
        self.history: list[tuple[int, float, float]] = []

    def step_end(self, now: float, step: int, epoch: Optional[float], num_epochs: Optional[float]) -> None:
        self.step = step
        self.epoch = epoch
        self.num_epochs = num_epochs
        self.last_step_time = now
        if self.first_step is None:
            self.first_step = (now, step)

    def log(self, now: float, step: int, logs: dict[str, Any]) -> None:
        self.step = max(self.step, step)
        if finite(logs.get("loss")):
            self._add_loss(step, float(logs["loss"]))
        for key, attr in (("learning_rate", "learning_rate"), ("grad_norm", "grad_norm"),
                          ("eval_loss", "eval_loss"), ("train_loss", "train_loss")):
            if finite(logs.get(key)):
                setattr(self, attr, float(logs[key]))
        for key in ("num_tokens", "num_input_tokens_seen"):
            if finite(logs.get(key)) and self.tokens_key in (None, key):
                self._add_tokens(now, key, int(logs[key]))
                break

    def _add_loss(self, step: int, loss: float) -> None:
        self.n_losses += 1
        self.ema_raw = self.ema_factor * self.ema_raw + (1.0 - self.ema_factor) * loss
        self.loss = loss
        self.loss_ema = self.ema_raw / (1.0 - self.ema_factor**self.n_losses)
        self.history.append((step, loss, self.loss_ema))
        if len(self.history) > self.max_points:
            self.history = self.history[:-1:2] + [self.history[-1]]

    def _add_tokens(self, now: float, key: str, count: int) -> None:
        if self.tokens_key is None:
            self.tokens_key = key
            base = self.tokens_base.get(key, 0)
            if base > count:  # the counter restarted: count from zero
                base = 0
            self.tokens_base[key] = base
            self.token_points.append((self.t_begin, base))
        self.tokens = count - self.tokens_base[key]
        points = self.token_points
        points.append((now, count))
        while len(points) > 2 and now - points[1][0] >= self.rate_window:
            points.popleft()
        t_old, c_old = points[0]
        if now > t_old:
            self.tokens_per_s = (count - c_old) / (now - t_old)
        if now > self.t_begin:
            self.tokens_per_s_mean = self.tokens / (now - self.t_begin)

    def snapshot(self, now: float, memory: MemoryReading, ranks: tuple[RankMemory, ...] = ()) -> Snapshot:
        eta = steps_per_s = None
        if self.first_step is not None and self.last_step_time is not None:
            t0, s0 = self.first_step
            if self.step > s0 and self.last_step_time > t0:
                steps_per_s = (self.step - s0) / (self.last_step_time - t0)
            elif self.step > self.step_begin and self.last_step_time > self.t_begin:
                steps_per_s = (self.step - self.step_begin) / (self.last_step_time - self.t_begin)
        if steps_per_s:
            eta = max(0, self.max_steps - self.step) / steps_per_s
        return Snapshot(
            now=now, phase=self.phase, step=self.step, max_steps=self.max_steps, epoch=self.epoch,
            num_epochs=self.num_epochs, elapsed=max(0.0, now - self.t_begin), eta=eta, steps_per_s=steps_per_s,
            tokens=self.tokens, tokens_per_s=self.tokens_per_s, tokens_per_s_mean=self.tokens_per_s_mean,
            loss=self.loss, loss_ema=self.loss_ema, train_loss=self.train_loss, learning_rate=self.learning_rate,
            grad_norm=self.grad_norm, eval_loss=self.eval_loss, eval_step=self.eval_step,
            eval_total=self.eval_total, memory=memory, history=tuple(self.history), epoch_bound=self.epoch_bound,
            world_size=self.world_size, ranks=tuple(ranks),
        )


def finite(value: Any) -> bool:
    """A real, finite number (bools and NaN/inf are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
