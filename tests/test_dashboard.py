"""Tests for nbkit.dashboard on its own: throttling, the mode fallback chain, bounded output, the numbers shown, the
text/plain form of notebook outputs, steps versus epochs, and what a step costs. Its fakes are shared by
test_dashboard_attach.py (on a trainer, several ranks) and test_dashboard_runs.py (real runs, a real kernel)."""

from __future__ import annotations

import io
import sys
import threading
import types

import pytest
import torch
from dashboard_fakes import FakeKernel
from transformers import TrainerControl, TrainerState

from nbkit import dashboard as dash
from nbkit import memory
from nbkit.dashboard import LiveDashboard, MemoryReading, in_notebook, resolve_mode, views

GIB = 2**30
pytestmark = [pytest.mark.filterwarnings("ignore:LiveDashboard was added with add_callback"),
              pytest.mark.usefixtures("no_env_mode")]


# ---------------------------------------------------------------------------------------------------------------
# fakes


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class TtyIO(io.StringIO):
    def isatty(self) -> bool:
        return True


ARGS = types.SimpleNamespace(device=torch.device("cpu"), eval_strategy="no")


def fixed_memory(allocated=10 * GIB, reserved=20 * GIB, peak=30 * GIB, total=80 * GIB, name="Fake GPU"):
    reading = MemoryReading(gpu_name=name, allocated=allocated, reserved=reserved, peak=peak, total=total,
                            host_used=5 * GIB, host_total=16 * GIB)
    return lambda: reading


def begin(d: LiveDashboard, max_steps: int, step: int = 0) -> TrainerState:
    state = TrainerState(max_steps=max_steps, num_train_epochs=1)
    state.global_step = step
    state.epoch = 0.0
    d.on_train_begin(ARGS, state, TrainerControl())
    return state


def step(d: LiveDashboard, state: TrainerState, clock: FakeClock, dt: float, logs: dict | None = None) -> None:
    """One optimizer step as Trainer reports it: on_step_end, then on_log when it logs."""
    clock.advance(dt)
    state.global_step += 1
    state.epoch = state.global_step / state.max_steps
    d.on_step_end(ARGS, state, TrainerControl())
    if logs is not None:
        d.on_log(ARGS, state, TrainerControl(), logs=logs)


def run(d: LiveDashboard, clock: FakeClock, n: int, dt: float, tokens_per_step: int = 100) -> TrainerState:
    state = begin(d, n)
    for i in range(1, n + 1):
        step(d, state, clock, dt, {"loss": 5.0 / i, "learning_rate": 1e-4, "num_tokens": float(i * tokens_per_step)})
    d.on_train_end(ARGS, state, TrainerControl())
    return state


# ---------------------------------------------------------------------------------------------------------------
# throttling


def test_renders_at_most_every_min_interval_and_batches_data(fake_display):
    clock = FakeClock()
    d = LiveDashboard(mode="html", clock=clock, memory_reader=fixed_memory(), min_interval=0.5)
    state = begin(d, 16)
    assert len(fake_display.calls) == 1  # shown once at train begin
    handle = fake_display.handles[0]
    for i in range(1, 17):  # 0.125 s per step: renders due at 0.5, 1.0, 1.5, 2.0 s
        step(d, state, clock, 0.125, {"loss": float(i), "num_tokens": float(100 * i)})
    assert len(handle.updates) == 4
    assert d.renders == 5
    # the render at 0.5 s happened on step 4's on_step_end: step 4 shown, its loss not yet (it is logged after)
    first = handle.updates[0].html
    assert "step 4/16" in first and "4.0000 last" not in first and "3.0000 last" in first
    # nothing logged in between renders is lost: the summary has every loss
    d.on_train_end(ARGS, state, TrainerControl())
    assert len(handle.updates) == 5 and "training finished" in handle.updates[-1].html
    assert [h[1] for h in d.summary.history] == [float(i) for i in range(1, 17)]
    assert len(fake_display.calls) == 1


