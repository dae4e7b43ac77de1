"""Unsloth's trainer words over FastSFT, and ``train_on_responses_only``.

Why: Unsloth's recipes give the trainer ``tokenizer=``, ``dataset_text_field=``, ``max_seq_length=``, ``packing=``
and ``dataset_num_proc=`` (TRL moved these into ``SFTConfig``, ``max_seq_length`` as ``max_length``, and renamed
``tokenizer`` to ``processing_class``), then mask the prompts with ``train_on_responses_only``.

Contract:

- ``SFTTrainer(model=..., tokenizer=..., train_dataset=..., dataset_text_field=..., max_seq_length=...,
  packing=..., dataset_num_proc=..., args=SFTConfig(...), ...)`` is a ``FastSFT``: the trainer words are set on a
  copy of ``args`` (a ``FastSFTConfig`` is made when ``args`` is None), ``tokenizer`` is passed as
  ``processing_class``; every other argument is FastSFT's (TRL's). FastSFT itself is unchanged.
- ``SFTConfig`` is ``FastSFTConfig`` that also takes ``max_seq_length`` (TRL's ``max_length``).
- ``train_on_responses_only(trainer, instruction_part=None, response_part=None)`` rewrites the ``labels`` of the
  trainer's prepared (tokenized) datasets: a token counts in the loss only after a ``response_part`` and before the
  next ``instruction_part``, so the end of each answer (its stop token) is learned; multi-turn chats included, and in
  packed rows each sequence on its own. The parts are found by token ids, or by characters where they tokenize
  otherwise in context (markers the vocabulary lacks). Parts not given come from the tokenizer's chat template
  (``chat_templates.turn_markers``). TRL's collator (or the user's ``DataCollatorForSeq2Seq``) reads the dataset's
  labels, so training, packing and FastSFT's speedups see the masked ones. Rows where no response is found keep no
  label; a ``ValueError`` when no row has one (the parts do not occur in the data). Returns the trainer.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..config import FastSFTConfig
from ..trainer import FastSFT
from .chat_templates import turn_markers

logger = logging.getLogger(__name__)

IGNORE = -100


@dataclass
class SFTConfig(FastSFTConfig):
    """``FastSFTConfig`` that also reads Unsloth's ``max_seq_length`` (TRL's ``max_length``)."""

    max_seq_length: Optional[int] = field(default=None, metadata={"help": "Unsloth's name for max_length."})

    def __post_init__(self) -> None:
        if self.max_seq_length is not None:
            self.max_length = self.max_seq_length
        super().__post_init__()


# the trainer keywords Unsloth's recipes pass that TRL reads from the config: trainer name -> config field
_CONFIG_WORDS = {"dataset_text_field": "dataset_text_field", "max_seq_length": "max_length", "packing": "packing",
                 "dataset_num_proc": "dataset_num_proc", "dataset_kwargs": "dataset_kwargs"}


class SFTTrainer(FastSFT):
    """FastSFT that reads Unsloth's trainer words (module docstring)."""

    def __init__(self, model: Any = None, args: Any = None, data_collator: Any = None, *pargs: Any,
                 tokenizer: Any = None, **kwargs: Any) -> None:
        words = {name: kwargs.pop(name) for name in list(kwargs) if name in _CONFIG_WORDS}
        if tokenizer is not None:
            if kwargs.get("processing_class") is not None and kwargs["processing_class"] is not tokenizer:
                raise TypeError("SFTTrainer(): tokenizer= and processing_class= differ: give one")
            kwargs["processing_class"] = tokenizer
        if words:
            args = copy.copy(args) if args is not None else FastSFTConfig(output_dir="outputs")
            for name, value in words.items():
                setattr(args, _CONFIG_WORDS[name], value)
        super().__init__(model, args, data_collator, *pargs, **kwargs)


def _find(ids: Sequence[int], part: Sequence[int]) -> list[int]:
    """Start positions of ``part`` in ``ids``."""
    n = len(part)
    if not n:
        return []
    first = part[0]
    return [i for i in range(len(ids) - n + 1) if ids[i] == first and list(ids[i:i + n]) == list(part)]


def response_labels(ids: Sequence[int], instruction: Sequence[int], response: Sequence[int]) -> list[int]:
    """``ids`` as labels, ``IGNORE`` outside the responses (after a response part, before the next instruction)."""
    labels = [IGNORE] * len(ids)
    starts = sorted(_find(ids, instruction))
    for start in _find(ids, response):
        begin = start + len(response)
        end = next((s for s in starts if s >= begin), len(ids))
        labels[begin:end] = ids[begin:end]
    return labels


