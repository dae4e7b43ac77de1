"""Reliability at the step and on disk: out-of-memory errors that say what to change, non-finite losses caught at
the step they appear, and checkpoints that are either complete or absent.

Why: Colab disconnects, Kaggle sessions time out, free GPUs run out of memory and datasets are messy. A careful user
wants (1) an OOM to name the step, the memory figures and the settings that would make it fit, with the memory given
back so the notebook can go on; (2) a NaN loss stopped before it reaches the weights, with the rows that caused it;
(3) a kill at any moment, including in the middle of a save, to leave a "latest checkpoint" that loads.

Contract (``FastSFT`` uses these; each piece also works on its own):

- ``TrainingOutOfMemoryError`` is a ``torch.OutOfMemoryError`` (code that catches that still does, and accelerate's
  ``auto_find_batch_size`` still recognises it). ``out_of_memory_error`` builds it; ``free_memory`` gives back what
  a failed step held (gradients, cached allocator blocks). The caller must drop the original exception (its
  traceback pins the step's activations): ``forget_exception`` clears those frames.
- ``NonFiniteLossError`` (a ``FloatingPointError``) names the step, the micro-batch, the loss value, the batch's
  documents as row indices of the user's dataset, and which of them is non-finite on its own (FastSFT's check).
  ``DocumentLocator`` finds those rows only when asked (after a failure): the batch's documents are matched against
  the dataset re-tokenized once without packing, so the hot path and the batches are exactly TRL's (no id column
  travels through packing, which would drop it).
- ``atomic_directory(target)`` yields a staging folder beside ``target``; when the block ends without error the
  folder is fsynced and renamed into place (an existing folder is swapped out, or, when it holds sub-folders such
  as checkpoints, each file is replaced atomically). Staging folders are hidden (``.nbkit-staging-*``), so neither
  transformers' ``get_last_checkpoint`` nor its checkpoint rotation ever sees one. ``recover_interrupted`` cleans
  what a kill left behind; ``last_complete_checkpoint`` picks the newest checkpoint that is whole.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

STAGING_PREFIX = ".nbkit-staging-"
OLD_PREFIX = ".nbkit-old-"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers' own pattern (trainer_utils._re_checkpoint)
_WEIGHT_FILES = (
    "adapter_model.safetensors", "model.safetensors", "model.safetensors.index.json",
    "adapter_model.bin", "pytorch_model.bin", "pytorch_model.bin.index.json",
)  # fmt: skip


# ====================================================================================================================
# Out of memory
# ====================================================================================================================
class TrainingOutOfMemoryError(torch.OutOfMemoryError):
    """The device ran out of memory during training; the message names the step, the figures and what to change."""


@dataclass
class MemoryFigures:
    """Device memory in bytes, read after the failed step's memory was given back (``peak``: the high-water mark)."""

    device: str
    allocated: int
    reserved: int
    total: int
    peak: int

    def describe(self) -> str:
        return (f"{self.device}: {_gib(self.allocated)} allocated, {_gib(self.reserved)} reserved, "
                f"{_gib(self.total)} total, peak {_gib(self.peak)} allocated")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_figures(device: torch.device | str | None = None) -> MemoryFigures | None:
    """CUDA memory figures of ``device`` (default: the current CUDA device); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return MemoryFigures(
        device=f"cuda:{index} ({torch.cuda.get_device_name(index)})",
        allocated=torch.cuda.memory_allocated(index),
        reserved=torch.cuda.memory_reserved(index),
        total=torch.cuda.get_device_properties(index).total_memory,
        peak=torch.cuda.max_memory_allocated(index),
    )


def forget_exception(error: BaseException) -> str:
    """The error's message; its traceback frames are cleared so the tensors they hold (activations) can be freed."""
    message = str(error).strip()
    traceback.clear_frames(error.__traceback__)  # frames still executing (the caller's) are skipped
    error.__traceback__ = None
    return message


def free_memory(model: torch.nn.Module | None = None) -> None:
    """Give back what a failed step held: the model's gradients, unreachable tensors, the allocator's cached blocks."""
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_quantized(model: Any) -> bool:
    base = model
    if hasattr(base, "get_base_model"):  # a PEFT model
        with contextlib.suppress(Exception):
            base = base.get_base_model()
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)
                or getattr(getattr(base, "config", None), "quantization_config", None))


def _param_bytes(model: Any) -> int:
    try:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    except Exception:  # a model without parameters() (never in practice)
        return 0


