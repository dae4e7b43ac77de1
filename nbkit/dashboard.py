"""``LiveDashboard``: one live, throttled readout of a training run for notebooks (and terminals).

What it shows: progress (step/total, epoch, elapsed, ETA), tokens/s (now and mean, tokens as TRL counts them: the
cumulative ``num_tokens`` that ``SFTTrainer.log`` adds to each log; plain ``Trainer`` runs use
``num_input_tokens_seen``), loss (last and bias-corrected EMA) with a small SVG chart, learning rate, VRAM
(allocated, reserved, peak, total, with a bar; CUDA only), host RAM and the GPU name.

How it shows it, picked by ``mode``:

- ``"widget"``: one ipywidgets panel (core widgets only) whose values change in place;
- ``"html"``: one ``IPython.display`` output, rewritten through its display id;
- ``"text"``: one line rewritten with ``\\r`` on a terminal, or one line every ``text_interval`` seconds otherwise;
- ``"auto"`` (default; the env var ``NBKIT_DASHBOARD`` may name another): widget inside a notebook kernel when
  ipywidgets imports, else html inside a kernel, else text. A kernel cannot tell whether its frontend renders
  widgets, so the widget output also carries a ``text/html`` rendering that widget-less frontends show instead.

Contract: renders at most once per ``min_interval`` seconds (data arriving in between is kept and shown by the next
render), only on the thread that called ``on_train_begin`` and only on the world's main process. Output never grows
with the number of steps. At the end of a run the live output is replaced by a static HTML summary (a printed
summary in text mode) that renders anywhere, including saved notebooks and viewers without widget support.

Usage with nbkit's ``FastSFT`` (it attaches itself in notebooks) or with a plain TRL ``SFTTrainer``::

    from nbkit.dashboard import attach_dashboard
    dashboard = attach_dashboard(trainer)   # adds the callback and takes over the progress display
    trainer.train()

``trainer.add_callback(LiveDashboard())`` works as well, but a callback never sees its trainer, so transformers'
own progress display (the notebook table or tqdm bar) then keeps running beside the dashboard. ``attach`` removes
it from ``trainer.callback_handler`` and ``detach`` puts it back where it was; while attached, events outside a
training run (a standalone ``trainer.evaluate()``/``predict()``) are forwarded to it, so those keep their display.
"""

from __future__ import annotations

import html
import math
import os
import shutil
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TextIO

from transformers import TrainerCallback

MODES = ("auto", "widget", "html", "text")
ENV_MODE = "NBKIT_DASHBOARD"
_GIB = 2**30


# ---------------------------------------------------------------------------------------------------------------
# Where are we running?


def in_notebook() -> bool:
    """True inside a Jupyter-protocol kernel (Jupyter, Colab, Kaggle, VS Code); False in a terminal or script.

    Looks only at an IPython that is already imported, so plain scripts never pay for importing it.
    """
    ipython_module = sys.modules.get("IPython")
    if ipython_module is None:
        return False
    try:
        shell = ipython_module.get_ipython()
    except Exception:
        return False
    if shell is None:
        return False
    if getattr(shell, "kernel", None) is not None:
        return True
    try:
        return "IPKernelApp" in shell.config
    except Exception:
        return False


def _widgets_importable() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except Exception:
        return False
    return True


def resolve_mode(mode: str = "auto") -> str:
    """Turn ``mode`` ("auto" or a concrete mode) into "widget", "html" or "text" for the current process."""
    if mode == "auto":
        mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"dashboard mode {mode!r}: choose one of {MODES}")
    if mode != "auto":
        return mode
    if not in_notebook():
        return "text"
    return "widget" if _widgets_importable() else "html"


# ---------------------------------------------------------------------------------------------------------------
# Memory readings


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


