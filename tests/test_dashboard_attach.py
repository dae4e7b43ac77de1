"""Tests for nbkit.dashboard on a trainer: attaching (the progress display it replaces and restores), what it forwards
outside a run, failures that must not stop training, and what each rank does on a multi-process run (rank 0 shows
every rank's memory through the ``RankMemoryCallback`` that ``attach`` adds; other ranks show and forward nothing)."""

from __future__ import annotations

import types

import pytest
import torch
from test_dashboard import ARGS, GIB, FakeClock, begin, fixed_memory, step
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, ProgressCallback

from nbkit import dashboard as dash
from nbkit.dashboard import LiveDashboard, MemoryReading, attach_dashboard
from nbkit.distributed import RankMemory, RankMemoryCallback

pytestmark = pytest.mark.filterwarnings("ignore:LiveDashboard was added with add_callback")


# ---------------------------------------------------------------------------------------------------------------
# attaching to a trainer


class RecordingProgress(ProgressCallback):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def on_prediction_step(self, args, state, control, **kwargs):
        self.events.append("on_prediction_step")

    def on_evaluate(self, args, state, control, **kwargs):
        self.events.append("on_evaluate")

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append("on_log")


class Other(TrainerCallback):
    pass


def _fake_trainer(world_size: int | None = None):
    """A trainer as ``attach`` sees it: the callback list of a notebook run (and ``args.world_size`` when given)."""
    from transformers.utils.notebook import NotebookProgressCallback

    callbacks = [DefaultFlowCallback(), NotebookProgressCallback(), Other(), RecordingProgress()]
    handler = CallbackHandler(callbacks, model=None, processing_class=None, optimizer=None, lr_scheduler=None)
    trainer = types.SimpleNamespace(callback_handler=handler)
    if world_size is not None:
        trainer.args = types.SimpleNamespace(world_size=world_size)
    return trainer


def test_attach_replaces_progress_displays_and_detach_restores_them():
    trainer = _fake_trainer()
    before = list(trainer.callback_handler.callbacks)
    d = LiveDashboard(mode="text")
    assert d.attach(trainer) is d
    after = trainer.callback_handler.callbacks
    assert [type(c).__name__ for c in after] == ["DefaultFlowCallback", "Other", "LiveDashboard"]
    assert d.displaced == [before[1], before[3]]
    d.attach(trainer)  # idempotent
    assert after.count(d) == 1 and d.displaced == [before[1], before[3]]
    d.detach()
    assert trainer.callback_handler.callbacks == before


def test_a_second_dashboard_replaces_the_first():
    trainer = _fake_trainer()
    before = list(trainer.callback_handler.callbacks)
    first = attach_dashboard(trainer, mode="text")
    second = attach_dashboard(trainer, mode="text")
    callbacks = trainer.callback_handler.callbacks
    assert first not in callbacks and callbacks.count(second) == 1
    assert [type(c).__name__ for c in callbacks] == ["DefaultFlowCallback", "Other", "LiveDashboard"]
    second.detach()
    assert trainer.callback_handler.callbacks == before


def test_events_outside_training_go_to_the_displaced_progress_display(fake_display):
    trainer = _fake_trainer()
    recorder = trainer.callback_handler.callbacks[3]
    d = attach_dashboard(trainer, mode="html", clock=FakeClock(), memory_reader=fixed_memory())
    state = TrainerState()
    handler = trainer.callback_handler
    handler.on_prediction_step(ARGS, state, TrainerControl())
    handler.on_log(ARGS, state, TrainerControl(), logs={"eval_loss": 1.0})
    handler.on_evaluate(ARGS, state, TrainerControl(), metrics={"eval_loss": 1.0})
    assert recorder.events == ["on_prediction_step", "on_log", "on_evaluate"]
    # the notebook table, displaced, still shows a standalone evaluation's metrics (its one display call)
    assert len(fake_display.calls) == 1 and d.renders == 0
    # during training the dashboard handles them itself
    begin(d, 3)
    handler.on_prediction_step(ARGS, state, TrainerControl())
    assert recorder.events == ["on_prediction_step", "on_log", "on_evaluate"]


