"""Checks of datasets and settings before training starts, each failing with an ``InputError`` that names the row
or the setting and says what to do.

Why: TRL prepares datasets inside ``Dataset.map``; a bad row there fails with a stack trace from the tokenizer or
the chat template (or, worse, not at all: a ``None`` message content renders as the text "None", a chat without an
assistant turn trains on nothing, ``completion_only_loss=True`` on plain text trains on everything). These checks run
first, on the raw rows, with messages a notebook user can act on.

Contract: ``validate_training_inputs`` (called by ``FastSFT`` before ``SFTTrainer.__init__``; off with
``validate_inputs=False``) raises ``InputError`` (a ``ValueError``) on the inputs below. Where TRL itself raises an
error of another type for the same input, nbkit's is also of that type (a subclass of both), so code that catches
TRL's error catches nbkit's: ``DatasetTypeError`` (a ``TypeError``) for a train_dataset that is no ``Dataset`` or
``IterableDataset`` (a ``DatasetDict`` of splits: "pass dataset['train']"), ``ColumnError`` (a ``KeyError``) for
missing columns, ``AssistantTurnError`` (a ``RuntimeError``) for a chat with no assistant turn under
``assistant_only_loss=True``. Where TRL fails by accident of its code (``StopIteration`` on an empty dataset, an
``AttributeError`` or a template error on a bad row), the error is an ``InputError`` raised before TRL's.

- a train_dataset that is not one dataset (a ``DatasetDict`` / dict of splits, a list);
- an empty dataset; a dataset without the columns of a format TRL reads (``text`` / ``dataset_text_field``,
  ``messages``, ``prompt`` + ``completion``, ``input_ids``);
- a row whose field is missing or not a string (or, for chats, not a list of ``{"role", "content"}`` messages with
  string content), naming the row index and the field;
- a chat without an assistant turn under ``assistant_only_loss=True``, or a conversational completion without one
  when training on completions;
- chats in ShareGPT form that TRL would pass on unconverted (roles ``human`` / ``gpt``, ``from``/``value`` keys
  outside a ``conversations`` column), naming the rows and ``from_sharegpt``, which converts them;
- rows with nothing to learn: an empty (or blank) text, an empty completion when training on completions, chats
  whose assistant turns are all empty under ``assistant_only_loss=True``. Every checked row empty: an error (the
  run would train to loss 0 with zero gradients); some: a warning naming them and how to drop them;
- conversational data and a tokenizer without a chat template;
- ``max_length`` that is no length (``nbkit.settings.length_problem``; a plain ``SFTConfig`` does not check it),
  or shorter than the shortest document (every document would be cut: an error), or shorter than some documents
  (a warning naming the rows that will be cut and how to keep them), checked on up to ``LENGTH_SAMPLE`` rows
  spread over the dataset;
- switch combinations that cannot work together (the rules of ``nbkit.settings.combination_problem``: packing
  with a custom collator, ``completion_only_loss=True`` without prompt/completion data, an attention kernel or
  offloading that could never be used).

A batch whose labels all end up masked anyway (e.g. an answer cut away by ``max_length``) is caught during training,
by ``nbkit.reliability.trainer_mixin``.

Every row of a ``Dataset`` is checked for structure (column-wise, in slices); an ``IterableDataset`` is checked on
its first ``ITERABLE_ROWS`` rows (it cannot be read twice for free).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..settings import combination_problem, length_problem
from .sharegpt import from_sharegpt, sharegpt_form

__all__ = ["InputError", "DatasetTypeError", "ColumnError", "AssistantTurnError", "DataFormat", "detect_format",
           "validate_training_inputs", "from_sharegpt"]

ITERABLE_ROWS = 1000
LENGTH_SAMPLE = 2000
_SLICE = 1024
_ASSISTANT_ROLES = {"assistant", "model"}  # "model": Gemma style
_SHOWN = 10  # rows named in a message


logger = logging.getLogger(__name__)


class InputError(ValueError):
    """A dataset or setting that cannot train as intended; the message names the row or the setting."""


class DatasetTypeError(InputError, TypeError):
    """A train_dataset of a type TRL refuses with a ``TypeError`` (a ``DatasetDict`` of splits, a list)."""


class ColumnError(InputError, KeyError):
    """A dataset without the columns TRL reads (TRL fails with a ``KeyError`` naming the column)."""

    __str__ = BaseException.__str__  # KeyError's would quote the message


class AssistantTurnError(InputError, RuntimeError):
    """A chat with no assistant turn to train on under ``assistant_only_loss`` (TRL: a ``RuntimeError``)."""


def check_dataset_type(name: str, dataset: Any) -> None:
    """``DatasetTypeError`` unless ``dataset`` is one ``datasets.Dataset`` or ``IterableDataset``, as TRL requires of
    a train_dataset; a dict of splits is told which split to pass."""
    from datasets import Dataset, IterableDataset

    if isinstance(dataset, (Dataset, IterableDataset)):
        return
    kind = type(dataset).__name__
    if isinstance(dataset, dict):
        splits = list(dataset)
        split = "train" if "train" in splits else (splits[0] if splits else "train")
        raise DatasetTypeError(f"{name} is a {kind} of splits {splits}, not one dataset: pass dataset[{split!r}] "
                               "(one split, a datasets.Dataset or IterableDataset)")
    raise DatasetTypeError(f"{name} must be a datasets.Dataset or IterableDataset, got a {kind}"
                           + (": build one with datasets.Dataset.from_list(rows)" if isinstance(dataset, list) else ""))


@dataclass(frozen=True)
class DataFormat:
    """What TRL will read from a dataset, decided from its columns and first row the way TRL decides it."""

    kind: str  # "text" | "prompt_completion" | "messages" | "tokenized" | "formatted"
    conversational: bool
    fields: tuple[str, ...]  # the columns that hold the data

    @property
    def label(self) -> str:
        chat = "conversational " if self.conversational and self.kind != "messages" else ""
        return {"text": "language-modeling (text)", "prompt_completion": f"{chat}prompt-completion",
                "messages": "conversational (messages)", "tokenized": "pre-tokenized (input_ids)",
                "formatted": "formatting_func"}[self.kind]


def _describe(value: Any) -> str:
    if value is None:
        return "missing (None)"
    text = repr(value)
    return f"a {type(value).__name__} ({text[:40]}{'...' if len(text) > 40 else ''})"


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def _row_list(rows: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in rows[:_SHOWN])
    return f"{'row' if len(rows) == 1 else 'rows'} {shown}{', ...' if len(rows) > _SHOWN else ''}"


# --------------------------------------------------------------------------------------------------------------------
# Reading rows
# --------------------------------------------------------------------------------------------------------------------
def _is_map_style(dataset: Any) -> bool:
    from datasets import Dataset

    return isinstance(dataset, Dataset)


def _columns(dataset: Any) -> list[str]:
    names = getattr(dataset, "column_names", None)
    if names is None:  # an IterableDataset of unknown features: read one row
        first = next(iter(dataset), None)
        names = list(first) if isinstance(first, dict) else []
    return list(names)


def _rows(dataset: Any, columns: list[str], limit: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, row) pairs with only ``columns``; map-style datasets are read in column slices (fast), iterable ones
    row by row up to ``limit``."""
    if _is_map_style(dataset):
        view = dataset.select_columns(columns).with_format(None)
        n = len(view) if limit is None else min(limit, len(view))
        for start in range(0, n, _SLICE):
            chunk = view[start : min(n, start + _SLICE)]
            for j in range(len(chunk[columns[0]])):
                yield start + j, {c: chunk[c][j] for c in columns}
    else:
        for i, row in enumerate(dataset):
            if limit is not None and i >= limit:
                break
            yield i, {c: row.get(c) for c in columns}


