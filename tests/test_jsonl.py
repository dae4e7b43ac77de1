"""``nbkit.load_jsonl``: the user's own JSON Lines file, checked before ``datasets`` reads it, so that an empty file,
a blank one or a bad line fails with the file and line named instead of ``StopIteration`` or a generation error
from inside ``datasets``. The file that passes loads as ``datasets.load_dataset("json", ...)`` loads it."""

from __future__ import annotations

import json
import re

import pytest

import nbkit
from nbkit.notebook import to_prompt_completion

ROWS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris"}]},
    {"messages": [{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "What colour is the sky?"},
                  {"role": "assistant", "content": "Blue"}]},
]


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("text", ["", "  \n\n\t\n"], ids=["empty", "whitespace-only"])
def test_an_empty_file_is_named_with_what_a_line_should_hold(tmp_path, text):
    path = _write(tmp_path / "mine.jsonl", text)
    with pytest.raises(ValueError) as caught:
        nbkit.load_jsonl(path, cache_dir=str(tmp_path / "cache"))
    message = str(caught.value)
    assert message.startswith(f"{path} is empty: add one JSON object per line, e.g. {{\"messages\": "), message
    assert '"prompt"' in message and '"completion"' in message


def test_a_line_that_is_not_json_is_named_by_its_number(tmp_path):
    lines = [json.dumps(ROWS[0]), "", json.dumps(ROWS[1]), '{"messages": [{"role": "user", "content": "hi"}']
    path = _write(tmp_path / "mine.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} line 4 is not valid JSON \(.*column \d+\): "):
        nbkit.load_jsonl(path, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("line,kind", [("[1, 2]", "a list"), ('"some text"', "a str"), ("3", "an int")])
def test_a_line_that_is_json_but_not_an_object_is_named(tmp_path, line, kind):
    path = _write(tmp_path / "mine.jsonl", json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} line 2 is {kind}, not a JSON object"):
        nbkit.load_jsonl(path, cache_dir=str(tmp_path / "cache"))


def test_a_json_array_file_is_told_apart_from_json_lines(tmp_path):
    path = _write(tmp_path / "mine.json", json.dumps(ROWS, indent=2))
    with pytest.raises(ValueError, match=r"holds one JSON array, not JSON Lines"):
        nbkit.load_jsonl(path, cache_dir=str(tmp_path / "cache"))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file: .*nowhere\.jsonl"):
        nbkit.load_jsonl(tmp_path / "nowhere.jsonl")


def test_a_good_file_loads_as_datasets_loads_it_and_as_the_notebook_trains_on_it(tmp_path):
    from datasets import load_dataset

    path = _write(tmp_path / "mine.jsonl", json.dumps(ROWS[0]) + "\n\n  \n" + json.dumps(ROWS[1]) + "\n\n")
    loaded = nbkit.load_jsonl(str(path), cache_dir=str(tmp_path / "cache"))
    plain = load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))
    assert loaded.to_list() == plain.to_list() == ROWS
    train = to_prompt_completion(loaded)
    assert train[1]["prompt"] == ROWS[1]["messages"][:-1] and train[1]["completion"] == ROWS[1]["messages"][-1:]


def test_a_prompt_completion_file_trains_as_it_is_and_other_columns_are_named(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Yo"}]}]
    path = _write(tmp_path / "pc.jsonl", json.dumps(rows[0]) + "\n")
    assert to_prompt_completion(nbkit.load_jsonl(path, cache_dir=str(tmp_path / "cache"))).to_list() == rows
    other = _write(tmp_path / "other.jsonl", json.dumps({"instruction": "Hi", "output": "Yo"}) + "\n")
    with pytest.raises(ValueError, match=r"columns \['instruction', 'output'\]: expected 'messages'"):
        to_prompt_completion(nbkit.load_jsonl(other, cache_dir=str(tmp_path / "cache")))