def test_add_callback_in_a_notebook_warns_about_the_remaining_table(fake_display):
    d = LiveDashboard(mode="html", clock=FakeClock(), memory_reader=fixed_memory())
    with pytest.warns(UserWarning, match="attach_dashboard"):
        begin(d, 3)


def test_a_failing_display_or_memory_reader_never_stops_training(monkeypatch, fake_display):
    clock = FakeClock()

    def broken_reader():
        raise RuntimeError("CUDA error: device lost")

    d = LiveDashboard(mode="html", clock=clock, memory_reader=broken_reader)
    state = begin(d, 10)
    assert d.snapshot().memory == MemoryReading()  # unknown, not an exception
    monkeypatch.setattr(dash.HtmlView, "update", lambda self, s: 1 / 0)
    with pytest.warns(UserWarning, match="stopped displaying: ZeroDivisionError"):
        step(d, state, clock, 1.0, {"loss": 1.0})
    assert d.view is None
    for _ in range(3):
        step(d, state, clock, 1.0, {"loss": 1.0})
    d.on_train_end(ARGS, state, TrainerControl())
    assert d.summary.step == 4


def test_only_the_main_process_shows_anything(fake_display):
    d = LiveDashboard(mode="html", clock=FakeClock(), memory_reader=fixed_memory())
    state = TrainerState(max_steps=3, is_world_process_zero=False)
    d.on_train_begin(ARGS, state, TrainerControl())
    state.global_step = 1
    d.on_step_end(ARGS, state, TrainerControl())
    d.on_train_end(ARGS, state, TrainerControl())
    assert fake_display.calls == [] and d.summary is None



# ---------------------------------------------------------------------------------------------------------------
# several processes


def _names(trainer) -> list[str]:
    return [type(c).__name__ for c in trainer.callback_handler.callbacks]


def test_attach_on_a_multi_process_run_adds_rank_memory_before_itself_and_detach_removes_it():
    trainer = _fake_trainer(world_size=2)
    before = list(trainer.callback_handler.callbacks)
    d = LiveDashboard(mode="text").attach(trainer)
    assert _names(trainer) == ["DefaultFlowCallback", "Other", "RankMemoryCallback", "LiveDashboard"]
    assert d.rank_memory is trainer.callback_handler.callbacks[2]
    d.attach(trainer)  # idempotent: still one gather per log
    assert _names(trainer).count("RankMemoryCallback") == 1
    d.detach()
    assert trainer.callback_handler.callbacks == before and d.rank_memory is None


def test_attach_uses_the_rank_memory_callback_already_on_the_trainer():
    trainer = _fake_trainer(world_size=4)
    mine = RankMemoryCallback()
    trainer.callback_handler.add_callback(mine)
    d = attach_dashboard(trainer, mode="text")
    assert d.rank_memory is mine and _names(trainer).count("RankMemoryCallback") == 1
    d.detach()
    assert mine in trainer.callback_handler.callbacks  # not the dashboard's to remove


@pytest.mark.parametrize("world_size, gather_ranks", [(None, True), (1, True), (2, False)])
def test_one_process_or_gather_ranks_off_adds_no_collective(world_size, gather_ranks):
    trainer = _fake_trainer(world_size=world_size)
    d = attach_dashboard(trainer, mode="text", gather_ranks=gather_ranks)
    assert d.rank_memory is None and "RankMemoryCallback" not in _names(trainer)


def test_a_log_gathers_rank_memory_before_the_dashboard_renders_it(fake_display):
    trainer = _fake_trainer(world_size=2)
    d = attach_dashboard(trainer, mode="html", clock=FakeClock(), memory_reader=fixed_memory(), min_interval=0.0)
    handler = trainer.callback_handler
    args = types.SimpleNamespace(device=torch.device("cpu"), world_size=2, eval_strategy="no")
    state = TrainerState(max_steps=4)
    handler.on_train_begin(args, state, TrainerControl())
    assert "2 ranks: their memory appears at the first log" in fake_display.calls[0].html
    handler.on_log(args, state, TrainerControl(), logs={"loss": 1.0})  # no process group: the local row only
    (row,) = d.rank_memory.latest
    assert row.rank == 0 and row.host_rss > 0
    assert dash.render.rank_text(row) in fake_display.handles[0].updates[-1].html  # that log's gather, shown