def _first_row(name: str, dataset: Any) -> dict[str, Any]:
    if dataset is None:
        raise InputError(f"{name} is None: pass a datasets.Dataset (or IterableDataset) of training examples")
    if _is_map_style(dataset):
        if len(dataset) == 0:
            raise InputError(f"{name} is empty (0 rows): there is nothing to train on. Check the split and any "
                             "filter applied before it")
        return dataset.with_format(None)[0]
    try:
        return next(iter(dataset))
    except StopIteration:
        raise InputError(f"{name} is empty (it yields no rows): check the source and any filter") from None


# --------------------------------------------------------------------------------------------------------------------
# Format
# --------------------------------------------------------------------------------------------------------------------
def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and ("role" in value[0]
                                                                                       or "from" in value[0])


def _from_value(chat: Any) -> bool:
    """TRL's test for a ShareGPT chat it converts: a list whose first turn has "from" and "value"."""
    return isinstance(chat, list) and bool(chat) and isinstance(chat[0], dict) and {"from", "value"} <= set(chat[0])


def detect_format(name: str, dataset: Any, args: Any = None, formatting_func: Callable | None = None) -> DataFormat:
    """The format TRL will read ``dataset`` as; ``InputError`` when it has none of the expected columns."""
    first = _first_row(name, dataset)
    columns = _columns(dataset) or list(first)
    text_field = _arg(args, "dataset_text_field", "text") or "text"
    if "input_ids" in columns:
        return DataFormat("tokenized", False, ("input_ids",))
    if formatting_func is not None:
        return DataFormat("formatted", False, tuple(columns))
    if "prompt" in columns or "completion" in columns:
        if not ("prompt" in columns and "completion" in columns):
            missing = "completion" if "prompt" in columns else "prompt"
            raise ColumnError(f"{name} has a '{'prompt' if missing == 'completion' else 'completion'}' column but no "
                             f"'{missing}' column: prompt-completion data needs both (columns: {columns})")
        chat = _is_chat(first["prompt"]) or _is_chat(first["completion"])
        return DataFormat("prompt_completion", chat, ("prompt", "completion"))
    if "messages" in columns:
        return DataFormat("messages", True, ("messages",))
    if "conversations" in columns and (text_field not in columns or _from_value(first.get("conversations"))):
        # ShareGPT: TRL converts {"from", "value"} to {"role", "content"}; other chats there it leaves, reading the
        # text field when there is one (Unsloth's recipes keep standardized chats beside the text they render)
        return DataFormat("messages", True, ("conversations",))
    if text_field in columns:
        return DataFormat("text", False, (text_field,))
    raise ColumnError(
        f"{name} has columns {columns}, none of which TRL reads. Expected one of: '{text_field}' (plain text; "
        "or set dataset_text_field), 'messages' (chats), 'prompt' + 'completion', or 'input_ids' (pre-tokenized); "
        "or pass formatting_func to build the text from your columns"
    )