def fit_suggestions(args: Any, model: Any = None, figures: MemoryFigures | None = None) -> list[str]:
    """The two or three settings most likely to make a step fit, best first.

    Activations grow with tokens per step (batch size x max_length) and shrink with (offloaded) checkpointing; the
    weights shrink with a 4-bit base. When the weights take most of the device, 4-bit comes first.
    """
    tips: list[str] = []
    batch = int(getattr(args, "per_device_train_batch_size", 1) or 1)
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    max_length = getattr(args, "max_length", None)
    if batch > 1:
        tips.append(f"per_device_train_batch_size={max(1, batch // 2)} with gradient_accumulation_steps="
                    f"{accumulation * 2} (the same effective batch; about half the activation memory)")
    if max_length and max_length > 128:
        what = "tokens per packed row" if getattr(args, "packing", False) else "the longest row"
        tips.append(f"max_length={max_length // 2} (activations grow with {what})")
    if not getattr(args, "gradient_checkpointing", False):
        tips.append("gradient_checkpointing=True (keeps one layer's activations at a time, recomputes the rest)")
    elif getattr(args, "offload_checkpointing", "auto") is not True:
        tips.append("offload_checkpointing=True (checkpointed layer inputs move to pinned CPU memory)")
    quantized = model is not None and _is_quantized(model)
    if model is not None and not quantized:
        four_bit = "nbkit.load_model(..., load_in_4bit=True) (a 4-bit NF4 base: about a quarter of bf16 weight memory)"
        heavy = figures is not None and figures.total and _param_bytes(model) > 0.5 * figures.total
        tips.insert(0, four_bit) if heavy else tips.append(four_bit)
    return tips[:3]


def out_of_memory_error(
    original: str, *, step: int, micro_batch: int | None, accumulation: int, where: str, args: Any, model: Any,
    device: torch.device | str | None = None,
) -> TrainingOutOfMemoryError:
    """The error FastSFT raises after an OOM (call ``free_memory`` first, so the figures show what is left)."""
    figures = memory_figures(device)
    at = f"Step {step}"
    if micro_batch is not None and accumulation > 1:
        at += f" (micro-batch {micro_batch} of {accumulation})"
    # the phrase " out of memory." keeps accelerate's auto_find_batch_size recognising the error
    lines = [f"{at} ran out of memory. It failed in {where}."]
    lines.append("Memory now (the failed step's memory was given back): "
                 + (figures.describe() if figures is not None else "no CUDA device, figures unavailable"))
    tips = fit_suggestions(args, model, figures)
    if tips:
        lines.append("To make it fit, change one of:")
        lines += [f"  - {tip}" for tip in tips]
    first = original.splitlines()[0] if original else ""
    lines.append(f"(torch said: {first})")
    return TrainingOutOfMemoryError("\n".join(lines))


# ====================================================================================================================
# Non-finite loss
# ====================================================================================================================
class NonFiniteLossError(FloatingPointError):
    """The training loss was NaN or infinite; the message names the step and the batch's documents."""

    def __init__(self, message: str, event: "NonFiniteLoss") -> None:
        super().__init__(message)
        self.event = event


@dataclass
class NonFiniteLoss:
    """One non-finite loss: where it happened and what the batch held."""

    step: int  # the optimizer step in progress (1-based, as the logs count)
    micro_batch: int  # 1-based within the gradient-accumulation window
    accumulation: int
    value: float
    rows: list[list[int]] | None  # per document of the batch: the matching dataset rows (None: not located)
    spans: list[tuple[int, int, int]]  # per document: (batch row, first token, end token)
    culprits: list[int] | None = None  # documents (indices into spans) whose loss is non-finite on their own
    note: str = ""

    def describe(self) -> str:
        at = f"step {self.step}" + (f" (micro-batch {self.micro_batch} of {self.accumulation})"
                                    if self.accumulation > 1 else "")
        text = f"loss is {self.value} at {at}; the batch holds {len(self.spans)} document(s)"
        text += ": " + self._where(range(len(self.spans)))
        if self.culprits:
            text += f"; non-finite on its own: {self._where(self.culprits)}"
        elif self.culprits is not None:
            text += "; no document is non-finite on its own (the batch as a whole overflowed)"
        if self.note:
            text += f" ({self.note})"
        return text


    def _where(self, documents: Sequence[int]) -> str:
        """Dataset rows of these documents when located, else their positions in the batch."""
        if self.rows is not None:
            found = sorted({r for d in documents for r in self.rows[d]})
            missing = sum(1 for d in documents if not self.rows[d])
            text = f"train_dataset rows {_short(found)}" if found else "no train_dataset row found"
            return text + (f" ({missing} not found)" if missing and found else "")
        spans = [self.spans[d] for d in documents]
        shown = ", ".join(f"batch row {r} tokens {a}-{b}" for r, a, b in spans[:8])
        return shown + (" ..." if len(spans) > 8 else "")