def host_memory() -> tuple[Optional[int], Optional[int]]:
    """(used, total) bytes of host RAM, used = total - available: psutil if present, else /proc/meminfo."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total - vm.available), int(vm.total)
    except Exception:
        pass
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        total = fields["MemTotal"]
        available = fields.get("MemAvailable", fields.get("MemFree", 0))
        return total - available, total
    except Exception:
        return None, None


def default_memory_reader(device: Any = None) -> Callable[[], MemoryReading]:
    """A reader for ``device`` (a torch.device, an index or None): CUDA numbers only when it is a CUDA device.

    Peak is ``torch.cuda.max_memory_allocated``: since process start or the user's last reset (never reset here,
    so other measurements are not disturbed).
    """
    import torch

    index: Optional[int] = None
    if isinstance(device, int):
        index = device
    elif device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda":
        index = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
    if index is not None and not torch.cuda.is_available():
        index = None
    name: Optional[str] = None
    total: Optional[int] = None
    if index is not None:
        name = torch.cuda.get_device_name(index)
        total = int(torch.cuda.get_device_properties(index).total_memory)

    def read() -> MemoryReading:
        used, host_total = host_memory()
        if index is None:
            return MemoryReading(host_used=used, host_total=host_total)
        return MemoryReading(
            gpu_name=name,
            allocated=int(torch.cuda.memory_allocated(index)),
            reserved=int(torch.cuda.memory_reserved(index)),
            peak=int(torch.cuda.max_memory_allocated(index)),
            total=total,
            host_used=used,
            host_total=host_total,
        )

    return read


# ---------------------------------------------------------------------------------------------------------------
# What is shown: a snapshot of the run, computed from recorded events


@dataclass(frozen=True)
class Snapshot:
    """Everything one render shows. Times in seconds of the dashboard's clock; None means not known yet."""

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
                 ema: float = 0.9, rate_window: float = 5.0, max_points: int = 512) -> None:
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema={ema}: use 0 <= ema < 1")
        self.t_begin = t_begin
        self.step_begin = step
        self.step = step
        self.max_steps = max_steps
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
        if _finite(logs.get("loss")):
            self._add_loss(step, float(logs["loss"]))
        for key, attr in (("learning_rate", "learning_rate"), ("grad_norm", "grad_norm"),
                          ("eval_loss", "eval_loss"), ("train_loss", "train_loss")):
            if _finite(logs.get(key)):
                setattr(self, attr, float(logs[key]))
        for key in ("num_tokens", "num_input_tokens_seen"):
            if _finite(logs.get(key)) and self.tokens_key in (None, key):
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

    def snapshot(self, now: float, memory: MemoryReading) -> Snapshot:
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
            eval_total=self.eval_total, memory=memory, history=tuple(self.history),
        )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------------------------
# Formatting


def fmt_duration(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "--"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def fmt_count(value: Optional[float]) -> str:
    if value is None:
        return "--"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}" if value != int(value) else str(int(value))


def fmt_bytes(value: Optional[int]) -> str:
    if value is None:
        return "--"
    if value >= _GIB:
        return f"{value / _GIB:.1f} GiB"
    return f"{value / 2**20:.0f} MiB"


def _fmt(value: Optional[float], spec: str) -> str:
    return "--" if value is None else format(value, spec)


def _progress_text(s: Snapshot) -> str:
    pct = f" {100 * s.step / s.max_steps:.0f}%" if s.max_steps > 0 else ""
    epoch = f" | epoch {s.epoch:.2f}/{_fmt(s.num_epochs, 'g')}" if s.epoch is not None else ""
    return f"step {s.step}/{s.max_steps}{pct}{epoch} | {fmt_duration(s.elapsed)} elapsed, ETA {fmt_duration(s.eta)}"


def _vram_text(s: Snapshot) -> str:
    m = s.memory
    if m.total is None:
        return "VRAM -- (not on CUDA)"
    return (f"VRAM {fmt_bytes(m.allocated)} alloc, {fmt_bytes(m.reserved)} reserved, peak {fmt_bytes(m.peak)} "
            f"of {fmt_bytes(m.total)} ({_fmt(s.vram_percent, '.0f')}%)")


def _ram_text(s: Snapshot) -> str:
    m = s.memory
    return f"RAM {fmt_bytes(m.host_used)} of {fmt_bytes(m.host_total)}"


def text_line(s: Snapshot) -> str:
    """The one-line readout of text mode."""
    parts = [
        f"[nbkit] {_progress_text(s)}",
        f"{fmt_count(s.tokens_per_s)} tok/s (mean {fmt_count(s.tokens_per_s_mean)})",
        f"loss {_fmt(s.loss, '.4f')} (ema {_fmt(s.loss_ema, '.4f')})",
        f"lr {_fmt(s.learning_rate, '.2e')}",
    ]
    if s.phase == "evaluating":
        parts.append(f"eval {s.eval_step}/{s.eval_total if s.eval_total is not None else '?'}")
    m = s.memory
    if m.total is not None:
        parts.append(f"VRAM {fmt_bytes(m.reserved)}/{fmt_bytes(m.total)} {_fmt(s.vram_percent, '.0f')}% "
                     f"peak {fmt_bytes(m.peak)}")
    if m.host_total is not None:
        parts.append(f"RAM {fmt_bytes(m.host_used)}/{fmt_bytes(m.host_total)}")
    return " | ".join(parts)


