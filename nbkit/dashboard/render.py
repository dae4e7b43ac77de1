"""How a ``Snapshot`` reads: the text line, the printed summary, the HTML panel and its SVG loss chart. Pure
functions of a snapshot (no I/O, no widgets), so every view shows the same words and numbers. Byte counts go
through ``nbkit.memory.fmt_bytes``, with one GiB decimal (the panel is compact)."""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Optional

from ..memory import fmt_bytes
from .tracker import Snapshot

if TYPE_CHECKING:
    from ..distributed import RankMemory

GIB_DIGITS = 1


def _bytes(value: Optional[int]) -> str:
    return fmt_bytes(value, GIB_DIGITS)


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


def _fmt(value: Optional[float], spec: str) -> str:
    return "--" if value is None else format(value, spec)


def progress_text(s: Snapshot) -> str:
    """Steps, then epochs: as "epoch 2.00/3" when epochs bound the run, else as how much data has been seen (a
    ``max_steps`` run's epoch total is only what transformers rounds up to, not a goal)."""
    pct = f" {100 * s.step / s.max_steps:.0f}%" if s.max_steps > 0 else ""
    if s.epoch is None:
        epoch = ""
    elif s.epoch_bound:
        epoch = f" | epoch {s.epoch:.2f}/{_fmt(s.num_epochs, 'g')}"
    else:
        epoch = f" | {s.epoch:.2f} epochs of data"
    return f"step {s.step}/{s.max_steps}{pct}{epoch} | {fmt_duration(s.elapsed)} elapsed, ETA {fmt_duration(s.eta)}"


def _ranks_note(s: Snapshot) -> str:
    """Token counts reach the logs already summed over ranks: say so on a multi-process run."""
    return f", all {s.world_size} ranks" if s.world_size > 1 else ""


def vram_text(s: Snapshot) -> str:
    m = s.memory
    if m.total is None:
        return "VRAM -- (not on CUDA)"
    return (f"VRAM {_bytes(m.allocated)} alloc, {_bytes(m.reserved)} reserved, peak {_bytes(m.peak)} "
            f"of {_bytes(m.total)} ({_fmt(s.vram_percent, '.0f')}%)")


def ram_text(s: Snapshot) -> str:
    m = s.memory
    return f"RAM {_bytes(m.host_used)} of {_bytes(m.host_total)}"


def rank_text(r: RankMemory) -> str:
    """One rank's memory: VRAM allocated / reserved / peak of total on CUDA, its process's resident set always."""
    rss = f"RSS {_bytes(r.host_rss)}"
    if r.allocated is None:
        return f"rank {r.rank}: no CUDA, {rss}"
    return (f"rank {r.rank}: VRAM {_bytes(r.allocated)} alloc, {_bytes(r.reserved)} reserved, "
            f"peak {_bytes(r.peak)} of {_bytes(r.total)}, {rss}")


def _ranks_line_part(s: Snapshot) -> Optional[str]:
    """The text line's per-rank part: allocated/peak VRAM per rank (resident set on CPU ranks)."""
    if not s.ranks:
        return f"{s.world_size} ranks (memory at the first log)" if s.world_size > 1 else None
    if any(r.allocated is not None for r in s.ranks):
        return "VRAM alloc/peak " + " ".join(f"r{r.rank} {_bytes(r.allocated)}/{_bytes(r.peak)}" for r in s.ranks)
    return "RSS " + " ".join(f"r{r.rank} {_bytes(r.host_rss)}" for r in s.ranks)


