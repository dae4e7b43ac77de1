"""Non-finite losses caught at the micro-batch they appear in, and batches with no token to train on, each named
by the rows of the user's dataset they came from.

Why: datasets are messy. A NaN loss must stop before it reaches the weights, with the rows that caused it; a batch
whose labels are all masked (an empty answer, an answer cut away by ``max_length``) trains on nothing and must not
pass unnoticed.

Contract (``ReliableTraining`` uses these; each also works on its own):

- ``NonFiniteLossError`` (a ``FloatingPointError``) carries a ``NonFiniteLoss``: the step, the micro-batch, the
  loss value, the batch's documents as row indices of the user's dataset, and which of them is non-finite on its
  own. ``MaskedBatch`` is the same account for a batch with no label to train on (a warning, not an error).
- ``batch_documents`` splits a collated batch into its documents (packed boundaries, attention mask or rows).
- ``DocumentLocator`` finds the rows only when asked (after a failure): the batch's documents are matched against
  the dataset re-tokenized once without packing, so the hot path and the batches are exactly TRL's (no id column
  travels through packing, which would drop it).
- ``skip_summary`` / ``masked_summary``: the one line logged at the end of training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The training loss was NaN or infinite; the message names the step and the batch's documents."""

    def __init__(self, message: str, event: NonFiniteLoss) -> None:
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
        return where_documents(self.rows, self.spans, documents)


def _short(values: Sequence[int], limit: int = 32) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def where_documents(rows: list[list[int]] | None, spans: list[tuple[int, int, int]],
                    documents: Sequence[int]) -> str:
    """Dataset rows of these documents (indices into ``spans``) when located, else their positions in the batch."""
    if rows is not None:
        found = sorted({r for d in documents for r in rows[d]})
        missing = sum(1 for d in documents if not rows[d])
        text = f"train_dataset rows {_short(found)}" if found else "no train_dataset row found"
        return text + (f" ({missing} not found)" if missing and found else "")
    chosen = [spans[d] for d in documents]
    shown = ", ".join(f"batch row {r} tokens {a}-{b}" for r, a, b in chosen[:8])
    return shown + (" ..." if len(chosen) > 8 else "")


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


def skip_summary(events: Sequence[NonFiniteLoss]) -> str:
    """One line for the end of training: the optimizer steps ``on_nonfinite_loss="skip"`` stepped over."""
    steps = sorted({e.step for e in events})
    return f"nbkit: skipped {len(steps)} optimizer step(s) with a non-finite loss: steps {_short(steps)}"


@dataclass
class MaskedBatch:
    """One micro-batch whose labels are all masked: it adds nothing to the gradient."""

    step: int
    micro_batch: int
    accumulation: int
    rows: list[list[int]] | None  # as NonFiniteLoss.rows
    spans: list[tuple[int, int, int]]

    def describe(self) -> str:
        at = f"step {self.step}" + (f" (micro-batch {self.micro_batch} of {self.accumulation})"
                                    if self.accumulation > 1 else "")
        return (f"{at} has no token to train on: every label of its {len(self.spans)} document(s) is masked "
                f"({where_documents(self.rows, self.spans, range(len(self.spans)))})")


def masked_advice() -> str:
    return ("Such rows add nothing to the gradient. Usual causes: max_length cutting the answer away (raise it, or "
            "with packing=True use packing_strategy='bfd_split'), or rows with an empty text or answer under "
            "assistant_only_loss / completion_only_loss (drop them with dataset.filter)")


def masked_summary(events: Sequence[MaskedBatch]) -> str:
    """One line for the end of training: the micro-batches that had no token to train on."""
    steps = sorted({e.step for e in events})
    return (f"nbkit: {len(events)} micro-batch(es) had no token to train on (every label masked): steps "
            f"{_short(steps)}. {masked_advice()}")