def summary_text(s: Snapshot) -> str:
    """The printed end-of-run summary of text mode."""
    lines = [
        f"[nbkit] training finished: {s.step}/{s.max_steps} steps in {fmt_duration(s.elapsed)}",
        f"  tokens: {fmt_count(s.tokens)} at {fmt_count(s.tokens_per_s_mean)} tok/s mean",
        f"  loss: last {_fmt(s.loss, '.4f')}, smoothed {_fmt(s.loss_ema, '.4f')}, "
        f"run mean {_fmt(s.train_loss, '.4f')}" + (f", eval {s.eval_loss:.4f}" if s.eval_loss is not None else ""),
        f"  {_vram_text(s)}",
        f"  {_ram_text(s)}",
    ]
    if s.memory.gpu_name:
        lines.append(f"  GPU: {s.memory.gpu_name}")
    return "\n".join(lines)


def loss_chart_svg(history: tuple[tuple[int, float, float], ...], width: int = 360, height: int = 110) -> str:
    """Inline SVG of logged loss (thin, grey) and its EMA (thick, blue) over steps; no script, no external file."""
    pad_l, pad_r, pad_t, pad_b = 44, 8, 8, 18
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" style="font:10px sans-serif">')
    frame = (f'<rect x="{pad_l}" y="{pad_t}" width="{width - pad_l - pad_r}" height="{height - pad_t - pad_b}" '
             f'fill="none" stroke="#8888" />')
    if not history:
        return (head + frame + f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#888">'
                "loss appears at the first log</text></svg>")
    steps = [h[0] for h in history]
    values = [v for h in history for v in h[1:]]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    x0, x1 = min(steps), max(steps)
    span = (x1 - x0) or 1

    def xy(step: int, value: float) -> str:
        x = pad_l + (step - x0) / span * (width - pad_l - pad_r)
        y = pad_t + (hi - value) / (hi - lo) * (height - pad_t - pad_b)
        return f"{x:.1f},{y:.1f}"

    raw = " ".join(xy(h[0], h[1]) for h in history)
    ema = " ".join(xy(h[0], h[2]) for h in history)
    return (
        head + frame
        + f'<polyline points="{raw}" fill="none" stroke="#999" stroke-width="1" />'
        + f'<polyline points="{ema}" fill="none" stroke="#1f77b4" stroke-width="2" />'
        + f'<text x="{pad_l - 4}" y="{pad_t + 8}" text-anchor="end" fill="currentColor">{hi:.3g}</text>'
        + f'<text x="{pad_l - 4}" y="{height - pad_b}" text-anchor="end" fill="currentColor">{lo:.3g}</text>'
        + f'<text x="{pad_l}" y="{height - 4}" fill="currentColor">step {x0}</text>'
        + f'<text x="{width - pad_r}" y="{height - 4}" text-anchor="end" fill="currentColor">step {x1}</text>'
        + "</svg>"
    )


def _bar_html(percent: Optional[float], inner_percent: Optional[float] = None, width: int = 320,
              color: Optional[str] = None) -> str:
    """A progress bar made of divs; ``inner_percent`` draws a darker part (allocated inside reserved). Without
    ``color`` the bar is a fill level (green, orange past 80%, red past 95%)."""
    p = 0.0 if percent is None else min(100.0, max(0.0, percent))
    if color is None:
        color = "#2ca02c" if p < 80 else "#ff7f0e" if p < 95 else "#d62728"
    inner = ""
    if inner_percent is not None:
        q = min(p, max(0.0, inner_percent))
        inner = f'<div style="width:{q:.1f}%;height:100%;background:#0006"></div>'
    return (f'<div style="width:{width}px;height:10px;border:1px solid #8888;border-radius:3px;overflow:hidden;'
            f'display:inline-block;vertical-align:middle"><div style="width:{p:.1f}%;height:100%;'
            f'background:{color}">{inner}</div></div>')


