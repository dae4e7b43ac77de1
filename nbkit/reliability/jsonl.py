"""``load_jsonl``: the user's own JSON Lines file as a ``datasets.Dataset``, checked first so that a mistake in the
file is named by the file and the line.

Why: ``datasets.load_dataset("json", data_files=path, split="train")``, the usual way to read such a file, fails on
an empty file with a bare ``StopIteration`` from inside its JSON builder, on a blank one with 'Instruction "train"
corresponds to no data!', and on a bad line with ``DatasetGenerationError`` (the line number only in a log line
above the trace). None of these reach nbkit's checks of the dataset (``guards``), which start from a ``Dataset``.

Contract of ``load_jsonl(path, **load_dataset_kwargs)``:

- ``FileNotFoundError`` when ``path`` is not a file;
- ``InputError`` (a ``ValueError``, from ``guards``) when the file is not UTF-8 text, holds nothing but whitespace,
  holds one JSON array (JSON, not JSON Lines), or has a line that is not valid JSON or not a JSON object: the
  first such line, by its number as an editor counts it (from 1, blank lines included);
- otherwise what ``datasets.load_dataset("json", data_files=str(path), split="train", **load_dataset_kwargs)``
  returns (``cache_dir=`` and the like go there). Blank lines are allowed, as ``datasets`` skips them.

The rows are not checked against a format here: ``FastSFT`` does that (``guards.validate_training_inputs``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .guards import InputError

__all__ = ["load_jsonl"]

_LINE_EXAMPLES = ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]} '
                  'or {"prompt": "Hi", "completion": "Hello!"}')
_SHOWN = 80  # characters of a bad line quoted in the message


def _article(value: Any) -> str:
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _quote(line: str) -> str:
    line = line.strip()
    return repr(line[:_SHOWN] + ("..." if len(line) > _SHOWN else ""))


def _json_array(text: str) -> bool:
    try:
        return isinstance(json.loads(text), list)
    except ValueError:
        return False


def check_jsonl(path: str | os.PathLike) -> int:
    """Raise (see the module docstring) unless ``path`` is a JSON Lines file of objects; return how many it holds."""
    name = os.fspath(path)
    file = Path(path).expanduser()
    if not file.is_file():
        what = "a folder, not a file" if file.is_dir() else "no such file"
        raise FileNotFoundError(f"{what}: {name} (looked for from {os.getcwd()})")
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark is allowed, as datasets allows it
    except UnicodeDecodeError as error:
        raise InputError(f"{name} is not UTF-8 text ({error}): save it as UTF-8, one JSON object per line") from None
    rows = 0
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problem = None if isinstance(row, dict) else f"is {_article(row)}, not a JSON object"
        except ValueError as error:
            problem = f"is not valid JSON ({getattr(error, 'msg', error)} at column {getattr(error, 'colno', '?')})"
        if problem is not None:
            if rows == 0 and _json_array(text):
                raise InputError(
                    f"{name} holds one JSON array, not JSON Lines: write one JSON object per line instead (or load "
                    "it with json.load and datasets.Dataset.from_list)"
                )
            raise InputError(f"{name} line {number} {problem}: {_quote(line)}. Each line must be one JSON object, "
                             f"e.g. {_LINE_EXAMPLES}")
        rows += 1
    if rows == 0:
        raise InputError(f"{name} is empty: add one JSON object per line, e.g. {_LINE_EXAMPLES}")
    return rows


def load_jsonl(path: str | os.PathLike, **load_dataset_kwargs: Any) -> Any:
    """The JSON Lines file ``path`` as a ``datasets.Dataset``, after ``check_jsonl`` (see the module docstring)."""
    from datasets import load_dataset

    check_jsonl(path)
    return load_dataset("json", data_files=str(Path(path).expanduser()), split="train", **load_dataset_kwargs)