# --------------------------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------------------------
def _message_problem(message: Any) -> str | None:
    if not isinstance(message, dict):
        return f"is {_describe(message)}, not a {{'role', 'content'}} dict"
    role = message.get("role", message.get("from"))
    if not isinstance(role, str) or not role:
        return f"has role {_describe(role)}"
    content = message.get("content", message.get("value"))
    if isinstance(content, str):
        return None
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return None  # structured content parts ({"type": "text", "text": ...}); the chat template renders them
    if content is None and message.get("tool_calls"):
        return None  # an assistant turn that only calls tools
    return f"({role}) has content {_describe(content)}; expected a string"


def _chat_problem(chat: Any, *, needs_assistant: bool) -> str | None:
    if not isinstance(chat, list) or not chat:
        what = "an empty list" if isinstance(chat, list) else _describe(chat)
        return f"is {what}; expected a non-empty list of messages"
    for j, message in enumerate(chat):
        problem = _message_problem(message)
        if problem:
            return f"message {j} {problem}"
    if needs_assistant:
        roles = [m.get("role", m.get("from")) for m in chat]
        if not any(r in _ASSISTANT_ROLES for r in roles):
            return f"has no assistant turn (roles: {roles}), so there is nothing to train on"
    return None


def _blank(value: Any) -> bool:
    """An empty answer: a blank string, or structured content whose text parts are all blank."""
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return all(isinstance(p, dict) and not str(p.get("text") or "").strip() for p in value)
    return value is None