def _stats_rows(s: Snapshot, final: bool) -> list[tuple[str, str]]:
    rows = [
        ("tokens/s", f"{fmt_count(s.tokens_per_s)} now, {fmt_count(s.tokens_per_s_mean)} mean"
                     + (f" ({fmt_count(s.tokens)} tokens)" if s.tokens is not None else "")),
        ("loss", f"{_fmt(s.loss, '.4f')} last, {_fmt(s.loss_ema, '.4f')} smoothed"
                 + (f", {s.train_loss:.4f} run mean" if final and s.train_loss is not None else "")),
        ("learning rate", _fmt(s.learning_rate, ".3e")),
    ]
    if s.grad_norm is not None:
        rows.append(("grad norm", f"{s.grad_norm:.3g}"))
    if s.eval_loss is not None:
        rows.append(("eval loss", f"{s.eval_loss:.4f}"))
    if s.steps_per_s:
        rows.append(("step time", f"{1 / s.steps_per_s:.3g} s"))
    return rows


def _table_html(rows: list[tuple[str, str]]) -> str:
    cells = "".join(
        f'<tr><td style="padding:1px 12px 1px 0;opacity:.75">{html.escape(k)}</td>'
        f'<td style="padding:1px 0">{html.escape(v)}</td></tr>' for k, v in rows
    )
    return f'<table style="border-collapse:collapse;font-size:12px">{cells}</table>'


def _header_html(s: Snapshot, title: str) -> str:
    gpu = html.escape(s.memory.gpu_name) if s.memory.gpu_name else "no CUDA GPU"
    phase = "" if s.phase == "training" or s.phase == "done" else f" &middot; {html.escape(s.phase)}"
    if s.phase == "evaluating":
        phase += f" {s.eval_step}/{s.eval_total if s.eval_total is not None else '?'}"
    return (f'<div style="font-weight:600">{html.escape(title)}{phase} '
            f'<span style="opacity:.7">&middot; {gpu}</span></div>')


def panel_html(s: Snapshot, final: bool = False) -> str:
    """The whole dashboard as one self-contained HTML fragment (inline styles and SVG only): html mode's live
    output, the widget output's fallback, and (``final=True``) the end-of-run summary."""
    title = "nbkit · training finished" if final else "nbkit · training"
    progress_pct = 100.0 * s.step / s.max_steps if s.max_steps > 0 else 0.0
    return (
        '<div style="font-family:system-ui,sans-serif;font-size:12px;line-height:1.45;max-width:720px">'
        + _header_html(s, title)
        # progress is not a fill level: one colour, not green-to-red
        + f"<div>{_bar_html(progress_pct, color='#1f77b4')} {html.escape(_progress_text(s))}</div>"
        + '<div style="display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start;margin-top:4px">'
        + f"<div>{_table_html(_stats_rows(s, final))}</div><div>{loss_chart_svg(s.history)}</div></div>"
        + f"<div>{_bar_html(s.vram_percent, s.allocated_percent)} {html.escape(_vram_text(s))}</div>"
        + f"<div>{html.escape(_ram_text(s))}</div>"
        + "</div>"
    )


# ---------------------------------------------------------------------------------------------------------------
# Views: one per mode, each show() once, update() many times, finish() once