def _short(values: Sequence[int], limit: int = 32) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def batch_documents(inputs: dict[str, Any]) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """The documents of one collated batch: their token ids and (batch row, start, end) positions.

    Uses the packed boundaries when the batch has them (``nbkit_cu_seqlens_host`` / ``cu_seq_lens_q`` /
    ``position_ids``), else the attention mask, else whole rows. Padding documents (all pad) are kept: they are cheap.
    """
    ids = inputs["input_ids"].detach().cpu()
    rows = ids.tolist()
    spans: list[tuple[int, int, int]] = []
    offsets = inputs.get("nbkit_cu_seqlens_host")
    if offsets is None and inputs.get("cu_seq_lens_q") is not None:
        offsets = [int(x) for x in inputs["cu_seq_lens_q"].detach().cpu().tolist()]
    if offsets is None and inputs.get("position_ids") is not None and ids.shape[0] == 1:
        pos = inputs["position_ids"].detach().cpu().reshape(-1)
        starts = [int(i) for i in (pos == 0).nonzero().flatten().tolist()] or [0]
        offsets = sorted(set([0, *starts, int(pos.numel())]))
    if offsets is not None and ids.shape[0] == 1:
        spans = [(0, int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:]) if b > a]
    elif inputs.get("attention_mask") is not None:
        mask = inputs["attention_mask"].detach().cpu()
        for r in range(ids.shape[0]):
            keep = mask[r].nonzero().flatten()
            if keep.numel():
                spans.append((r, int(keep[0]), int(keep[-1]) + 1))
    else:
        spans = [(r, 0, ids.shape[1]) for r in range(ids.shape[0])]
    return [rows[r][a:b] for r, a, b in spans], spans