def test_no_render_while_clock_stands_still(fake_display):
    clock = FakeClock()
    d = LiveDashboard(mode="html", clock=clock, memory_reader=fixed_memory())
    state = begin(d, 1000)
    for _ in range(1000):
        step(d, state, clock, 0.0, {"loss": 1.0})
    assert d.renders == 1 and fake_display.handles[0].updates == []


def test_renders_only_from_the_training_thread(fake_display):
    clock = FakeClock()
    d = LiveDashboard(mode="html", clock=clock, memory_reader=fixed_memory())
    state = begin(d, 10)

    def other_thread():
        clock.advance(5.0)
        state.global_step = 3
        d.on_step_end(ARGS, state, TrainerControl())
        d.on_log(ARGS, state, TrainerControl(), logs={"loss": 2.0})

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert d.renders == 1 and fake_display.handles[0].updates == []
    # the data it brought is kept and shown by the training thread's next render
    step(d, state, clock, 1.0)
    assert d.renders == 2 and "2.0000 last" in fake_display.handles[0].updates[-1].html


# ---------------------------------------------------------------------------------------------------------------
# the fallback chain


def _shell(kernel: bool, config: dict | None = None):
    return types.SimpleNamespace(kernel=FakeKernel() if kernel else None, config=config or {})


@pytest.mark.parametrize(
    "ipython, widgets, expected",
    [
        ("absent", True, "text"),
        ("no-shell", True, "text"),
        ("terminal", True, "text"),
        ("kernel", True, "widget"),
        ("kernel", False, "html"),
        ("kernel-config", True, "widget"),  # a kernel shell seen only through its config (as transformers checks)
    ],
)
def test_auto_mode_fallback_chain(monkeypatch, ipython, widgets, expected):
    if ipython == "absent":
        monkeypatch.setitem(sys.modules, "IPython", None)
    else:
        import IPython

        shell = {
            "no-shell": None,
            "terminal": _shell(False, {"TerminalIPythonApp": {}}),
            "kernel": _shell(True),
            "kernel-config": _shell(False, {"IPKernelApp": {}}),
        }[ipython]
        monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    if not widgets:
        monkeypatch.setitem(sys.modules, "ipywidgets", None)  # makes `import ipywidgets` raise ImportError
    assert in_notebook() is (expected != "text")
    assert resolve_mode("auto") == expected


@pytest.mark.parametrize("mode, view", [("widget", dash.WidgetView), ("html", dash.HtmlView), ("text", dash.TextView)])
def test_explicit_mode_wins_and_builds_its_view(monkeypatch, fake_display, mode, view):
    assert resolve_mode(mode) == mode
    d = LiveDashboard(mode=mode, clock=FakeClock(), memory_reader=fixed_memory(), stream=io.StringIO())
    begin(d, 5)
    assert d.active_mode == mode and isinstance(d.view, view)


def test_env_var_sets_auto_mode_and_bad_modes_fail(monkeypatch):
    monkeypatch.setenv(dash.ENV_MODE, "html")
    assert resolve_mode("auto") == "html"
    assert resolve_mode("text") == "text"
    monkeypatch.setenv(dash.ENV_MODE, "fancy")
    with pytest.raises(ValueError):
        resolve_mode("auto")
    with pytest.raises(ValueError):
        LiveDashboard(mode="fancy")


def test_auto_dashboard_outside_a_notebook_is_text(monkeypatch):
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    out = io.StringIO()
    d = LiveDashboard(clock=FakeClock(), memory_reader=fixed_memory(), stream=out)
    begin(d, 5)
    assert d.active_mode == "text" and out.getvalue().startswith("[nbkit] step 0/5")


# ---------------------------------------------------------------------------------------------------------------
# bounded output


def test_text_mode_not_a_tty_writes_one_line_per_interval(fake_display):
    clock = FakeClock()
    out = io.StringIO()
    d = LiveDashboard(mode="text", clock=clock, memory_reader=fixed_memory(), stream=out, text_interval=2.0)
    run(d, clock, 1000, 1 / 128)  # 7.8 s: lines at 0, 2, 4 and 6 s, then the summary
    lines = out.getvalue().splitlines()
    live = [ln for ln in lines if ln.startswith("[nbkit] step")]
    assert len(live) == 4
    assert lines[len(live)].startswith("[nbkit] training finished: 1000/1000 steps")
    assert len(lines) == len(live) + len(dash.summary_text(d.summary).splitlines())
    assert fake_display.calls == []


