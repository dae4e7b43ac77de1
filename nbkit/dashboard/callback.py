"""``LiveDashboard``, the ``TrainerCallback`` that feeds a ``RunTracker`` from the trainer's events and drives one
view; and ``attach_dashboard``. See the package docstring for what it shows and its contract."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable, Optional, TextIO

from transformers import TrainerCallback

from .mode import MODES, resolve_mode
from .tracker import MemoryReading, RunTracker, Snapshot, default_memory_reader
from .views import make_view


def _progress_callback_types() -> tuple[type, ...]:
    """transformers' progress displays: the tqdm bar and, when IPython imports, the notebook table."""
    from transformers.trainer_callback import ProgressCallback

    types: list[type] = [ProgressCallback]
    try:
        from ..trl_seam import NotebookProgressCallback

        types.append(NotebookProgressCallback)
    except Exception:
        pass
    return tuple(types)


def _world_size(args: Any) -> int:
    """Processes of the job, as ``TrainingArguments.world_size`` says (1 without arguments)."""
    try:
        return max(1, int(getattr(args, "world_size", 1) or 1))
    except (TypeError, ValueError):
        return 1


def _epoch_bound(args: Any) -> bool:
    """Epochs bound the run unless ``max_steps`` does (``max_steps > 0`` overrides ``num_train_epochs``)."""
    max_steps = getattr(args, "max_steps", -1)
    return not (isinstance(max_steps, int) and max_steps > 0)


