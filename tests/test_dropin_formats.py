"""The drop-in contract, data side: every dataset format, packing strategy, padding-free batches, completion-only and
assistant-only loss, and chat templates behave under FastSFT as under SFTTrainer.

Each test runs one behaviour through both trainers (``tests/dropin.py``) and asserts the same outcome: both train
(every trainable parameter changed), to the same per-step losses within ``dropin.LOSS_TOL`` (1e-5 relative, fp32 on
a CPU), or both raise the same error.
"""

from __future__ import annotations

import pytest
from dropin import TOOLS_TEMPLATE, assert_same_outcome, assert_trains, both, dataset, tokenizer

FORMATS = ["text", "prompt", "messages", "conversational_prompt", "tools"]


def _tok_for(fmt: str):
    return (lambda: tokenizer("tools")) if fmt == "tools" else tokenizer


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_dataset_format_trains_to_the_same_losses(one_thread, tmp_path, fmt, packing):
    """Language modeling, prompt-completion (completion-only loss by default), conversational, conversational
    prompt-completion and conversations with tool calls (a ``tools`` column as JSON), packed or not."""
    plain, fast = both(tmp_path, data=lambda: dataset(fmt), tok=_tok_for(fmt), packing=packing,
                       max_length=128 if fmt == "tools" else 64)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_tool_call_rows_render_their_tools_and_calls(one_thread, tmp_path):
    """The tool-call format is really read as such: the prepared rows hold the tool's schema and the call."""
    plain, fast = both(tmp_path, data=lambda: dataset("tools"), tok=lambda: tokenizer("tools"), max_length=256,
                       train=False)
    for outcome in (plain, fast):
        assert outcome.error is None, outcome.why()
        text = outcome.trainer.processing_class.decode(outcome.trainer.train_dataset[0]["input_ids"])
        assert '"reverse_words"' in text and "<tool_call>" in text, text
    assert plain.trainer.train_dataset[:]["input_ids"] == fast.trainer.train_dataset[:]["input_ids"]


@pytest.mark.parametrize("fmt", ["text", "messages"])
def test_streaming_dataset_trains_alike(one_thread, tmp_path, fmt):
    """An ``IterableDataset`` (``streaming=True``), with max_steps; conversational rows with assistant-only loss."""
    settings = {"assistant_only_loss": True} if fmt == "messages" else {}
    plain, fast = both(tmp_path, data=lambda: dataset(fmt).to_iterable_dataset(), **settings)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_packing_strategies_train_alike(one_thread, tmp_path, strategy):
    plain, fast = both(tmp_path, data=lambda: dataset("text", n=32), packing=True, packing_strategy=strategy,
                       max_length=48)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_padding_free_without_packing_trains_alike(one_thread, tmp_path):
    """``padding_free=True`` without packing (``max_length=None``: TRL does not enforce it there)."""
    plain, fast = both(tmp_path, data=lambda: dataset("messages"), padding_free=True, max_length=None)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_padding_free_with_max_length_and_no_packing_fails_alike(tmp_path):
    plain, fast = both(tmp_path, padding_free=True, max_length=32, train=False)
    assert_same_outcome(plain, fast, names=("max_length",))


@pytest.mark.parametrize("completion_only", [True, False])
@pytest.mark.parametrize("fmt", ["prompt", "conversational_prompt"])
def test_completion_only_loss_on_and_off_trains_alike(one_thread, tmp_path, fmt, completion_only):
    plain, fast = both(tmp_path, data=lambda: dataset(fmt), completion_only_loss=completion_only)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_completion_only_loss_masks_the_same_labels(tmp_path):
    """The prepared rows (ids and completion masks) are the same: the loss covers the same tokens."""
    plain, fast = both(tmp_path, data=lambda: dataset("prompt"), completion_only_loss=True, train=False)
    assert plain.error is None and fast.error is None, (plain.why(), fast.why())
    assert plain.trainer.train_dataset[:] == fast.trainer.train_dataset[:]


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_assistant_only_loss_trains_alike(one_thread, tmp_path, packing):
    plain, fast = both(tmp_path, data=lambda: dataset("messages"), assistant_only_loss=True, packing=packing)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_assistant_only_and_completion_only_together_train_alike(one_thread, tmp_path):
    """Conversational prompt-completion whose completion also holds a user turn: both masks apply."""

    def data():
        def grow(row):
            return {"completion": row["completion"] + row["prompt"] + row["completion"]}

        return dataset("conversational_prompt").map(grow)

    plain, fast = both(tmp_path, data=data, assistant_only_loss=True, completion_only_loss=True)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_assistant_only_loss_on_text_data_fails_alike(tmp_path):
    plain, fast = both(tmp_path, data=lambda: dataset("text"), assistant_only_loss=True, train=False)
    assert_same_outcome(plain, fast, names=("assistant_only_loss",))