def _part_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_labels(pieces: Sequence[str], ids: Sequence[int], instruction: str, response: str) -> list[int]:
    """``response_labels`` by characters: ``pieces`` is each token's text. For markers the vocabulary lacks, which
    tokenize differently in context than alone; a token counts when it starts after a response part's last
    character and before the next instruction part."""
    text = "".join(pieces)
    starts, position = [], 0
    for piece in pieces:
        starts.append(position)
        position += len(piece)
    instructions = [i for i in range(len(text)) if text.startswith(instruction, i)]
    labels = [IGNORE] * len(ids)
    at = text.find(response)
    while at >= 0:
        begin = at + len(response)
        end = next((i for i in instructions if i >= begin), len(text))
        for k, start in enumerate(starts):
            if begin <= start < end:
                labels[k] = ids[k]
        at = text.find(response, begin)
    return labels


class _Masker:
    """Labels for one sequence: by token ids where the parts tokenize alike in context, else by characters."""

    def __init__(self, tokenizer: Any, instruction_part: str, response_part: str) -> None:
        self.tokenizer, self.instruction_part, self.response_part = tokenizer, instruction_part, response_part
        self.instruction = _part_ids(tokenizer, instruction_part)
        self.response = _part_ids(tokenizer, response_part)
        self.texts: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        if _find(ids, self.response):
            return response_labels(ids, self.instruction, self.response)
        pieces = [self.texts.setdefault(i, self.tokenizer.decode([i])) for i in ids]
        return text_labels(pieces, ids, self.instruction_part, self.response_part)


def train_on_responses_only(trainer: Any, instruction_part: Optional[str] = None,
                            response_part: Optional[str] = None, num_proc: Optional[int] = None) -> Any:
    """Mask the trainer's labels outside the responses (module docstring); returns ``trainer``."""
    tokenizer = getattr(trainer, "processing_class", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text tokenizer
    if instruction_part is None or response_part is None:
        found = turn_markers(getattr(tokenizer, "chat_template", None))
        if found is None:
            raise ValueError("train_on_responses_only: the tokenizer's chat template is none nbkit knows; pass "
                             "instruction_part= and response_part= (the text that opens a user turn and an "
                             "assistant turn)")
        instruction_part = instruction_part if instruction_part is not None else found[0]
        response_part = response_part if response_part is not None else found[1]
    masker = _Masker(tokenizer, instruction_part, response_part)

    def relabel(batch: dict[str, list]) -> dict[str, list]:
        lengths = batch.get("seq_lengths") or [[len(ids)] for ids in batch["input_ids"]]
        labels = []
        for ids, parts in zip(batch["input_ids"], lengths):  # packed rows: each sequence on its own
            row, start = [], 0
            for length in parts:
                row += masker(ids[start:start + length])
                start += length
            labels.append(row + masker(ids[start:]))
        return {"labels": labels}

    for attr in ("train_dataset", "eval_dataset"):
        dataset = getattr(trainer, attr, None)
        datasets = dataset if isinstance(dataset, dict) else {None: dataset}
        for key, data in list(datasets.items()):
            if data is None:
                continue
            if "input_ids" not in (data.column_names or []):
                raise ValueError(f"train_on_responses_only: the trainer's {attr} is not tokenized (no input_ids); "
                                 "build the trainer without skip_prepare_dataset")
            kwargs = {"num_proc": num_proc} if num_proc else {}
            datasets[key] = data.map(relabel, batched=True, **kwargs)
            _check(datasets[key], attr, instruction_part, response_part)
        setattr(trainer, attr, datasets if isinstance(dataset, dict) else datasets[None])
    return trainer


def _check(dataset: Any, what: str, instruction_part: str, response_part: str) -> None:
    empty = sum(1 for labels in dataset["labels"] if all(x == IGNORE for x in labels))
    if empty == len(dataset):
        raise ValueError(f"train_on_responses_only: no row of the {what} holds the response part {response_part!r} "
                         f"(instruction part {instruction_part!r}): check the chat template and the parts")
    if empty:
        logger.warning("train_on_responses_only: %d of %d rows of the %s have no response (all labels masked): "
                       "truncated before the answer, or without the response part", empty, len(dataset), what)