def test_text_mode_on_a_tty_rewrites_one_line(monkeypatch):
    monkeypatch.setattr(views.shutil, "get_terminal_size", lambda fallback=None: types.SimpleNamespace(columns=81))
    clock = FakeClock()
    out = TtyIO()
    d = LiveDashboard(mode="text", clock=clock, memory_reader=fixed_memory(), stream=out)
    run(d, clock, 1000, 0.01)
    text = out.getvalue()
    live, _, summary = text.partition("\n")
    assert summary.startswith("[nbkit] training finished")
    frames = live.split("\r")[1:]
    assert len(frames) == d.renders + 1 <= 1 + 10 / 0.5 + 2  # throttled renders, then the final numbers
    assert all(len(f) <= 80 for f in frames)  # cut to the terminal width: never wraps
    assert frames[-1].rstrip().startswith("[nbkit] step 1000/1000")


def test_html_mode_displays_once_and_updates_in_place(fake_display):
    clock = FakeClock()
    d = LiveDashboard(mode="html", clock=clock, memory_reader=fixed_memory())
    run(d, clock, 1000, 0.01)
    assert len(fake_display.calls) == 1
    updates = fake_display.handles[0].updates
    assert 1 <= len(updates) <= 10 / 0.5 + 2
    assert len(d.summary.history) <= 513  # decimated, not growing with the steps
    assert max(len(u.html) for u in updates) < 40_000
    assert d.summary.history[-1][0] == 1000 and d.summary.history[0][0] == 1


def test_widget_mode_one_panel_values_in_place_then_summary(fake_display):
    clock = FakeClock()
    d = LiveDashboard(mode="widget", clock=clock, memory_reader=fixed_memory())
    state = begin(d, 1000)
    view = d.view
    assert len(fake_display.calls) == 1
    bundle = fake_display.calls[0]._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "<svg" in bundle["text/html"]
    n_children = len(view.panel.children)
    for i in range(1, 1001):
        step(d, state, clock, 0.01, {"loss": 1.0 + 1 / i, "num_tokens": float(50 * i), "learning_rate": 2e-4})
        if i == 500:
            assert 450 <= view.bar.value <= 500  # at most 0.5 s (50 steps) behind
    assert len(fake_display.calls) == 1 and len(view.panel.children) == n_children
    assert view.bar.max == 1000 and view.bar.value >= 950
    assert view.vram_bar.value == pytest.approx(25.0) and view.vram_bar.bar_style == "success"
    assert "Fake GPU" in view.header.value and "<polyline" in view.chart.value
    d.on_train_end(ARGS, state, TrainerControl())
    assert view.bar.value == 1000
    final = fake_display.handles[0].updates
    assert len(final) == 1 and "training finished" in final[0].html  # the output now holds the static summary
    assert view.panel.comm is None  # closed


# ---------------------------------------------------------------------------------------------------------------
# the numbers


def test_tokens_per_second_eta_and_smoothed_loss():
    clock = FakeClock(t=50.0)
    d = LiveDashboard(mode="text", clock=clock, memory_reader=fixed_memory(), rate_window=0.0, ema=0.8,
                      stream=io.StringIO())
    state = begin(d, 20)
    losses = [4.0, 3.5, 3.2, 2.0, 2.5]
    step(d, state, clock, 2.0, {"loss": losses[0], "num_tokens": 100.0})  # slow first step (warm-up)
    for i in range(2, 6):
        step(d, state, clock, 0.25, {"loss": losses[i - 1], "num_tokens": 100.0 * i, "learning_rate": 3e-4})
    s = d.snapshot()
    assert s.step == 5 and s.tokens == 500
    assert s.tokens_per_s == pytest.approx(100 / 0.25)  # last interval
    assert s.tokens_per_s_mean == pytest.approx(500 / 3.0)  # all tokens over the whole run
    assert s.eta == pytest.approx(15 * 0.25)  # first step left out of the step time
    assert s.elapsed == pytest.approx(3.0)
    weights = [0.2 * 0.8 ** (len(losses) - 1 - k) for k in range(len(losses))]
    assert s.loss_ema == pytest.approx(sum(w * x for w, x in zip(weights, losses)) / sum(weights))
    assert s.loss == 2.5 and s.learning_rate == 3e-4
    # the rate changes: "now" follows at once, the mean slowly
    step(d, state, clock, 0.25, {"loss": 2.0, "num_tokens": 700.0})
    s = d.snapshot()
    assert s.tokens_per_s == pytest.approx(200 / 0.25) and s.tokens_per_s_mean == pytest.approx(700 / 3.25)
    line = dash.text_line(s)
    assert "800 tok/s (mean 215)" in line and "ETA 00:04" in line


