"""The dashboard's three views, one per mode. Each is driven the same way: ``show`` once, ``update`` many times,
``finish`` once; ``due(now)`` says whether an update would show anything, so the callback reads memory and builds
a snapshot only when it would. Every notebook output carries a ``text/plain`` form (the text line, or the summary
at the end) beside its HTML, so text-only viewers of a notebook read the numbers too."""

from __future__ import annotations

import html
import shutil
import sys
from typing import Any, Optional, TextIO

from .render import (
    header_html,
    loss_chart_svg,
    panel_html,
    progress_text,
    ram_text,
    ranks_html,
    stats_rows,
    summary_text,
    table_html,
    text_line,
    vram_text,
)
from .tracker import Snapshot


class Rendering:
    """One display output's content: HTML for rich frontends and plain text for the rest."""

    def __init__(self, html_text: str, plain: str) -> None:
        self.html = html_text
        self.plain = plain

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/html": self.html, "text/plain": self.plain}

    def __repr__(self) -> str:
        return self.plain


def live_rendering(s: Snapshot) -> Rendering:
    return Rendering(panel_html(s), text_line(s))


def final_rendering(s: Snapshot) -> Rendering:
    return Rendering(panel_html(s, final=True), summary_text(s))


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

    def due(self, now: float) -> bool:
        """A terminal line is rewritten at every render; a log file gets a line only every ``interval``."""
        return self._isatty() or self._last_time is None or now - self._last_time >= self.interval

    def show(self, s: Snapshot) -> None:
        self.update(s, force=True)

    def update(self, s: Snapshot, force: bool = False) -> None:
        line = text_line(s)
        if self._isatty():
            width = max(20, shutil.get_terminal_size((120, 24)).columns - 1)
            line = line[:width]
            self.stream.write("\r" + line + " " * max(0, self._last_len - len(line)))
            self._last_len = len(line)
        elif force or self.due(s.now):
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

    def due(self, now: float) -> bool:
        return True

    def show(self, s: Snapshot) -> None:
        from IPython.display import display

        self._handle = display(live_rendering(s), display_id=True)

    def update(self, s: Snapshot) -> None:
        if self._handle is not None:
            self._handle.update(live_rendering(s))

    def finish(self, s: Snapshot) -> None:
        from IPython.display import display

        if self._handle is not None:
            self._handle.update(final_rendering(s))
        else:
            display(final_rendering(s))


class WidgetWithFallback:
    """Displays a widget and, for frontends without the widget manager, a text/html and a text/plain rendering.

    The widget's part of the output is taken when this is made (``nbkit.compat.widget_mimebundle``, the same on
    ipywidgets 7 and 8), so that a widget which cannot be shown fails in the view's ``show``, where the dashboard
    turns to its HTML view, and not inside IPython's formatter, which would print the error and show a repr."""

    def __init__(self, widget: Any, fallback: Rendering) -> None:
        from ..compat import widget_mimebundle  # here, not at import: nbkit.compat imports torch

        self.widget = widget
        self.fallback = fallback
        self._bundle = widget_mimebundle(widget)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        data, meta = self._bundle if isinstance(self._bundle, tuple) else (self._bundle, None)
        data = {**dict(data), **self.fallback._repr_mimebundle_()}
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
        self.ranks = w.HTML()
        self.ram = w.HTML()
        self.panel = w.VBox([
            self.header,
            w.HBox([self.bar, self.progress]),
            w.HBox([self.stats, self.chart], layout=w.Layout(align_items="flex-start")),
            w.HBox([self.vram_bar, self.vram]),
            self.ranks,
            self.ram,
        ])
        self._handle: Any = None

    def due(self, now: float) -> bool:
        return True

    def show(self, s: Snapshot) -> None:
        from IPython.display import display

        self.update(s)
        self._handle = display(WidgetWithFallback(self.panel, live_rendering(s)), display_id=True)

    def update(self, s: Snapshot) -> None:
        self.header.value = header_html(s, "nbkit · training")
        self.bar.max = max(1, s.max_steps)
        self.bar.value = min(s.step, self.bar.max)
        self.progress.value = html.escape(progress_text(s))
        self.stats.value = table_html(stats_rows(s, final=False))
        self.chart.value = loss_chart_svg(s.history)
        pct = s.vram_percent
        self.vram_bar.value = 0.0 if pct is None else min(100.0, pct)
        self.vram_bar.bar_style = "" if pct is None else "success" if pct < 80 else "warning" if pct < 95 else "danger"
        self.vram.value = html.escape(vram_text(s))
        self.ranks.value = ranks_html(s)
        self.ram.value = html.escape(ram_text(s))

    def finish(self, s: Snapshot) -> None:
        from IPython.display import display

        self.update(s)
        if self._handle is not None:
            self._handle.update(final_rendering(s))
        else:
            display(final_rendering(s))
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