class TextView:
    """A terminal line rewritten with \\r (cut to the terminal width so it never wraps), or, when the stream is
    not a terminal, one full line every ``interval`` seconds."""

    def __init__(self, stream: Optional[TextIO] = None, interval: float = 30.0) -> None:
        self._stream = stream
        self.interval = interval
        self._last_len = 0
        self._last_time: Optional[float] = None
        self._written = False

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _isatty(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except Exception:
            return False

    def show(self, s: Snapshot) -> None:
        self.update(s, force=True)

    def update(self, s: Snapshot, force: bool = False) -> None:
        line = text_line(s)
        if self._isatty():
            width = max(20, shutil.get_terminal_size((120, 24)).columns - 1)
            line = line[:width]
            self.stream.write("\r" + line + " " * max(0, self._last_len - len(line)))
            self._last_len = len(line)
        elif force or self._last_time is None or s.now - self._last_time >= self.interval:
            self.stream.write(line + "\n")
            self._last_time = s.now
        else:
            return
        self._written = True
        self.stream.flush()

    def finish(self, s: Snapshot) -> None:
        if self._isatty() and self._written:
            self.update(s)  # the line ends on the final numbers
            self.stream.write("\n")
        self.stream.write(summary_text(s) + "\n")
        self.stream.flush()


class HtmlView:
    """One display output rewritten through its display id; the summary replaces it at the end."""

    def __init__(self) -> None:
        self._handle: Any = None

    def show(self, s: Snapshot) -> None:
        from IPython.display import HTML, display

        self._handle = display(HTML(panel_html(s)), display_id=True)

    def update(self, s: Snapshot) -> None:
        if self._handle is not None:
            from IPython.display import HTML

            self._handle.update(HTML(panel_html(s)))

    def finish(self, s: Snapshot) -> None:
        from IPython.display import HTML, display

        if self._handle is not None:
            self._handle.update(HTML(panel_html(s, final=True)))
        else:
            display(HTML(panel_html(s, final=True)))


class _WidgetWithFallback:
    """Displays a widget and, for frontends without the widget manager, a text/html rendering of it."""

    def __init__(self, widget: Any, fallback_html: str) -> None:
        self.widget = widget
        self.fallback_html = fallback_html

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        data, meta = bundle if isinstance(bundle, tuple) else (bundle, None)
        data = dict(data)
        data["text/html"] = self.fallback_html
        return (data, meta) if meta is not None else data


class WidgetView:
    """One ipywidgets panel (HTML, IntProgress, FloatProgress, HBox, VBox) whose values are set in place; widget
    traits send only changed values. At the end its output is replaced by the static summary and it is closed."""

    def __init__(self) -> None:
        import ipywidgets as w

        self.header = w.HTML()
        self.bar = w.IntProgress(min=0, max=1, value=0, layout=w.Layout(width="320px"))
        self.progress = w.HTML()
        self.stats = w.HTML()
        self.chart = w.HTML()
        self.vram_bar = w.FloatProgress(min=0.0, max=100.0, value=0.0, layout=w.Layout(width="320px"))
        self.vram = w.HTML()
        self.ram = w.HTML()
        self.panel = w.VBox([
            self.header,
            w.HBox([self.bar, self.progress]),
            w.HBox([self.stats, self.chart], layout=w.Layout(align_items="flex-start")),
            w.HBox([self.vram_bar, self.vram]),
            self.ram,
        ])
        self._handle: Any = None

    def show(self, s: Snapshot) -> None:
        from IPython.display import display

        self.update(s)
        self._handle = display(_WidgetWithFallback(self.panel, panel_html(s)), display_id=True)

    def update(self, s: Snapshot) -> None:
        self.header.value = _header_html(s, "nbkit · training")
        self.bar.max = max(1, s.max_steps)
        self.bar.value = min(s.step, self.bar.max)
        self.progress.value = html.escape(_progress_text(s))
        self.stats.value = _table_html(_stats_rows(s, final=False))
        self.chart.value = loss_chart_svg(s.history)
        pct = s.vram_percent
        self.vram_bar.value = 0.0 if pct is None else min(100.0, pct)
        self.vram_bar.bar_style = "" if pct is None else "success" if pct < 80 else "warning" if pct < 95 else "danger"
        self.vram.value = html.escape(_vram_text(s))
        self.ram.value = html.escape(_ram_text(s))

    def finish(self, s: Snapshot) -> None:
        from IPython.display import HTML, display

        self.update(s)
        if self._handle is not None:
            self._handle.update(HTML(panel_html(s, final=True)))
        else:
            display(HTML(panel_html(s, final=True)))
        self.panel.close()


def make_view(mode: str, stream: Optional[TextIO] = None, text_interval: float = 30.0) -> Any:
    """The view for a concrete mode ("widget", "html" or "text")."""
    if mode == "widget":
        return WidgetView()
    if mode == "html":
        return HtmlView()
    if mode == "text":
        return TextView(stream, text_interval)
    raise ValueError(f"no view for mode {mode!r}")


# ---------------------------------------------------------------------------------------------------------------
# The callback


def _progress_callback_types() -> tuple[type, ...]:
    """transformers' progress displays: the tqdm bar and, when IPython imports, the notebook table."""
    from transformers.trainer_callback import ProgressCallback

    types: list[type] = [ProgressCallback]
    try:
        from transformers.utils.notebook import NotebookProgressCallback

        types.append(NotebookProgressCallback)
    except Exception:
        pass
    return tuple(types)


class LiveDashboard(TrainerCallback):
    """A ``TrainerCallback`` that shows a live, throttled dashboard of the run (see the module docstring).

    Args:
        mode: "auto", "widget", "html" or "text".
        clock: seconds, monotonic; injected by tests.
        memory_reader: a zero-argument callable returning a ``MemoryReading``; default: CUDA numbers for the
            trainer's device (nothing on CPU) and host RAM.
        min_interval: least seconds between two renders.
        ema: smoothing factor of the loss EMA.
        rate_window: seconds over which "tokens/s now" is measured.
        stream: text mode's stream (default: ``sys.stdout`` at the time of writing).
        text_interval: seconds between lines in text mode when the stream is not a terminal.
    """

    def __init__(self, mode: str = "auto", *, clock: Callable[[], float] = time.monotonic,
                 memory_reader: Optional[Callable[[], MemoryReading]] = None, min_interval: float = 0.5,
                 ema: float = 0.9, rate_window: float = 5.0, stream: Optional[TextIO] = None,
                 text_interval: float = 30.0) -> None:
        if mode not in MODES:
            raise ValueError(f"dashboard mode {mode!r}: choose one of {MODES}")
        self.mode = mode
        self.clock = clock
        self.memory_reader = memory_reader
        self.min_interval = min_interval
        self.ema = ema
        self.rate_window = rate_window
        self.stream = stream
        self.text_interval = text_interval
        self.view: Any = None
        self.active_mode: Optional[str] = None
        self.renders = 0
        self.summary: Optional[Snapshot] = None
        self._tracker: Optional[RunTracker] = None
        self._reader: Optional[Callable[[], MemoryReading]] = None
        self._thread: Optional[int] = None
        self._last_render: Optional[float] = None
        self._lock = threading.Lock()
        self._trainer: Any = None
        self._displaced: list[tuple[int, TrainerCallback]] = []
        self._tokens_seen: dict[str, int] = {}
        self._warned = False

    # -- attaching to a trainer ------------------------------------------------------------------------------

    def attach(self, trainer: Any) -> "LiveDashboard":
        """Add this dashboard to ``trainer`` and take transformers' progress display out of its callback list
        (remembering where it was). Other ``LiveDashboard``s on the trainer are removed: one panel per run."""
        if self._trainer is not None and self._trainer is not trainer:
            self.detach()
        handler = trainer.callback_handler
        for cb in list(handler.callbacks):
            if isinstance(cb, LiveDashboard) and cb is not self:
                if cb._trainer is trainer:
                    cb.detach()
                else:
                    handler.callbacks.remove(cb)
        if self not in handler.callbacks:
            handler.add_callback(self)
        progress_types = _progress_callback_types()
        kept, displaced = [], []
        for i, cb in enumerate(handler.callbacks):
            (displaced if isinstance(cb, progress_types) else kept).append((i, cb))
        handler.callbacks[:] = [cb for _, cb in kept]
        self._displaced = displaced + self._displaced if self._trainer is trainer else displaced
        self._displaced.sort(key=lambda item: item[0])
        self._trainer = trainer
        return self

    def detach(self) -> None:
        """Remove this dashboard from its trainer and put the progress display back where it was."""
        trainer, self._trainer = self._trainer, None
        if trainer is None:
            return
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        for index, cb in self._displaced:
            callbacks.insert(min(index, len(callbacks)), cb)
        self._displaced = []

    @property
    def displaced(self) -> list[TrainerCallback]:
        """The progress callbacks this dashboard replaced on its trainer."""
        return [cb for _, cb in self._displaced]

    def _forward(self, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Outside a training run (a standalone evaluate/predict), the displaced progress display does the job."""
        for cb in self.displaced:
            getattr(cb, event)(args, state, control, **kwargs)

    # -- rendering -----------------------------------------------------------------------------------------

    def _on_training_thread(self) -> bool:
        return self._tracker is not None and threading.get_ident() == self._thread

    def snapshot(self) -> Optional[Snapshot]:
        """What the dashboard would show now (None before the first ``on_train_begin``)."""
        if self._tracker is None:
            return self.summary
        with self._lock:
            try:
                reading = self._reader() if self._reader is not None else MemoryReading()
            except Exception:  # noqa: BLE001 - a failed reading shows as unknown, it does not stop training
                reading = MemoryReading()
            return self._tracker.snapshot(self.clock(), reading)

    def _maybe_render(self, force: bool = False) -> None:
        if self.view is None or not self._on_training_thread():
            return
        now = self.clock()
        if not force and self._last_render is not None and now - self._last_render < self.min_interval:
            return
        self._last_render = now
        self.renders += 1
        self._guarded(self.view.show if self.renders == 1 else self.view.update, self.snapshot())

    def _guarded(self, action: Callable[[Snapshot], None], snap: Snapshot) -> None:
        """Run a view's action; if it fails, say so once and stop displaying. A dashboard never stops training."""
        try:
            action(snap)
        except Exception as exc:  # noqa: BLE001 - any display failure must stay out of the training loop
            self.view = None
            warnings.warn(f"nbkit LiveDashboard stopped displaying: {type(exc).__name__}: {exc}", stacklevel=3)

    # -- TrainerCallback events ------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self._thread = threading.get_ident()
        base = dict(self._tokens_seen)
        base["num_input_tokens_seen"] = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        trl_count = getattr(self._trainer, "_total_train_tokens", None)  # TRL's counter, when attached to it
        if isinstance(trl_count, int):
            base["num_tokens"] = trl_count
        self._tracker = RunTracker(self.clock(), state.global_step, state.max_steps, base, self.ema,
                                   self.rate_window)
        self._reader = self.memory_reader or default_memory_reader(getattr(args, "device", None))
        self.active_mode = resolve_mode(self.mode)
        self.view = make_view(self.active_mode, self.stream, self.text_interval)
        self.renders = 0
        self._last_render = None
        self.summary = None
        if self._trainer is None and self.active_mode != "text" and not self._warned:
            self._warned = True
            warnings.warn("LiveDashboard was added with add_callback, so transformers' progress display keeps "
                          "running beside it; use nbkit.dashboard.attach_dashboard(trainer) instead.", stacklevel=2)
        self._maybe_render(force=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self._tracker is None:
            return
        with self._lock:
            self._tracker.step_end(self.clock(), state.global_step, state.epoch, state.num_train_epochs)
        self._maybe_render()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._tracker is None:
            return self._forward("on_log", args, state, control, logs=logs, **kwargs)
        with self._lock:
            self._tracker.log(self.clock(), state.global_step, dict(logs or {}))
        self._maybe_render()

    def on_prediction_step(self, args, state, control, **kwargs):
        if self._tracker is None:
            return self._forward("on_prediction_step", args, state, control, **kwargs)
        with self._lock:
            tracker = self._tracker
            if tracker.phase != "evaluating":
                tracker.phase, tracker.eval_step = "evaluating", 0
                loader = kwargs.get("eval_dataloader")
                try:
                    tracker.eval_total = len(loader) if loader is not None else None
                except TypeError:
                    tracker.eval_total = None
            tracker.eval_step += 1
        self._maybe_render()

    def _end_evaluation(self) -> None:
        with self._lock:
            self._tracker.phase = "training"
        self._maybe_render(force=True)

    def on_evaluate(self, args, state, control, **kwargs):
        if self._tracker is None:
            return self._forward("on_evaluate", args, state, control, **kwargs)
        self._end_evaluation()

    def on_predict(self, args, state, control, **kwargs):
        if self._tracker is None:
            return self._forward("on_predict", args, state, control, **kwargs)
        self._end_evaluation()

    def on_train_end(self, args, state, control, **kwargs):
        if self._tracker is None:
            return
        tracker = self._tracker
        with self._lock:
            tracker.phase = "done"
            if tracker.tokens_key is not None and tracker.tokens is not None:
                self._tokens_seen[tracker.tokens_key] = tracker.tokens + tracker.tokens_base[tracker.tokens_key]
        snap = self.snapshot()
        view = self.view
        if view is not None and self._on_training_thread():
            if self.renders == 0:
                self.renders += 1
                self._guarded(view.show, snap)
            if self.view is not None:
                self._guarded(view.finish, snap)
        self.summary = snap
        self._tracker = None
        self.view = None


def attach_dashboard(trainer: Any, **kwargs: Any) -> LiveDashboard:
    """Create a ``LiveDashboard(**kwargs)`` and attach it to ``trainer`` (a TRL ``SFTTrainer`` or any
    ``transformers.Trainer``), replacing transformers' progress display while attached."""
    return LiveDashboard(**kwargs).attach(trainer)