def test_chat_template_path_is_used_and_saved_alike(one_thread, tmp_path):
    """A tokenizer without a chat template, ``chat_template_path`` to a .jinja file: both train on it and save it
    with each checkpoint, byte for byte."""
    plain, fast = both(tmp_path, data=lambda: dataset("messages"), tok=lambda: tokenizer(None),
                       chat_template_path=str(TOOLS_TEMPLATE), save_strategy="steps", save_steps=3)
    assert_trains(plain)
    assert_same_outcome(plain, fast)
    for outcome in (plain, fast):
        saved = tmp_path / outcome.kind / "checkpoint-3" / "chat_template.jinja"
        assert saved.is_file(), f"{outcome.kind}: no {saved.name} in checkpoint-3"
        assert saved.read_text() == TOOLS_TEMPLATE.read_text(), f"{outcome.kind}: another template saved"


def test_chat_template_kwargs_column_applies_alike(tmp_path):
    """A ``chat_template_kwargs`` column reaches the template per row (TRL passes it to apply_chat_template)."""
    template = ("{%- for m in messages %}{{- '<|im_start|>' + (m['role'].upper() if shout else m['role']) + '\\n' + "
                "m['content'] + '<|im_end|>\\n' }}{%- endfor %}")

    def tok():
        t = tokenizer()
        t.chat_template = template
        return t

    def data():
        rows = dataset("messages", n=8)
        return rows.add_column("chat_template_kwargs", [{"shout": bool(i % 2)} for i in range(len(rows))])

    plain, fast = both(tmp_path, data=data, tok=tok, train=False)
    assert plain.error is None and fast.error is None, (plain.why(), fast.why())
    rows = plain.trainer.train_dataset[:]["input_ids"]
    assert rows == fast.trainer.train_dataset[:]["input_ids"]
    decoded = [plain.trainer.processing_class.decode(r) for r in rows[:2]]
    assert "<|im_start|>user" in decoded[0] and "<|im_start|>USER" in decoded[1], decoded


def test_pretokenized_rows_train_alike(one_thread, tmp_path):
    """A dataset of ``input_ids`` (TRL skips its tokenization and trains on them as they are)."""

    def data():
        tok = tokenizer()
        return dataset("text").map(lambda row: {"input_ids": tok(row["text"])["input_ids"]}, remove_columns=["text"])

    plain, fast = both(tmp_path, data=data, packing=True)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_dataset_text_field_and_formatting_func_train_alike(one_thread, tmp_path):
    """Text in another column (``dataset_text_field``), and text built from other columns (``formatting_func``)."""
    rows = dataset("prompt")
    plain, fast = both(tmp_path, data=lambda: rows.map(lambda r: {"body": r["prompt"] + r["completion"]},
                                                       remove_columns=["prompt", "completion"]),
                       dataset_text_field="body")
    assert_trains(plain)
    assert_same_outcome(plain, fast)
    plain, fast = both(tmp_path / "formatted", data=lambda: rows.rename_columns({"prompt": "q", "completion": "a"}),
                       extra=lambda tok: {"formatting_func": lambda r: r["q"] + r["a"]})
    assert_trains(plain)
    assert_same_outcome(plain, fast)


def test_formatting_func_with_completion_only_loss_fails_alike(tmp_path):
    plain, fast = both(tmp_path, data=lambda: dataset("prompt"), completion_only_loss=True, train=False,
                       extra=lambda tok: {"formatting_func": lambda r: r["prompt"] + r["completion"]})
    assert_same_outcome(plain, fast, names=("formatting",))


def test_assistant_only_loss_with_an_unmarked_unknown_template_fails_alike(tmp_path):
    """A chat template without ``{% generation %}`` marks that TRL has no marked copy of."""

    def tok():
        t = tokenizer()
        t.chat_template = ("{%- for m in messages %}{{- '[' + m['role'] + '] ' + m['content'] + '<|im_end|>\\n' }}"
                           "{%- endfor %}")
        return t

    plain, fast = both(tmp_path, data=lambda: dataset("messages"), tok=tok, assistant_only_loss=True, train=False)
    assert plain.error is not None, "SFTTrainer accepted a template it cannot mark: the test expects its error"
    assert_same_outcome(plain, fast)