class LiveDashboard(TrainerCallback):
    """A ``TrainerCallback`` that shows a live, throttled dashboard of the run (see the package docstring).

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
        gather_ranks: on a multi-process run, let ``attach`` add the ``RankMemoryCallback`` that shows every rank's
            memory. Its gather is a collective, so either every rank attaches a dashboard or none gathers: pass
            False where only the main process attaches one (it then shows rank 0's memory alone).
    """

    def __init__(self, mode: str = "auto", *, clock: Callable[[], float] = time.monotonic,
                 memory_reader: Optional[Callable[[], MemoryReading]] = None, min_interval: float = 0.5,
                 ema: float = 0.9, rate_window: float = 5.0, stream: Optional[TextIO] = None,
                 text_interval: float = 30.0, gather_ranks: bool = True) -> None:
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
        self.gather_ranks = gather_ranks
        self.view: Any = None
        self.active_mode: Optional[str] = None
        self.renders = 0
        self.summary: Optional[Snapshot] = None
        self.rank_memory: Any = None  # the RankMemoryCallback whose rows rank 0 shows (multi-process runs)
        self._owns_rank_memory = False
        self._tracker: Optional[RunTracker] = None
        self._reader: Optional[Callable[[], MemoryReading]] = None
        self._thread: Optional[int] = None
        self._last_render: Optional[float] = None
        self._lock = threading.Lock()
        self._trainer: Any = None
        self._displaced: list[tuple[int, TrainerCallback]] = []
        self._tokens_seen: dict[str, int] = {}
        self._in_run = False  # between on_train_begin and on_train_end, on every rank
        self._warned = False

    # -- attaching to a trainer ------------------------------------------------------------------------------

    def attach(self, trainer: Any) -> LiveDashboard:
        """Add this dashboard to ``trainer`` and take transformers' progress display out of its callback list
        (remembering where it was). Other ``LiveDashboard``s on the trainer are removed: one panel per run.

        On a multi-process run (``trainer.args.world_size > 1``) it also puts a ``RankMemoryCallback`` before
        itself (or uses one already there), so rank 0 shows every rank's memory; call ``attach`` on every rank,
        as ``FastSFT`` does, because that callback's gather is a collective (or pass ``gather_ranks=False``)."""
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
        if self.gather_ranks and _world_size(getattr(trainer, "args", None)) > 1:
            self._wire_rank_memory(handler.callbacks)
        return self

    def _wire_rank_memory(self, callbacks: list) -> None:
        from ..distributed import RankMemoryCallback

        present = [cb for cb in callbacks if isinstance(cb, RankMemoryCallback)]
        if present:
            if present[0] is not self.rank_memory:
                self.rank_memory, self._owns_rank_memory = present[0], False
            return
        self.rank_memory, self._owns_rank_memory = RankMemoryCallback(), True
        callbacks.insert(callbacks.index(self), self.rank_memory)

    def detach(self) -> None:
        """Remove this dashboard (and the rank-memory callback it added) from its trainer and put the progress
        display back where it was."""
        trainer, self._trainer = self._trainer, None
        if trainer is None:
            return
        callbacks = trainer.callback_handler.callbacks
        if self._owns_rank_memory and self.rank_memory in callbacks:
            callbacks.remove(self.rank_memory)
        self.rank_memory, self._owns_rank_memory = None, False
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
        """Outside a training run (a standalone evaluate/predict), the displaced progress display does the job.
        Inside one it never does, on any rank: it was not started, and only rank 0's dashboard shows the run."""
        if self._in_run:
            return
        for cb in self.displaced:
            getattr(cb, event)(args, state, control, **kwargs)

    # -- rendering -----------------------------------------------------------------------------------------

    def _on_training_thread(self) -> bool:
        return self._tracker is not None and threading.get_ident() == self._thread

    def snapshot(self) -> Optional[Snapshot]:
        """What the dashboard would show now (None before the first ``on_train_begin``). Reads memory."""
        if self._tracker is None:
            return self.summary
        with self._lock:
            try:
                reading = self._reader() if self._reader is not None else MemoryReading()
            except Exception:  # a failed reading shows as unknown, it does not stop training
                reading = MemoryReading()
            ranks = tuple(self.rank_memory.latest) if self.rank_memory is not None else ()
            return self._tracker.snapshot(self.clock(), reading, ranks)

    def _maybe_render(self, force: bool = False) -> None:
        """Render when ``min_interval`` has passed and the view would show it; otherwise cost a clock read."""
        if self.view is None or not self._on_training_thread():
            return
        now = self.clock()
        if not force and self._last_render is not None:
            if now - self._last_render < self.min_interval or not self.view.due(now):
                return
        self._last_render = now
        self.renders += 1
        self._guarded(self.view.show if self.renders == 1 else self.view.update, self.snapshot())

    def _guarded(self, action: Callable[[Snapshot], None], snap: Snapshot) -> None:
        """Run a view's action; if it fails, say so once and stop displaying. A dashboard never stops training.
        A widget panel that fails to show gives way to the HTML view instead, shown in its place."""
        try:
            action(snap)
        except Exception as exc:  # any display failure must stay out of the training loop
            if self.active_mode == "widget" and self.view is not None and action == self.view.show:
                self.view = self._html_instead(exc)
                self._guarded(self.view.show, snap)
                return
            self.view = None
            warnings.warn(f"nbkit LiveDashboard stopped displaying: {type(exc).__name__}: {exc}", stacklevel=3)

    def _make_view(self) -> Any:
        """The view of ``active_mode``; a widget panel that cannot be built (ipywidgets imports, but its widgets do
        not work in this kernel) gives way to the HTML view."""
        try:
            return make_view(self.active_mode, self.stream, self.text_interval)
        except Exception as exc:
            if self.active_mode != "widget":
                raise
            return self._html_instead(exc)

    def _html_instead(self, exc: Exception) -> Any:
        """Switch to the HTML view (one output that renders in any notebook frontend) and say why, once."""
        self.active_mode = "html"
        warnings.warn(f"nbkit LiveDashboard shows its HTML view: the widget panel failed ({type(exc).__name__}: "
                      f"{exc})", stacklevel=4)
        return make_view("html")

    # -- TrainerCallback events ------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        self._in_run = True
        if not state.is_world_process_zero:
            return
        self._thread = threading.get_ident()
        base = dict(self._tokens_seen)
        base["num_input_tokens_seen"] = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        trl_count = getattr(self._trainer, "_total_train_tokens", None)  # TRL's counter, when attached to it
        if isinstance(trl_count, int):
            base["num_tokens"] = trl_count
        self._tracker = RunTracker(self.clock(), state.global_step, state.max_steps, base, self.ema,
                                   self.rate_window, epoch_bound=_epoch_bound(args), world_size=_world_size(args))
        self._reader = self.memory_reader or default_memory_reader(getattr(args, "device", None))
        self.active_mode = resolve_mode(self.mode)
        self.view = self._make_view()
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
        self._in_run = False
        if self._tracker is None:
            return
        tracker = self._tracker
        with self._lock:
            tracker.phase = "done"
            if tracker.tokens_key is not None and tracker.tokens is not None:
                self._tokens_seen[tracker.tokens_key] = tracker.tokens + tracker.tokens_base[tracker.tokens_key]
        snap = self.snapshot()
        if self.view is not None and self._on_training_thread():
            if self.renders == 0:
                self.renders += 1
                self._guarded(self.view.show, snap)
            if self.view is not None:
                self._guarded(self.view.finish, snap)  # the HTML view, if the widget panel gave way to it
        self.summary = snap
        self._tracker = None
        self.view = None


def attach_dashboard(trainer: Any, **kwargs: Any) -> LiveDashboard:
    """Create a ``LiveDashboard(**kwargs)`` and attach it to ``trainer`` (a TRL ``SFTTrainer`` or any
    ``transformers.Trainer``), replacing transformers' progress display while attached."""
    return LiveDashboard(**kwargs).attach(trainer)