def text_line(s: Snapshot) -> str:
    """The one-line readout of text mode, and the text/plain form of the live HTML outputs."""
    parts = [
        f"[nbkit] {progress_text(s)}",
        f"{fmt_count(s.tokens_per_s)} tok/s (mean {fmt_count(s.tokens_per_s_mean)}{_ranks_note(s)})",
        f"loss {_fmt(s.loss, '.4f')} (ema {_fmt(s.loss_ema, '.4f')})",
        f"lr {_fmt(s.learning_rate, '.2e')}",
    ]
    if s.phase == "evaluating":
        parts.append(f"eval {s.eval_step}/{s.eval_total if s.eval_total is not None else '?'}")
    ranks = _ranks_line_part(s)
    m = s.memory
    if ranks is not None:
        parts.append(ranks)
    elif m.total is not None:
        parts.append(f"VRAM {_bytes(m.reserved)}/{_bytes(m.total)} {_fmt(s.vram_percent, '.0f')}% "
                     f"peak {_bytes(m.peak)}")
    if m.host_total is not None:
        parts.append(f"RAM {_bytes(m.host_used)}/{_bytes(m.host_total)}")
    return " | ".join(parts)


def summary_text(s: Snapshot) -> str:
    """The printed end-of-run summary of text mode, and the text/plain form of the final HTML summary."""
    lines = [
        f"[nbkit] training finished: {s.step}/{s.max_steps} steps in {fmt_duration(s.elapsed)}",
        f"  tokens: {fmt_count(s.tokens)} at {fmt_count(s.tokens_per_s_mean)} tok/s mean{_ranks_note(s)}",
        f"  loss: last {_fmt(s.loss, '.4f')}, smoothed {_fmt(s.loss_ema, '.4f')}, "
        f"run mean {_fmt(s.train_loss, '.4f')}" + (f", eval {s.eval_loss:.4f}" if s.eval_loss is not None else ""),
        f"  {vram_text(s)}",
        f"  {ram_text(s)}",
    ]
    lines += [f"  {rank_text(r)}" for r in s.ranks]
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


def bar_html(percent: Optional[float], inner_percent: Optional[float] = None, width: int = 320,
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


def stats_rows(s: Snapshot, final: bool) -> list[tuple[str, str]]:
    rows = [
        ("tokens/s", f"{fmt_count(s.tokens_per_s)} now, {fmt_count(s.tokens_per_s_mean)} mean"
                     + (f" ({fmt_count(s.tokens)} tokens)" if s.tokens is not None else "") + _ranks_note(s)),
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


def table_html(rows: list[tuple[str, str]]) -> str:
    cells = "".join(
        f'<tr><td style="padding:1px 12px 1px 0;opacity:.75">{html.escape(k)}</td>'
        f'<td style="padding:1px 0">{html.escape(v)}</td></tr>' for k, v in rows
    )
    return f'<table style="border-collapse:collapse;font-size:12px">{cells}</table>'


def ranks_html(s: Snapshot) -> str:
    """Every rank's memory, one row each with a bar of its peak against its GPU (empty for one process)."""
    if s.world_size <= 1 and not s.ranks:
        return ""
    if not s.ranks:
        return f"<div>{s.world_size} ranks: their memory appears at the first log</div>"
    rows = []
    for r in s.ranks:
        pct = 100.0 * r.peak / r.total if r.total and r.peak is not None else None
        bar = bar_html(pct, width=120) + " " if r.allocated is not None else ""
        rows.append(f"<div>{bar}{html.escape(rank_text(r))}</div>")
    return f'<div style="margin-top:2px">{"".join(rows)}</div>'


def header_html(s: Snapshot, title: str) -> str:
    gpu = html.escape(s.memory.gpu_name) if s.memory.gpu_name else "no CUDA GPU"
    if s.world_size > 1:
        gpu += f" &middot; {s.world_size} ranks"
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
        + header_html(s, title)
        # progress is not a fill level: one colour, not green-to-red
        + f"<div>{bar_html(progress_pct, color='#1f77b4')} {html.escape(progress_text(s))}</div>"
        + '<div style="display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start;margin-top:4px">'
        + f"<div>{table_html(stats_rows(s, final))}</div><div>{loss_chart_svg(s.history)}</div></div>"
        + f"<div>{bar_html(s.vram_percent, s.allocated_percent)} {html.escape(vram_text(s))}</div>"
        + ranks_html(s)
        + f"<div>{html.escape(ram_text(s))}</div>"
        + "</div>"
    )