class DocumentLocator:
    """Finds which rows of the user's dataset a batch's documents came from; built on first use.

    ``prepare(dataset)`` must turn the raw dataset (with an added ``__nbkit_row`` column) into tokenized rows without
    packing, truncation or shuffling, as the trainer tokenizes them (FastSFT passes TRL's own ``_prepare_dataset``).
    A document matches a row when its tokens start that row's tokens (cut documents match the row they were cut from)
    or, failing that, appear inside it (the later parts of a split document).
    """

    ROW = "__nbkit_row"

    def __init__(self, dataset: Any, prepare: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.prepare = prepare
        self._rows: list[list[int]] | None = None
        self._index: list[int] = []
        self._by_prefix: dict[tuple[int, ...], list[int]] = {}
        self.note = ""

    K = 4  # prefix length of the lookup key

    def _build(self) -> bool:
        if self._rows is not None:
            return True
        try:
            from datasets import Dataset
        except ImportError:  # pragma: no cover - datasets is a dependency
            return False
        if not isinstance(self.dataset, Dataset):
            self.note = "rows of an IterableDataset cannot be located; positions in the batch are given"
            return False
        if self.ROW in self.dataset.column_names:
            source = self.dataset
        else:
            source = self.dataset.add_column(self.ROW, list(range(len(self.dataset))))
        prepared = self.prepare(source)
        self._rows = list(prepared["input_ids"])
        self._index = list(prepared[self.ROW])
        for i, ids in enumerate(self._rows):
            self._by_prefix.setdefault(tuple(ids[: self.K]), []).append(i)
        return True

    def locate(self, documents: Sequence[Sequence[int]]) -> list[list[int]] | None:
        """Per document, the dataset rows it matches (usually one); None when the rows cannot be located."""
        try:
            if not self._build():
                return None
        except Exception as error:  # locating is a courtesy of the error path: never hide the real error behind it
            self.note = f"could not locate rows: {type(error).__name__}: {error}"
            logger.warning("nbkit: %s", self.note)
            return None
        found: list[list[int]] = []
        for doc in documents:
            doc = list(doc)
            hits = [self._index[i] for i in self._by_prefix.get(tuple(doc[: self.K]), [])
                    if self._rows[i][: len(doc)] == doc]
            if not hits and len(doc) >= self.K:
                hits = [self._index[i] for i, ids in enumerate(self._rows) if _contains(ids, doc)]
            found.append(sorted(set(hits)))
        return found


def _contains(haystack: Sequence[int], needle: Sequence[int]) -> bool:
    n = len(needle)
    first = needle[0]
    for i in range(len(haystack) - n + 1):
        if haystack[i] == first and list(haystack[i : i + n]) == list(needle):
            return True
    return False


# ====================================================================================================================
# Atomic directories and checkpoints
# ====================================================================================================================
def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # e.g. directories cannot be opened on Windows; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:  # some FUSE mounts (Drive) refuse fsync on directories; their rename is what it is
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file under ``root``, then the folders, so a rename publishes data that is on disk."""
    root = Path(root)
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(Path(folder) / name)
        _fsync_path(Path(folder), directory=True)


def _token() -> str:
    return uuid.uuid4().hex[:10]


def new_staging_dir(parent: str | os.PathLike, name: str) -> Path:
    """A fresh hidden folder in ``parent`` (same filesystem as its future name, so the rename is atomic)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    staging = parent / f"{STAGING_PREFIX}{_token()}-{name}"
    staging.mkdir()
    return staging


def publish_directory(staging: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename ``staging`` to ``target`` atomically; an existing ``target`` is swapped out, then deleted.

    A kill between the two renames of a swap leaves ``target`` absent and the old one whole in a hidden
    ``.nbkit-old-*`` folder, which ``recover_interrupted`` puts back.
    """
    staging, target = Path(staging), Path(target)
    fsync_tree(staging)
    old = None
    if target.exists():
        old = target.parent / f"{OLD_PREFIX}{_token()}-{target.name}"
        os.rename(target, old)
    os.rename(staging, target)
    _fsync_path(target.parent, directory=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _replace_files(staging: Path, target: Path) -> None:
    """Move every entry of ``staging`` into the existing ``target``; each file lands whole (os.replace).

    Weights go first, so a kill in between pairs new weights with the previous config, never the reverse.
    """
    fsync_tree(staging)
    entries = sorted(staging.iterdir(), key=lambda p: (p.name not in _WEIGHT_FILES and not p.suffix == ".safetensors",
                                                       p.name))
    for entry in entries:
        destination = target / entry.name
        if entry.is_dir():
            if destination.exists():
                publish_directory(entry, destination)
            else:
                os.rename(entry, destination)
        else:
            os.replace(entry, destination)
    _fsync_path(target, directory=True)
    shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Write into the yielded folder; on success it becomes ``target`` in one step, on error it is removed.

    - ``target`` absent: the staging folder (beside it) is renamed to it;
    - ``target`` a folder of files only (an earlier save): swapped (``publish_directory``);
    - ``target`` holding sub-folders (e.g. ``output_dir`` with its checkpoints): staged inside it and each file
      replaced atomically, the sub-folders left alone.
    """
    target = Path(target)
    for folder in (target.parent, target):  # leftovers of an earlier, killed save to this target
        recover_interrupted(folder, only=target.name)
    merge = target.is_dir() and any(p.is_dir() and not p.name.startswith(".nbkit-") for p in target.iterdir())
    staging = new_staging_dir(target if merge else target.parent, target.name)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if merge:
        _replace_files(staging, target)
    else:
        publish_directory(staging, target)


def recover_interrupted(folder: str | os.PathLike, only: str | None = None) -> list[str]:
    """Clean what a kill left in ``folder``: staging folders are deleted (never complete), a swapped-out folder whose
    replacement never landed is put back. ``only``: just the leftovers of saves to that name. Returns what was done,
    for the log."""
    folder = Path(folder)
    done: list[str] = []
    if not folder.is_dir():
        return done
    for entry in sorted(folder.iterdir()):
        if not entry.is_dir() or not entry.name.startswith((STAGING_PREFIX, OLD_PREFIX)):
            continue
        name = entry.name.split("-", 3)[-1]  # ".nbkit-staging-<token>-<name>" / ".nbkit-old-<token>-<name>"
        if only is not None and name != only:
            continue
        if entry.name.startswith(STAGING_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed unfinished save {entry.name}")
        else:
            original = folder / name
            if original.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.rename(entry, original)
                done.append(f"restored {name} (its replacement was interrupted)")
    return done


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is.

    Complete = ``trainer_state.json`` parses (transformers writes it after the weights, optimizer and RNG states) and a
    weights file is present and not empty.
    """
    path = Path(path)
    state = path / "trainer_state.json"
    if not state.is_file():
        return "no trainer_state.json (the save did not finish)"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError) as error:
        return f"trainer_state.json unreadable ({type(error).__name__})"
    weights = [path / name for name in _WEIGHT_FILES if (path / name).is_file()]
    weights += [p for p in path.glob("*/adapter_model.safetensors")]  # several adapters: one folder each
    if not weights:
        return "no model or adapter weights"
    if any(p.stat().st_size == 0 for p in weights):
        return "an empty weights file"
    return None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """``checkpoint-N`` folders of ``output_dir``, oldest step first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def last_complete_checkpoint(output_dir: str | os.PathLike, skipped: list[tuple[str, str]] | None = None) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir`` (None if there is none). Newer incomplete ones are
    appended to ``skipped`` as (path, reason)."""
    for path in reversed(list_checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        if skipped is not None:
            skipped.append((str(path), problem))
    return None


def skip_summary(events: Sequence[NonFiniteLoss]) -> str:
    """One line for the end of training: the optimizer steps ``on_nonfinite_loss="skip"`` stepped over."""
    steps = sorted({e.step for e in events})
    return f"nbkit: skipped {len(steps)} optimizer step(s) with a non-finite loss: steps {_short(steps)}"