def test_rank_zero_shows_every_ranks_vram_and_the_jobs_tokens(fake_display):
    trainer = _fake_trainer(world_size=2)
    clock = FakeClock()
    d = attach_dashboard(trainer, mode="html", clock=clock, memory_reader=fixed_memory())
    rows = (RankMemory(0, allocated=10 * GIB, reserved=12 * GIB, peak=30 * GIB, total=80 * GIB, host_rss=3 * GIB),
            RankMemory(1, allocated=9 * GIB, reserved=11 * GIB, peak=28 * GIB, total=80 * GIB, host_rss=2 * GIB))
    d.rank_memory.latest = rows  # what the all-gather of the last log holds on every rank
    args = types.SimpleNamespace(device=torch.device("cpu"), world_size=2)
    state = TrainerState(max_steps=10)
    d.on_train_begin(args, state, TrainerControl())
    for i in (1, 2):  # TRL's num_tokens: both ranks' tokens (1000 each per step), summed before the log
        clock.advance(1.0)
        state.global_step = i
        d.on_step_end(args, state, TrainerControl())
        d.on_log(args, state, TrainerControl(), logs={"loss": 1.0, "num_tokens": 2000.0 * i})
    s = d.snapshot()
    assert s.world_size == 2 and s.ranks == rows
    assert s.tokens == 4000 and s.tokens_per_s == pytest.approx(2000.0)  # the job's rate, not doubled again
    line = dash.text_line(s)
    assert "2k tok/s (mean 2k, all 2 ranks)" in line
    assert "VRAM alloc/peak r0 10.0 GiB/30.0 GiB r1 9.0 GiB/28.0 GiB" in line
    panel = fake_display.handles[0].updates[-1].html
    assert "rank 1: VRAM 9.0 GiB alloc, 11.0 GiB reserved, peak 28.0 GiB of 80.0 GiB, RSS 2.0 GiB" in panel
    assert "2 ranks" in panel and "width:35.0%" in panel  # rank 1's peak bar: 28 of 80 GiB
    d.on_train_end(args, state, TrainerControl())
    summary = dash.summary_text(d.summary)
    assert "tok/s mean, all 2 ranks" in summary
    assert "  rank 0: VRAM 10.0 GiB alloc, 12.0 GiB reserved, peak 30.0 GiB of 80.0 GiB, RSS 3.0 GiB" in summary


def test_a_rank_that_is_not_the_main_process_shows_and_forwards_nothing_during_training(fake_display):
    trainer = _fake_trainer()  # rank 1 of a notebook_launcher run (its collective is tested above)
    recorder = trainer.callback_handler.callbacks[3]
    d = attach_dashboard(trainer, mode="html", clock=FakeClock(), memory_reader=fixed_memory())
    handler = trainer.callback_handler
    state = TrainerState(max_steps=3, is_world_process_zero=False)
    handler.on_train_begin(ARGS, state, TrainerControl())
    state.global_step = 1
    d.on_step_end(ARGS, state, TrainerControl())
    # the notebook table displaced from this rank was never started: forwarding would raise in it
    handler.on_log(ARGS, state, TrainerControl(), logs={"loss": 1.0})
    handler.on_prediction_step(ARGS, state, TrainerControl())
    handler.on_evaluate(ARGS, state, TrainerControl(), metrics={"eval_loss": 1.0})
    handler.on_train_end(ARGS, state, TrainerControl())
    assert recorder.events == [] and fake_display.calls == [] and d.summary is None
    handler.on_evaluate(ARGS, state, TrainerControl(), metrics={"eval_loss": 1.0})  # after the run: forwarded
    assert recorder.events == ["on_evaluate"]
