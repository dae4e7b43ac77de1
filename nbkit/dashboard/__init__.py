"""``LiveDashboard``: one live, throttled readout of a training run for notebooks (and terminals).

What it shows: progress (step/total; epochs as "epoch 2.00/3" when epochs bound the run, as "2.86 epochs of data"
on a ``max_steps`` run), elapsed, ETA, tokens/s (now and mean, tokens as TRL counts them: the cumulative
``num_tokens`` that ``SFTTrainer.log`` adds to each log; plain ``Trainer`` runs use ``num_input_tokens_seen``;
both are already summed over ranks), loss (last and bias-corrected EMA) with a small SVG chart, learning rate,
VRAM (allocated, reserved, peak, total, with a bar; CUDA only), host RAM and the GPU name. On a multi-process
run, also every rank's memory (allocated / peak VRAM, resident set), gathered by ``nbkit.distributed``.

How it shows it, picked by ``mode`` (``mode.py``; ``views.py``):

- ``"widget"``: one ipywidgets panel (core widgets only; ipywidgets 7, as on Colab, or 8) whose values change in
  place; a panel that cannot be built or shown in this kernel gives way to the HTML view, with a warning;
- ``"html"``: one ``IPython.display`` output, rewritten through its display id;
- ``"text"``: one line rewritten with ``\\r`` on a terminal, or one line every ``text_interval`` seconds otherwise;
- ``"auto"`` (default; the env var ``NBKIT_DASHBOARD`` may name another): widget inside a notebook kernel when
  ipywidgets imports, else html inside a kernel, else text. A kernel cannot tell whether its frontend renders
  widgets, so the widget output also carries a ``text/html`` rendering that widget-less frontends show instead,
  and every notebook output carries ``text/plain`` (the text line, then the summary) for text-only viewers.

Contract: renders at most once per ``min_interval`` seconds and only when its view would show the result (data
arriving in between is kept and shown by the next render); between renders a step costs a clock read, never a
memory reading. It renders only on the thread that called ``on_train_begin`` and only on the world's main process.
Output never grows with the number of steps. At the end of a run the live output is replaced by a static HTML
summary (a printed summary in text mode) that renders anywhere, including saved notebooks and viewers without
widget support.

Usage with nbkit's ``FastSFT`` (it attaches itself in notebooks) or with a plain TRL ``SFTTrainer``::

    from nbkit.dashboard import attach_dashboard
    dashboard = attach_dashboard(trainer)   # adds the callback and takes over the progress display
    trainer.train()

``trainer.add_callback(LiveDashboard())`` works as well, but a callback never sees its trainer, so transformers'
own progress display (the notebook table or tqdm bar) then keeps running beside the dashboard, and a
multi-process run shows only rank 0's memory. ``attach`` removes the progress display from
``trainer.callback_handler`` and ``detach`` puts it back where it was; while attached, events outside a training
run (a standalone ``trainer.evaluate()``/``predict()``) are forwarded to it, so those keep their display.

Layout: ``tracker.py`` (memory readings, ``RunTracker`` -> ``Snapshot``), ``render.py`` (text line, summary, HTML
panel, SVG chart), ``views.py`` (the three views), ``callback.py`` (``LiveDashboard``). Importing this package
imports neither torch nor transformers; ``LiveDashboard`` and ``attach_dashboard`` load ``callback.py`` (and
transformers) on first use.
"""

from __future__ import annotations

from typing import Any

from .mode import ENV_MODE, MODES, in_notebook, resolve_mode
from .render import fmt_count, fmt_duration, loss_chart_svg, panel_html, summary_text, text_line
from .tracker import MemoryReading, RunTracker, Snapshot, default_memory_reader, read_memory
from .views import HtmlView, Rendering, TextView, WidgetView, make_view

__all__ = [
    "ENV_MODE", "MODES", "HtmlView", "LiveDashboard", "MemoryReading", "Rendering", "RunTracker", "Snapshot",
    "TextView", "WidgetView", "attach_dashboard", "default_memory_reader", "fmt_count", "fmt_duration",
    "in_notebook", "loss_chart_svg", "make_view", "panel_html", "read_memory", "resolve_mode", "summary_text",
    "text_line",
]

_LAZY = ("LiveDashboard", "attach_dashboard")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'nbkit.dashboard' has no attribute {name!r}")
