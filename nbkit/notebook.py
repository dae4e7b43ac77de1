"""Plumbing the example notebooks share, kept out of them so that their cells show only the nbkit calls that matter.

- ``pick_model``: the model a notebook trains. ``"auto"`` is a real checkpoint on a GPU and, with no GPU, a tiny
  randomly initialised model of a real architecture saved to a local folder with the demo tokenizer; either way
  the notebook then loads it through the same ``nbkit.load_model(path, ...)`` call. ``ModelChoice.recipe`` gives
  the training settings for it: the tiny model's are ``nbkit.demo.models.TINY_RECIPE``, the demo's.
- ``to_prompt_completion`` / ``demo_chat_dataset``: chat rows as TRL's conversational prompt-completion format, so
  the loss covers the answer only with any model's chat template (``assistant_only_loss`` needs templates with
  ``{% generation %}`` markers, which most shipped templates lack). The user's own file is read with
  ``nbkit.load_jsonl``, which names an empty file or a bad line.
- ``answers``: greedy chat answers, before and after training.
- ``RunProbe``: tokens/s (TRL's token count, first step left out), per-step losses and peak CUDA memory of a run.
- ``answer_loss``: the loss on held-out answers (what training lowers), and one number to tell whether two models
  (trained, reloaded, merged) are the same.
- ``feature``: whether an nbkit module and the name a notebook needs are there, and if not, what is missing.
- ``LengthSearch``: the longest sequence a training step fits, found without ever running a step that host memory
  (or the time allowed) cannot hold: each try is first predicted from the ones measured at shorter lengths.

Memory figures are read and formatted by ``nbkit.memory`` (``fmt_bytes`` for display).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from transformers import TrainerCallback

from nbkit.demo.models import TINY_RECIPE, Recipe
from nbkit.memory import device_memory, fmt_bytes, host_memory, process_rss


@dataclass(frozen=True)
class ModelChoice:
    path: str  # what to pass to load_model: a Hub id or a local folder
    tiny: bool  # a random-init tiny model (train it with a high learning rate and its vocabulary trainable)
    family: Optional[str]  # the tiny model's family, None for a real checkpoint

    def describe(self) -> str:
        if self.tiny:
            return f"tiny random-init {self.family} model saved in {self.path} (no GPU or model_name='tiny')"
        return self.path

    def recipe(self, pretrained: Recipe, **given: Any) -> Recipe:
        """The training settings: ``TINY_RECIPE`` for a tiny model (what makes a random-init model learn: many small
        steps, a high learning rate, embeddings and head trained in full), else ``pretrained``; then every ``given``
        value that is not None (a notebook parameter set by the user) in place of the recipe's."""
        return (TINY_RECIPE if self.tiny else pretrained).but(**given)


def pick_model(model_name: str, gpu_default: str, tiny_family: str = "qwen3", folder: str | Path = "nbkit-out/tiny",
               seed: int = 0) -> ModelChoice:
    """Resolve a notebook's ``model_name`` parameter.

    ``"auto"``: ``gpu_default`` when CUDA is available, else ``"tiny"``. ``"tiny"`` (or ``"tiny:FAMILY"``): build a
    tiny ``FAMILY`` model (``nbkit.demo.models``), sized to the demo tokenizer, and save both to ``folder``.
    Anything else is returned as is (a Hub id or a local folder).
    """
    if model_name == "auto":
        model_name = gpu_default if torch.cuda.is_available() else "tiny"
    if model_name == "tiny" or model_name.startswith("tiny:"):
        family = model_name.partition(":")[2] or tiny_family
        from nbkit.demo.models import build_base

        build_base(Path(folder), family, seed)
        return ModelChoice(str(folder), True, family)
    return ModelChoice(model_name, False, None)


def to_prompt_completion(dataset: Any) -> Any:
    """A ``messages`` dataset as conversational prompt-completion: every turn before the last is the prompt, the
    last (assistant) turn the completion. TRL then trains on the completion only, whatever the chat template.

    A dataset with ``prompt`` and ``completion`` columns already is returned as it is (a user's file may hold
    either form); any other columns are a ``ValueError`` naming them, as is a row whose last turn is not the
    assistant's, by its index."""
    columns = list(dataset.column_names or [])
    if "prompt" in columns and "completion" in columns:
        return dataset
    if "messages" not in columns:
        raise ValueError(f"the rows have columns {columns}: expected 'messages' (a list of {{'role', 'content'}} "
                         "turns, the last the assistant's answer) or 'prompt' and 'completion'. Map your columns "
                         "to one of these first")

    def split(row: dict, index: int) -> dict:
        messages = row["messages"]
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError(f"row {index}: the last message must be the assistant's answer (roles: "
                             f"{[m.get('role') for m in messages or []]})")
        return {"prompt": messages[:-1], "completion": messages[-1:]}

    return dataset.map(split, with_indices=True, remove_columns=["messages"])