def test_rate_window_averages_recent_logs():
    clock = FakeClock()
    d = LiveDashboard(mode="text", clock=clock, memory_reader=fixed_memory(), rate_window=1.0, stream=io.StringIO())
    state = begin(d, 100)
    total = 0
    for i in range(20):
        total += 100 if i < 12 else 300  # 400 tok/s, then 1200 tok/s
        step(d, state, clock, 0.25, {"num_tokens": float(total)})
    s = d.snapshot()
    # window: the newest log at least 1 s old (4 logs back) -> 4 intervals, all at the new rate
    assert s.tokens_per_s == pytest.approx(1200.0)
    step(d, state, clock, 0.25, {"num_tokens": float(total + 100)})
    assert d.snapshot().tokens_per_s == pytest.approx((300 * 3 + 100) / 1.0)


def test_token_count_starts_from_what_the_counter_held_at_train_begin():
    clock = FakeClock()
    d = LiveDashboard(mode="text", clock=clock, memory_reader=fixed_memory(), stream=io.StringIO())
    state = begin(d, 4)
    for i in range(1, 5):
        step(d, state, clock, 1.0, {"num_tokens": 10.0 * i})
    d.on_train_end(ARGS, state, TrainerControl())
    assert d.summary.tokens == 40
    # a second train() on the same trainer: TRL's counter goes on from 40
    state = begin(d, 4)
    step(d, state, clock, 1.0, {"num_tokens": 50.0})
    s = d.snapshot()
    assert s.tokens == 10 and s.tokens_per_s_mean == pytest.approx(10.0)


def test_transformers_token_counter_is_used_when_trl_does_not_log_one():
    clock = FakeClock()
    d = LiveDashboard(mode="text", clock=clock, memory_reader=fixed_memory(), stream=io.StringIO())
    state = TrainerState(max_steps=10, num_train_epochs=1)
    state.global_step, state.num_input_tokens_seen = 5, 1000  # resumed run
    d.on_train_begin(ARGS, state, TrainerControl())
    step(d, state, clock, 2.0, {"loss": 1.0, "num_input_tokens_seen": 1600})
    assert d.snapshot().tokens == 600 and d.snapshot().tokens_per_s_mean == pytest.approx(300.0)


@pytest.mark.parametrize("reserved_gib, style", [(20, "success"), (72, "warning"), (78, "danger")])
def test_vram_numbers_and_bar(fake_display, reserved_gib, style):
    clock = FakeClock()
    d = LiveDashboard(mode="widget", clock=clock, memory_reader=fixed_memory(reserved=reserved_gib * GIB))
    begin(d, 10)
    s = d.snapshot()
    pct = 100 * reserved_gib / 80
    assert s.vram_percent == pytest.approx(pct) and s.allocated_percent == pytest.approx(12.5)
    assert d.view.vram_bar.value == pytest.approx(pct) and d.view.vram_bar.bar_style == style
    assert f"VRAM 10.0 GiB alloc, {reserved_gib:.1f} GiB reserved, peak 30.0 GiB of 80.0 GiB ({pct:.0f}%)" in (
        d.view.vram.value)
    html_panel = dash.panel_html(s)
    assert f"width:{pct:.1f}%" in html_panel and "width:12.5%" in html_panel
    assert f"VRAM {reserved_gib:.1f} GiB/80.0 GiB {pct:.0f}% peak 30.0 GiB" in dash.text_line(s)