def _answers_blank(chat: list[dict[str, Any]]) -> bool:
    """Every assistant turn of ``chat`` is empty (a turn that calls tools is not)."""
    turns = [m for m in chat if m.get("role", m.get("from")) in _ASSISTANT_ROLES]
    return bool(turns) and all(_blank(m.get("content", m.get("value"))) and not m.get("tool_calls") for m in turns)


def check_rows(name: str, dataset: Any, fmt: DataFormat, args: Any = None,
               formatting_func: Callable | None = None) -> None:
    """Structure and types of every row (the first ``ITERABLE_ROWS`` of an IterableDataset), ShareGPT form, and
    rows with nothing to learn."""
    limit = None if _is_map_style(dataset) else ITERABLE_ROWS
    assistant_only = bool(_arg(args, "assistant_only_loss", False))
    completion_only = _arg(args, "completion_only_loss", None) is not False
    if fmt.kind == "formatted":
        for i, row in _rows(dataset, list(fmt.fields), limit=16):
            out = formatting_func(row)
            if not isinstance(out, str):
                raise InputError(f"formatting_func returned {_describe(out)} for {name} row {i}; it must return "
                                 "one string per row")
        return
    sharegpt: dict[str, list[int]] = {}  # what TRL would not convert -> rows
    blank: list[int] = []  # rows with nothing to learn
    seen = 0
    for i, row in _rows(dataset, list(fmt.fields), limit=limit):
        seen += 1
        where = f"{name} row {i}"
        if fmt.kind == "tokenized":
            ids = row["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                what = _describe(ids) if not isinstance(ids, list) else "not a non-empty list of ints"
                raise InputError(f"{where}: 'input_ids' is {what}")
        elif fmt.kind == "text":
            value = row[fmt.fields[0]]
            if not isinstance(value, str):
                raise InputError(f"{where}: '{fmt.fields[0]}' is {_describe(value)}; expected a string")
            if not value.strip():
                blank.append(i)
        elif fmt.kind == "messages":
            chat = row[fmt.fields[0]]
            form = sharegpt_form(fmt.fields[0], chat)
            if form:
                _note(sharegpt, form, i)
                continue  # its roles and keys are checked again once converted
            problem = _chat_problem(chat, needs_assistant=assistant_only)
            if problem:
                hint = " (assistant_only_loss=True trains on assistant turns only)" if "assistant" in problem else ""
                raise _row_error(problem)(f"{where}: '{fmt.fields[0]}' {problem}{hint}")
            if assistant_only and _answers_blank(chat):
                blank.append(i)
        else:  # prompt_completion
            for key in ("prompt", "completion"):
                value = row[key]
                if fmt.conversational:
                    form = sharegpt_form(key, value)
                    if form:
                        _note(sharegpt, form, i)
                        continue
                    needs = key == "completion" and (completion_only or assistant_only)
                    problem = _chat_problem(value, needs_assistant=needs)
                    if problem:
                        hint = " (training on completions needs one)" if "assistant" in problem else ""
                        raise _row_error(problem)(f"{where}: '{key}' {problem}{hint}")
                    if needs and _answers_blank(value):
                        blank.append(i)
                elif not isinstance(value, str):
                    raise InputError(f"{where}: '{key}' is {_describe(value)}; expected a string")
                elif key == "completion" and completion_only and not value.strip():
                    blank.append(i)
    if sharegpt:
        _raise_sharegpt(name, sharegpt, seen)
    if blank:
        _report_blank(name, fmt, blank, seen, checked_all=limit is None)


def _row_error(problem: str) -> type[InputError]:
    return AssistantTurnError if problem.startswith("has no assistant turn") else InputError


def _note(found: dict[str, list[int]], form: str, row: int) -> None:
    rows = found.setdefault(form, [])
    if not rows or rows[-1] != row:  # prompt and completion of one row: named once
        rows.append(row)


def _raise_sharegpt(name: str, found: dict[str, list[int]], seen: int) -> None:
    parts = [f"{form} in {_row_list(rows)}" for form, rows in found.items()]
    count = len({r for rows in found.values() for r in rows})
    raise InputError(
        f"{name} holds ShareGPT chats that TRL would pass on unconverted ({count} of {seen} checked rows: "
        f"{'; '.join(parts)}): the chat template would render unknown roles or miss the content, and "
        "assistant_only_loss=True would find no assistant turn. Convert them first: "
        f"`from nbkit.reliability import from_sharegpt; {name} = from_sharegpt({name})` (human -> user, "
        "gpt -> assistant, from/value -> role/content, a 'messages' column)"
    )


def _report_blank(name: str, fmt: DataFormat, rows: list[int], seen: int, checked_all: bool) -> None:
    """Every checked row blank: ``InputError``; some: one warning naming them and how to drop them."""
    field = fmt.fields[0]
    answers = "each teaches the model to answer with nothing"
    if fmt.kind == "text":
        what, harm = f"an empty '{field}'", "each trains on nothing but the end-of-text token"
        keep = f"lambda row: row[{field!r}].strip() != ''"
    elif fmt.kind == "messages":
        what, harm = "only empty assistant turns", answers
        keep = (f"lambda row: any(m['content'].strip() for m in row[{field!r}] if m['role'] == 'assistant')")
    elif fmt.conversational:
        what, harm = "an empty completion", answers
        keep = "lambda row: any(m['content'].strip() for m in row['completion'] if m['role'] == 'assistant')"
    else:
        what, harm = "an empty completion", answers
        keep = "lambda row: row['completion'].strip() != ''"
    if len(rows) == seen:
        scope = "every row" if checked_all else f"each of the first {seen} rows"
        nothing = ("the loss would be 0, the gradients 0" if fmt.kind == "text" else
                   "only end-of-turn tokens would train: the model would learn to answer with nothing")
        raise InputError(
            f"{scope} of {name} has {what}: there is nothing to train on ({nothing}). Check which column holds the "
            "data (dataset_text_field for plain text) and what the preprocessing left in it; validate_inputs=False "
            "skips this check"
        )
    scope = f"{len(rows)} of {seen} rows" if checked_all else f"{len(rows)} of the first {seen} rows"
    logger.warning("nbkit: %s of %s have %s (%s): %s. Drop them before training: %s = %s.filter(%s)",
                   scope, name, what, _row_list(rows), harm, name, name, keep)


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer and lengths
# --------------------------------------------------------------------------------------------------------------------
def check_chat_template(name: str, fmt: DataFormat, processing_class: Any, args: Any = None) -> None:
    if not fmt.conversational or processing_class is None or _arg(args, "chat_template_path") is not None:
        return
    if getattr(processing_class, "chat_template", None) is None:
        raise InputError(
            f"{name} is {fmt.label} but the tokenizer ({type(processing_class).__name__}) has no chat template, so "
            "the messages cannot be rendered. Load the tokenizer of an instruct/chat model, set "
            "tokenizer.chat_template, or pass chat_template_path= in the config"
        )


def _length(row: dict[str, Any], fmt: DataFormat, tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token", None) or ""
    if fmt.kind == "tokenized":
        return len(row["input_ids"])
    if fmt.kind == "text":
        text = row[fmt.fields[0]]
        return len(tokenizer(text=text if text.endswith(eos) else text + eos)["input_ids"])
    if fmt.kind == "messages":
        return len(tokenizer.apply_chat_template(row[fmt.fields[0]], tokenize=True, return_dict=True)["input_ids"])
    if fmt.conversational:
        chat = list(row["prompt"]) + list(row["completion"])
        return len(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
    text = row["prompt"] + row["completion"]
    return len(tokenizer(text=text if text.endswith(eos) else text + eos)["input_ids"])


def _sample_indices(n: int, k: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})  # evenly spread, first and last included


def check_max_length(name: str, dataset: Any, fmt: DataFormat, args: Any, tokenizer: Any) -> None:
    """``max_length`` must be a length (``nbkit.settings.length_problem``: a plain ``SFTConfig`` does not check it)
    and not shorter than every document (they would all be cut)."""
    max_length = _arg(args, "max_length")
    problem = length_problem("max_length", max_length)
    if problem is not None:
        raise InputError(problem)
    if max_length is None or tokenizer is None or fmt.kind == "formatted":
        return
    splitting = ("bfd_split", "bfd-requeue", "wrapped")
    if _arg(args, "packing", False) and _arg(args, "packing_strategy", "bfd") in splitting:
        return  # these strategies split long documents instead of cutting them
    if _is_map_style(dataset):
        picks = _sample_indices(len(dataset), LENGTH_SAMPLE)
        view = dataset.select_columns(list(fmt.fields)).with_format(None)
        rows = ((i, view[i]) for i in picks)
        checked = f"{len(picks)} of {len(dataset)} rows checked"
    else:
        rows = _rows(dataset, list(fmt.fields), limit=LENGTH_SAMPLE)
        checked = f"the first {LENGTH_SAMPLE} rows checked"
    long_rows: list[tuple[int, int]] = []  # (row, tokens) of documents longer than max_length
    seen = 0
    for i, row in rows:
        try:
            n = _length(row, fmt, tokenizer)
        except Exception:  # tokenization problems surface in TRL's preparation with its own message
            return
        seen += 1
        if n > max_length:
            long_rows.append((i, n))
    if not long_rows:
        return
    if len(long_rows) < seen:
        # Some documents fit: the setting is plausible, but say what will be cut instead of cutting silently.
        shown = ", ".join(f"row {i} ({n} tokens)" for i, n in long_rows[:5])
        logger.warning(
            "nbkit: %d of %d checked rows of %s are longer than max_length=%d (%s%s) and will be cut to their first "
            "%d tokens. Raise max_length, or with packing=True use packing_strategy='bfd_split' to keep every token.",
            len(long_rows), seen, name, max_length, shown, ", ..." if len(long_rows) > 5 else "", max_length,
        )
        return
    shortest = min(long_rows, key=lambda r: r[1])
    split = " or, with packing=True, packing_strategy='bfd_split' to split long documents instead of cutting them;"
    raise InputError(
        f"max_length={max_length} is shorter than every document of {name} (the shortest, row {shortest[0]}, has "
        f"{shortest[1]} tokens; {checked}): every document would be cut to its first {max_length} tokens"
        f"{' and its completion or assistant turn may be cut away' if fmt.kind != 'text' else ''}. Raise max_length;"
        f"{split} validate_inputs=False skips this check"
    )


# --------------------------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------------------------
def check_settings(args: Any, *, custom_collator: bool, fmt: DataFormat | None = None) -> None:
    """Switch combinations that cannot work together (``nbkit.settings.combination_problem``)."""
    problem = combination_problem(args, custom_collator=custom_collator, data_format=fmt)
    if problem is not None:
        raise InputError(problem)


# --------------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------------
def validate_training_inputs(
    args: Any,
    train_dataset: Any,
    eval_dataset: Any = None,
    processing_class: Any = None,
    data_collator: Any = None,
    formatting_func: Callable | None = None,
) -> DataFormat:
    """Every check above, on the training dataset and each evaluation dataset; returns the training data's format."""
    check_dataset_type("train_dataset", train_dataset)
    skip_prepare = bool((_arg(args, "dataset_kwargs") or {}).get("skip_prepare_dataset", False))
    datasets: list[tuple[str, Any]] = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, dict):
        datasets += [(f"eval_dataset[{key!r}]", value) for key, value in eval_dataset.items()]
    elif eval_dataset is not None:
        datasets.append(("eval_dataset", eval_dataset))
    train_format: DataFormat | None = None
    for name, dataset in datasets:
        fmt = detect_format(name, dataset, args, formatting_func)
        if skip_prepare and fmt.kind != "tokenized":
            raise InputError(f"dataset_kwargs={{'skip_prepare_dataset': True}} needs a tokenized {name} "
                             f"('input_ids' column); it is {fmt.label}")
        if train_format is None:
            train_format = fmt
            check_settings(args, custom_collator=data_collator is not None, fmt=fmt)
        check_rows(name, dataset, fmt, args, formatting_func)
        check_chat_template(name, fmt, processing_class, args)
        if not skip_prepare:
            check_max_length(name, dataset, fmt, args, processing_class)
    return train_format
