"""The non-finite-loss check of ``on_nonfinite_loss`` without a host read inside the step (one process).

Why: reading the loss after a micro-batch's backward makes the host wait for the whole backward; the gradient
clip, the optimizer, the next batch and the next forward are then queued while the GPU has nothing to run.
transformers' ``logging_nan_inf_filter`` reads the same loss at the same point. On a short step that idle time is
a tenth of the step (BENCHMARKS.md, run 17).

What it does instead: each micro-batch's flags (non-finite loss, no label to train on) stay on the device. Before
the optimizer step the window's flag is handed to a fused torch optimizer as ``found_inf``, as
``torch.amp.GradScaler`` does, so a non-finite window's update is not applied with no read at all (a non-fused
optimizer reads the flags there instead, once per optimizer step, and steps over a bad window by dropping its
gradients). After the step the flags are copied to the host without waiting, and read when that copy is surely
done: when the step logs, saves or evaluates (before any of them), else right after the next micro-batch has been
queued, and at the end of training. transformers' loss filter is computed on the device (``filtered_loss``).

Contract (``ReliableTraining`` acts on what ``resolve`` reports, as the per-micro-batch check does): ``stop``
raises ``NonFiniteLossError`` naming the step and micro-batch, with that window's optimizer update not applied and
``state.global_step`` set back to the last applied step, before any log, save or evaluation of that step; ``skip``
applies nothing of the window (weights and optimizer state unchanged) and records the event; masked batches are
warned about. The only difference is when the error is raised: up to one micro-batch later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class MicroBatch:
    """One micro-batch's flags (0-d bool tensors on the device) and what the report needs of it."""

    bad: torch.Tensor
    masked: torch.Tensor
    loss: torch.Tensor
    inputs: dict[str, Any]
    step: int  # the optimizer step it belongs to, 1-based
    micro: int  # 1-based within its accumulation window


@dataclass
class _Window:
    micro_batches: list[MicroBatch]
    host: torch.Tensor  # (n, 2) bool: per micro-batch (non-finite, masked); filled asynchronously
    done: Any  # a CUDA event after the copy, or None on a host device (the copy was synchronous)


def found_inf_supported(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` honours ``optimizer.found_inf`` (torch's fused Adam/AdamW/SGD/Adagrad: the
    attribute ``GradScaler`` sets for them)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class DeferredLossCheck:
    """One training run's flags, from the micro-batch that makes them to the host read that reports them.

    ``report(micro_batch, nonfinite, masked)`` is the trainer's: it warns, records or raises. Flags of a window are
    reported in micro-batch order; a raise leaves the windows after it unreported (the run is over).
    """

    def __init__(self, report: Callable[[MicroBatch, bool, bool], None]) -> None:
        self._report = report
        self._window: list[MicroBatch] = []
        self._pending: list[_Window] = []

    # -- in the step -----------------------------------------------------------------------------------------------------
    def record(self, loss: torch.Tensor, masked: torch.Tensor, inputs: dict[str, Any], step: int, micro: int) -> None:
        """Keep a micro-batch's flags on the device (no read)."""
        loss = loss.detach()
        bad = ~torch.isfinite(loss).all()
        self._window.append(MicroBatch(bad, masked.to(bad.device), loss, inputs, step, micro))

    def window_flag(self) -> torch.Tensor | None:
        """The current window's "some loss was non-finite" as a 0-d float32 tensor (``found_inf``'s form)."""
        if not self._window:
            return None
        return torch.stack([m.bad for m in self._window]).any().float()

    def read_window_now(self) -> bool:
        """Report the current window at once (a host read); True when a loss in it was non-finite."""
        window = self._window
        self._window = []
        flags = _flags(window).tolist() if window else []
        for micro_batch, (bad, masked) in zip(window, flags):
            self._report(micro_batch, bad, masked)
        return any(bad for bad, _ in flags)

    def window_done(self) -> None:
        """After the optimizer step: start the host copy of the window's flags, to be read later."""
        window = self._window
        self._window = []
        if not window:
            return
        flags = _flags(window)
        on_gpu = flags.is_cuda
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=on_gpu)
        host.copy_(flags, non_blocking=on_gpu)
        done = None
        if on_gpu:
            done = torch.cuda.Event()
            done.record()
        self._pending.append(_Window(window, host, done))

    # -- later -------------------------------------------------------------------------------------------------------------
    def resolve(self) -> None:
        """Report every finished window whose flags are still unread (waits for their copies only)."""
        while self._pending:
            window = self._pending.pop(0)
            if window.done is not None:
                window.done.synchronize()
            for micro_batch, (bad, masked) in zip(window.micro_batches, window.host.tolist()):
                self._report(micro_batch, bool(bad), bool(masked))

    @property
    def unread(self) -> bool:
        return bool(self._pending)

    def clear(self) -> None:
        self._window, self._pending = [], []


def _flags(window: list[MicroBatch]) -> torch.Tensor:
    """(n, 2) bool on the device: per micro-batch (non-finite, masked)."""
    return torch.stack([torch.stack([m.bad, m.masked]) for m in window])


def filtered_loss(loss: torch.Tensor, accumulated: torch.Tensor, steps_since_log: int) -> torch.Tensor:
    """transformers' ``logging_nan_inf_filter`` on the device: what its loop adds to its running loss for this
    micro-batch. A non-finite loss adds the running loss's average over the steps since the last log instead, the
    same expression transformers evaluates after reading the loss on the host."""
    return torch.where(torch.isfinite(loss), loss, accumulated / (1 + steps_since_log))