def test_cpu_run_shows_no_vram_but_host_ram(monkeypatch):
    reading = dash.default_memory_reader(torch.device("cpu"))()
    assert reading.total is None and reading.allocated is None and reading.gpu_name is None
    assert reading.host_total and 0 < reading.host_used <= reading.host_total
    s = dash.RunTracker(0.0, 0, 10).snapshot(1.0, reading)
    assert s.vram_percent is None and "VRAM" not in dash.text_line(s) and "RAM " in dash.text_line(s)
    assert "not on CUDA" in dash.panel_html(s)
    monkeypatch.setitem(sys.modules, "psutil", None)  # the /proc fallback
    used, total = memory.host_memory()
    assert total == reading.host_total and 0 < used <= total


def test_formatting():
    assert dash.fmt_duration(3725) == "1:02:05" and dash.fmt_duration(65.4) == "01:05"
    assert dash.fmt_duration(None) == "--" and dash.fmt_duration(float("inf")) == "--"
    assert dash.fmt_count(2310) == "2.31k" and dash.fmt_count(12) == "12" and dash.fmt_count(1.5e6) == "1.5M"
    # bytes through nbkit.memory: one GiB decimal on the dashboard, two elsewhere
    assert memory.fmt_bytes(3 * GIB // 2, 1) == "1.5 GiB" and memory.fmt_bytes(3 * GIB // 2) == "1.50 GiB"
    assert memory.fmt_bytes(512 * 2**20, 1) == "512 MiB" and memory.fmt_bytes(None) == "--"


def test_loss_chart_is_static_svg_and_skips_bad_values():
    tracker = dash.RunTracker(0.0, 0, 10)
    for i, loss in enumerate([3.0, float("nan"), 2.0, float("inf"), 1.0], start=1):
        tracker.log(float(i), i, {"loss": loss})
    svg = dash.loss_chart_svg(tuple(tracker.history))
    assert len(tracker.history) == 3
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and "<script" not in svg and "nan" not in svg
    assert "loss appears" in dash.loss_chart_svg(())


def test_evaluation_during_training_is_shown(fake_display):
    clock = FakeClock()
    d = LiveDashboard(mode="html", clock=clock, memory_reader=fixed_memory())
    state = begin(d, 10)
    step(d, state, clock, 1.0, {"loss": 2.0})
    loader = [0, 1, 2]
    for _ in loader:
        clock.advance(1.0)
        d.on_prediction_step(ARGS, state, TrainerControl(), eval_dataloader=loader)
    assert "evaluating 3/3" in fake_display.handles[0].updates[-1].html
    d.on_log(ARGS, state, TrainerControl(), logs={"eval_loss": 1.25})
    d.on_evaluate(ARGS, state, TrainerControl(), metrics={"eval_loss": 1.25})
    last = fake_display.handles[0].updates[-1].html
    assert "evaluating" not in last and "1.2500" in last


# ---------------------------------------------------------------------------------------------------------------
# text-only viewers


def _formatted(obj) -> dict:
    """The mime bundle a kernel sends for ``obj`` (IPython's own formatter, as ``display`` uses it)."""
    from IPython.core.formatters import DisplayFormatter

    data, _ = DisplayFormatter().format(obj)
    return data


def test_html_outputs_carry_the_text_line_then_the_summary_as_text_plain(fake_display):
    clock = FakeClock()
    d = LiveDashboard(mode="html", clock=clock, memory_reader=fixed_memory())
    state = begin(d, 4)
    first = _formatted(fake_display.calls[0])
    assert first["text/plain"].startswith("[nbkit] step 0/4") and "nbkit · training" in first["text/html"]
    step(d, state, clock, 1.0, {"loss": 2.0, "num_tokens": 100.0})
    step(d, state, clock, 1.0)  # the render after the log shows its loss
    live = _formatted(fake_display.handles[0].updates[-1])
    assert live["text/plain"].startswith("[nbkit] step 2/4") and "loss 2.0000" in live["text/plain"]
    d.on_train_end(ARGS, state, TrainerControl())
    final = _formatted(fake_display.handles[0].updates[-1])
    assert final["text/plain"] == dash.summary_text(d.summary)
    assert final["text/plain"].startswith("[nbkit] training finished: 2/4 steps") and "finished" in final["text/html"]


def test_widget_output_carries_the_text_line_as_text_plain(fake_display):
    clock = FakeClock()
    d = LiveDashboard(mode="widget", clock=clock, memory_reader=fixed_memory())
    state = begin(d, 3)
    bundle = _formatted(fake_display.calls[0])
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"].startswith("[nbkit] step 0/3") and "VBox" not in bundle["text/plain"]
    step(d, state, clock, 1.0, {"loss": 1.5})
    d.on_train_end(ARGS, state, TrainerControl())
    final = _formatted(fake_display.handles[0].updates[-1])
    assert final["text/plain"].startswith("[nbkit] training finished: 1/3 steps")


# ---------------------------------------------------------------------------------------------------------------
# steps and epochs


def _at_epoch(max_steps_arg: int, step_no: int, epoch: float, max_steps: int, num_epochs: float) -> str:
    d = LiveDashboard(mode="text", clock=FakeClock(), memory_reader=fixed_memory(), stream=io.StringIO())
    args = types.SimpleNamespace(device=torch.device("cpu"), max_steps=max_steps_arg)
    state = TrainerState(max_steps=max_steps, num_train_epochs=num_epochs)
    d.on_train_begin(args, state, TrainerControl())
    state.global_step, state.epoch = step_no, epoch
    d.on_step_end(args, state, TrainerControl())
    s = d.snapshot()
    return dash.text_line(s) + "\n" + dash.panel_html(s)


def test_a_max_steps_run_shows_epochs_as_data_seen_not_as_a_total():
    # max_steps=100 over 35 steps per epoch: transformers sets num_train_epochs to 3, which is no goal of the run
    shown = _at_epoch(max_steps_arg=100, step_no=100, epoch=2.86, max_steps=100, num_epochs=3)
    assert "step 100/100 100% | 2.86 epochs of data" in shown
    assert "/3" not in shown and "epoch 2.86" not in shown


def test_an_epoch_bound_run_shows_the_epoch_of_its_total():
    shown = _at_epoch(max_steps_arg=-1, step_no=60, epoch=2.0, max_steps=90, num_epochs=3)
    assert "step 60/90 67% | epoch 2.00/3" in shown and "epochs of data" not in shown


# ---------------------------------------------------------------------------------------------------------------
# cost per step


class CountingReader:
    """A memory reader that counts its calls (each would be a few CUDA queries on a GPU)."""

    def __init__(self) -> None:
        self.calls = 0
        self.reading = fixed_memory()()

    def __call__(self) -> MemoryReading:
        self.calls += 1
        return self.reading


def test_text_mode_to_a_log_reads_memory_only_for_the_lines_it_writes():
    clock = FakeClock()
    out, reader = io.StringIO(), CountingReader()
    d = LiveDashboard(mode="text", clock=clock, memory_reader=reader, stream=out, text_interval=2.0)
    run(d, clock, 1000, 1 / 128)  # 7.8 s at min_interval 0.5: lines due at 0, 2, 4 and 6 s only
    live = [ln for ln in out.getvalue().splitlines() if ln.startswith("[nbkit] step")]
    assert len(live) == 4 and d.renders == 4
    assert reader.calls == len(live) + 1  # one reading per line written, one for the summary


def test_steps_between_renders_read_no_memory(fake_display):
    clock = FakeClock()
    reader = CountingReader()
    d = LiveDashboard(mode="html", clock=clock, memory_reader=reader)
    state = begin(d, 1000)
    for i in range(1, 1001):
        step(d, state, clock, 0.01, {"loss": 1.0, "num_tokens": float(10 * i)})
    assert 1 < d.renders <= 1 + 10 / 0.5 + 1
    assert reader.calls == d.renders  # 2000 events, one reading per render
    d.on_train_end(ARGS, state, TrainerControl())
    assert reader.calls == d.renders + 1 and len(fake_display.handles[0].updates) == d.renders