def demo_chat_dataset(n: int, split: str = "train", seed: int = 0) -> Any:
    """The shipped demo task (reverse the words) as ``n`` conversational prompt-completion rows."""
    from nbkit.demo.data import make_dataset

    return to_prompt_completion(make_dataset("messages", n=n, split=split, seed=seed))


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode inside the block, back in the mode it had after it. (CPU 4-bit layers that
    ``nbkit.load_model`` loaded are not repacked for inference by an evaluation: ``keep_4bit_trainable``.)"""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)


def answers(model: torch.nn.Module, tokenizer: Any, questions: Sequence[str], max_new_tokens: int = 16) -> list[str]:
    """Greedy answers to chat ``questions`` (``nbkit.generation``); an empty reasoning block (Qwen3's
    ``<think></think>``) is removed."""
    from nbkit.generation import generate_answers

    raw = generate_answers(model, tokenizer, list(questions), max_new_tokens=max_new_tokens)
    return [_THINK.sub("", text).strip() for text in raw]


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    return sum(p == r for p, r in zip(predictions, references)) / max(1, len(references))


def keep_trainable_fp32(trainer: Any) -> None:
    """Where compute is not bf16 (CPU: fp32; a T4: fp16), keep the trainable weights in fp32.

    TRL casts QLoRA adapters to bf16 (the recipe for bf16 GPUs); on a CPU that only loses precision, and fp16
    gradient scaling cannot unscale bf16 gradients. Same treatment as ``python -m nbkit demo``.
    """
    from nbkit.loading import pick_compute_dtype

    if pick_compute_dtype() == torch.bfloat16:
        return
    for param in trainer.model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()


class RunProbe(TrainerCallback):
    """Measures a training run: step losses and gradient norms, step times, tokens/s and peak CUDA memory.

    tokens/s counts tokens as TRL logs them (``num_tokens``, cumulative; needs ``logging_steps=1`` for a per-step
    rate) from the first log to the last, so the first step (warm-up, compilation) is left out; with a single log
    it falls back to all tokens over the whole run. Peak memory is ``torch.cuda.max_memory_allocated`` after a
    reset at ``on_train_begin`` (None on CPU: host memory has no per-run peak to read).
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.step_seconds: list[float] = []
        self._step_start = 0.0
        self.points: list[tuple[float, int]] = []
        self.t_begin = self.t_end = 0.0
        self.peak_memory: Optional[int] = None
        self._device: Optional[torch.device] = None

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - TrainerCallback's signature
        self._device = getattr(args, "device", None)
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        self.t_begin = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self._sync()
        self.step_seconds.append(time.perf_counter() - self._step_start)

    def _sync(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
        logs = logs or {}
        if "loss" in logs and isinstance(logs["loss"], (int, float)):
            self.losses.append(float(logs["loss"]))
        if isinstance(logs.get("grad_norm"), (int, float)):
            self.grad_norms.append(float(logs["grad_norm"]))
        tokens = logs.get("num_tokens", logs.get("num_input_tokens_seen"))
        if isinstance(tokens, (int, float)) and "loss" in logs:
            self._sync()
            self.points.append((time.perf_counter(), int(tokens)))

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.t_end = time.perf_counter()
        reading = device_memory(self._device) if self._device is not None else None
        self.peak_memory = reading.peak if reading is not None else None

    @property
    def seconds_per_step(self) -> float:
        """Median step time, the first step left out when there are others."""
        times = sorted(self.step_seconds[1:] or self.step_seconds)
        return times[len(times) // 2] if times else math.nan

    @property
    def tokens(self) -> int:
        return self.points[-1][1] if self.points else 0

    @property
    def tokens_per_second(self) -> float:
        if len(self.points) >= 2 and self.points[-1][0] > self.points[0][0]:
            (t0, n0), (t1, n1) = self.points[0], self.points[-1]
            return (n1 - n0) / (t1 - t0)
        elapsed = self.t_end - self.t_begin
        return self.tokens / elapsed if elapsed > 0 else math.nan


def _answer_ids(tokenizer: Any, question: str, answer: str) -> tuple[list[int], int]:
    """The chat-formatted (question, answer) as token ids, and where the answer starts: the tokens after the prompt
    with the assistant's header (``add_generation_prompt``), as TRL splits a conversational prompt-completion row.
    Where the template renders the prompt differently inside the conversation, the answer starts where the two
    renderings part."""
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    full = tokenizer(tokenizer.apply_chat_template(turns, tokenize=False), add_special_tokens=False)["input_ids"]
    prompt_text = tokenizer.apply_chat_template(turns[:1], tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    start = 0
    while start < min(len(prompt), len(full)) and prompt[start] == full[start]:
        start += 1
    return full, max(1, start)


@torch.no_grad()
def answer_loss(model: torch.nn.Module, tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> float:
    """Mean next-token cross-entropy (nats per token) of ``model`` on the answers of the chat-formatted (question,
    answer) ``pairs``: the tokens training's loss covers (the completion, its end of turn included), the question's
    not counted. 0 means every answer token was predicted with certainty; ``exp(-loss)`` is the geometric-mean
    probability the model gives an answer token.

    Computed from the logits: no auxiliary term (TRL turns on MoE models' router loss, which ``model(labels=...)
    .loss`` would add), so two models with the same weights (trained, reloaded, merged) give the same number.
    """
    device = next(p.device for p in model.parameters())
    total, count = 0.0, 0
    with eval_mode(model):
        for question, answer in pairs:
            full, start = _answer_ids(tokenizer, question, answer)
            ids = torch.tensor([full], device=device)
            logits = model(input_ids=ids).logits[0, start - 1 : -1].float()
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, start:], reduction="sum"))
            count += len(full) - start
    return total / max(1, count)


def feature(module: str, name: str) -> tuple[bool, str]:
    """Whether ``module`` imports and defines ``name``; the message says what is missing when it does not."""
    try:
        mod = importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any import failure means the feature is not there
        return False, f"{module} cannot be imported ({type(error).__name__}: {error})"
    if not hasattr(mod, name):
        return False, f"{module} has no {name}"
    return True, f"{module}.{name} is available"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> Any:
    """A Markdown table for ``IPython.display.display`` (renders in Jupyter, Colab, Kaggle and on GitHub)."""
    from IPython.display import Markdown

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return Markdown("\n".join(lines))



# ---------------------------------------------------------------------------------------------------------------
# the longest length that fits


class HostPeak:
    """This process's peak resident set while the block runs, sampled every ``interval`` seconds on a thread.

    Why sampled: the kernel's peak (``ru_maxrss``) only grows over the life of the process, so it cannot tell the
    peak of one step once a longer one has run. Pinned (page-locked) host memory is resident, so it is counted.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.start = self.peak = 0
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        now = process_rss()
        if now is not None and now > self.peak:
            self.peak = now

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            self._sample()

    def __enter__(self) -> HostPeak:
        self.start = self.peak = process_rss() or 0
        self._done.clear()
        self._thread = threading.Thread(target=self._loop, name="nbkit-host-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


def trim_host_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing happens).

    Why: memory a step freed stays in the heap, resident, and the next step reuses it without growing the resident
    set; a measurement above a resident set that still holds it would miss that part of the next step's need.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def forecast(points: Sequence[tuple[int, float]], length: int) -> Optional[float]:
    """What a quantity measured at shorter lengths (``points``: (length, value)) will be at ``length``, erring high.

    A training step's memory and time grow at most with the square of the length (attention scores) on top of a
    part that does not grow (weights, optimizer state). The increment between the two longest measured lengths
    cancels that fixed part; it is scaled by the larger of the linear and the quadratic growth to ``length``, and
    the result is at least the last value scaled linearly. With one point the whole value is taken to grow with the
    square. None without a point below ``length``.
    """
    below = sorted((n, v) for n, v in points if n < length)
    if not below:
        return None
    n2, v2 = below[-1]
    if len(below) == 1:
        return v2 * (length / n2) ** 2
    n1, v1 = below[-2]
    grow = max((length - n2) / (n2 - n1), (length**2 - n2**2) / (n2**2 - n1**2))
    return max(v2 + max(v2 - v1, 0.0) * grow, v2 * length / n2)


@dataclass
class LengthSearch:
    """The longest sequence ``try_length`` fits: doubling from ``start`` while it fits, up to ``limit``, then
    ``refine_steps`` bisections towards the first length that did not fit (out of memory, or predicted not to fit in
    host memory).

    ``try_length(n)`` trains on one sequence of ``n`` tokens and returns a dict with ``fits`` (False: it ran out of
    memory, caught) and, when it fits, ``seconds_per_step``. A device out of memory is an exception a try catches;
    running out of host memory is not (the kernel kills the process), so no try runs whose host memory, predicted
    by ``forecast`` from the tries before it, exceeds ``host_fraction`` of what ``host_memory()`` says is available
    now (plus what this process already holds above where the search began). Tries predicted to take more than
    ``max_step_seconds`` a step (None: no limit) are not run either. The first try has nothing to predict from:
    keep ``start`` small. ``run()`` returns ``longest_fit``, ``first_oom``, ``tried`` (length -> the try's dict,
    plus its measured ``host_peak`` in bytes above the start and the ``predicted`` host bytes and seconds) and
    ``stopped``: where and why the search ended, in words.
    """

    try_length: Callable[[int], dict]
    start: int
    limit: int
    refine_steps: int = 2
    max_step_seconds: Optional[float] = None
    host_fraction: float = 0.8
    label: str = ""
    say: Callable[[str], None] = print
    read_host: Callable[[], tuple[Optional[int], Optional[int]]] = host_memory
    watch: Callable[[], HostPeak] = HostPeak
    tried: dict[int, dict] = field(default_factory=dict)
    _base: int = field(default=0, init=False, repr=False)  # this process's RSS when run() began

    def predicted(self, length: int) -> tuple[Optional[float], Optional[float]]:
        """(host bytes above the start, seconds a step) a try at ``length`` is expected to need."""
        fits = [(n, row) for n, row in self.tried.items() if row["fits"]]
        host = forecast([(n, row["host_peak"]) for n, row in fits], length)
        seconds = forecast([(n, row["seconds_per_step"]) for n, row in fits], length)
        return host, seconds

    def blocked(self, length: int) -> Optional[tuple[str, str]]:
        """("host" or "time", why) when a try at ``length`` is not to run; None when it may."""
        host, seconds = self.predicted(length)
        used, total = self.read_host()
        if host is not None and used is not None and total is not None:
            available = total - used
            trim_host_heap()
            held = max(0, (process_rss() or self._base) - self._base)
            if host - held > self.host_fraction * available:
                return "host", (f"a step at {length:,} tokens would need about {fmt_bytes(int(host))} of host memory, "
                                f"{fmt_bytes(int(host - held))} more than now, and {fmt_bytes(available)} is "
                                f"available (a try may take {self.host_fraction:.0%} of it)")
        if seconds is not None and self.max_step_seconds is not None and seconds > self.max_step_seconds:
            return "time", (f"a step at {length:,} tokens would take about {seconds:,.0f} s "
                            f"(max_step_seconds={self.max_step_seconds:g})")
        return None

    def _try(self, length: int) -> dict:
        host, seconds = self.predicted(length)
        trim_host_heap()
        with self.watch() as peak:
            row = dict(self.try_length(length))
        row["host_peak"] = max(0, peak.peak - self._base)
        row["predicted"] = {"host_bytes": host, "seconds_per_step": seconds}
        self.tried[length] = row
        done = (f"fits ({fmt_bytes(row['host_peak'])} host memory above the start, "
                f"{row['seconds_per_step']:.2f} s a step)") if row["fits"] else "out of memory"
        self.say(f"  {self.label} {length:>7,} tokens: {done}")
        return row

    def run(self) -> dict[str, Any]:
        trim_host_heap()
        self._base = process_rss() or 0
        self.tried = {}
        fit: Optional[int] = None
        upper: Optional[int] = None  # the shortest length known (oom) or predicted (host) not to fit
        oom: Optional[int] = None
        length, stopped = self.start, ""
        while True:
            if length > self.limit:
                stopped = f"reached the search limit, max_try_length={self.limit:,}"
                break
            block = self.blocked(length)
            if block is not None:
                stopped = f"{length:,} not tried: {block[1]}"
                upper = length if block[0] == "host" else None
                break
            if not self._try(length)["fits"]:
                oom = upper = length
                stopped = f"out of memory at {length:,} tokens"
                break
            fit, length = length, length * 2
        for _ in range(self.refine_steps if fit and upper else 0):
            middle = (fit + upper) // 2 // 256 * 256
            if middle in (fit, upper):
                break
            block = self.blocked(middle)
            if block is not None:
                upper = middle
                stopped = f"{middle:,} not tried: {block[1]}"
                continue
            if self._try(middle)["fits"]:
                fit = middle
            else:
                oom = upper = middle
                stopped = f"out of memory at {middle:,} tokens"
        return {"longest_fit": fit, "first_oom": oom, "tried": self.tried, "stopped": stopped}
