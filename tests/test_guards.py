"""Bad datasets and settings fail before training with an error that names the row or the setting
(nbkit.reliability.guards); rows with nothing to learn are named in a warning, or an error when every row is empty.

Each case builds the smallest dataset that shows the problem and checks the message names what to fix; valid data
of every format passes; ``FastSFT`` runs the checks before TRL prepares anything, and ``validate_inputs=False``
turns them off.
"""

from __future__ import annotations

import logging

import pytest
from datasets import Dataset, IterableDataset
from trl import SFTConfig

from nbkit import FastSFT, FastSFTConfig
from nbkit.demo.data import make_dataset
from nbkit.reliability.guards import InputError, detect_format, validate_training_inputs


@pytest.fixture(scope="module")
def tokenizer():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def cfg(**kw) -> FastSFTConfig:
    base = dict(output_dir="unused", bf16=False, use_cpu=True, report_to=[], max_length=128, live_dashboard=False)
    return FastSFTConfig(**{**base, **kw})


def chat(*turns: tuple[str, object]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


def check(dataset, tokenizer, args=None, **kw):
    return validate_training_inputs(args or cfg(), dataset, processing_class=tokenizer, **kw)


# ---------------------------------------------------------------------------------------------------------------
# valid data passes


@pytest.mark.parametrize("fmt,kind", [("text", "text"), ("prompt", "prompt_completion"), ("messages", "messages")])
def test_valid_demo_data_passes(tokenizer, fmt, kind):
    args = cfg(assistant_only_loss=fmt == "messages", packing=True)
    assert check(make_dataset(fmt, n=64), tokenizer, args).kind == kind


def test_tool_calls_and_structured_content_pass(tokenizer):
    tools = [{"messages": [
        {"role": "user", "content": "weather?", "tool_calls": None},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "w"}}]},
        {"role": "assistant", "content": "sunny", "tool_calls": None},
    ]}]
    validate_training_inputs(cfg(max_length=None), Dataset.from_list(tools), processing_class=tokenizer)
    parts = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}]
    validate_training_inputs(cfg(max_length=None), Dataset.from_list(parts), processing_class=tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# datasets


def test_empty_dataset(tokenizer):
    with pytest.raises(InputError, match=r"train_dataset is empty \(0 rows\)"):
        check(Dataset.from_dict({"text": []}), tokenizer)

    def nothing():
        yield from ()

    with pytest.raises(InputError, match="train_dataset is empty"):
        check(IterableDataset.from_generator(nothing), tokenizer)


def test_no_expected_columns(tokenizer):
    with pytest.raises(InputError, match=r"columns \['question', 'answer'\].*'text'.*'messages'.*formatting_func"):
        check(Dataset.from_dict({"question": ["q"], "answer": ["a"]}), tokenizer)
    with pytest.raises(InputError, match="'prompt' column but no 'completion'"):
        check(Dataset.from_dict({"prompt": ["q"]}), tokenizer)
    # a custom text field is honoured
    check(Dataset.from_dict({"body": ["hello there"]}), tokenizer, cfg(dataset_text_field="body"))


def test_missing_and_non_string_fields_name_the_row(tokenizer):
    with pytest.raises(InputError, match=r"train_dataset row 2: 'text' is missing \(None\); expected a string"):
        check(Dataset.from_dict({"text": ["a b", "c d", None, "e"]}), tokenizer)
    with pytest.raises(InputError, match=r"row 0: 'text' is a int \(7\)"):
        check(Dataset.from_dict({"text": [7, 8]}), tokenizer)
    with pytest.raises(InputError, match=r"row 1: 'completion' is missing \(None\)"):
        check(Dataset.from_dict({"prompt": ["a", "b"], "completion": [" x", None]}), tokenizer)


def test_chat_content_must_be_text(tokenizer):
    rows = [{"messages": chat(("user", "hi"), ("assistant", "hello"))} for _ in range(3)]
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]})
    with pytest.raises(InputError, match=r"row 3: 'messages' message 1 \(assistant\) has content missing \(None\)"):
        check(Dataset.from_list(rows), tokenizer)
    with pytest.raises(InputError, match=r"row 0: 'messages' is an empty list"):
        check(Dataset.from_dict({"messages": [[], []]}), tokenizer)
    numbers = [{"messages": [{"role": "user", "content": "1"}]}, {"messages": [{"role": "user", "content": 5}]}]
    with pytest.raises(InputError, match=r"row 1: 'messages' message 0 \(user\) has content a int \(5\)"):
        check(IterableDataset.from_generator(lambda: iter(numbers)), tokenizer)


def test_chat_without_assistant_turn_when_training_on_completions(tokenizer):
    rows = [{"messages": chat(("user", "q"), ("assistant", "a"))}, {"messages": chat(("system", "s"), ("user", "q"))}]
    with pytest.raises(InputError, match=r"row 1: 'messages' has no assistant turn \(roles: \['system', 'user'\]\)"
                                         r".*assistant_only_loss=True"):
        check(Dataset.from_list(rows), tokenizer, cfg(assistant_only_loss=True))
    check(Dataset.from_list(rows), tokenizer, cfg())  # trains on every token: a chat without answer is fine
    pc = [{"prompt": chat(("user", "q")), "completion": chat(("assistant", "a"))},
          {"prompt": chat(("user", "q")), "completion": chat(("user", "oops"))}]
    with pytest.raises(InputError, match=r"row 1: 'completion' has no assistant turn.*training on completions"):
        check(Dataset.from_list(pc), tokenizer)


def test_tokenizer_without_chat_template(tokenizer):
    bare = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(InputError, match="has no chat template.*chat_template_path"):
        check(make_dataset("messages", n=4), bare)
    check(make_dataset("text", n=4), bare)  # plain text needs no template


def test_max_length_below_every_document(tokenizer):
    data = make_dataset("messages", n=40)
    with pytest.raises(InputError, match=r"max_length=8 is shorter than every document of train_dataset \(the "
                                         r"shortest, row \d+, has \d+ tokens; 40 of 40 rows checked\)"):
        check(data, tokenizer, cfg(max_length=8))
    check(data, tokenizer, cfg(max_length=8, packing=True, packing_strategy="bfd_split"))  # split, not cut
    rows = data.to_list()
    rows[17] = {"messages": chat(("user", "hi"), ("assistant", "yo"))}  # one short row: the setting can be meant
    check(Dataset.from_list(rows), tokenizer, cfg(max_length=24))


def test_documents_longer_than_max_length_are_named_not_cut_silently(tokenizer, caplog):
    data = make_dataset("text", n=30)
    rows = data.to_list()
    rows[7] = {"text": rows[7]["text"] + " red fox" * 200}  # far beyond max_length
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.guards"):
        check(Dataset.from_list(rows), tokenizer, cfg(max_length=64))
    assert "1 of 30 checked rows of train_dataset are longer than max_length=64 (row 7 (" in caplog.text
    assert "bfd_split" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.guards"):
        check(data, tokenizer, cfg(max_length=64))  # nothing long: nothing said
    assert "longer than max_length" not in caplog.text


def test_eval_dataset_is_named(tokenizer):
    bad = Dataset.from_dict({"text": ["fine", None]})
    with pytest.raises(InputError, match=r"eval_dataset\['val'\] row 1"):
        check(make_dataset("text", n=4), tokenizer, eval_dataset={"val": bad})


# ---------------------------------------------------------------------------------------------------------------
# rows with nothing to learn


def test_empty_text_rows_are_named_and_an_all_empty_dataset_is_an_error(tokenizer, caplog):
    rows = [{"text": "red fox"}, {"text": ""}, {"text": "blue sky"}, {"text": "   "}]
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.guards"):
        check(Dataset.from_list(rows), tokenizer)
    assert "2 of 4 rows of train_dataset have an empty 'text' (rows 1, 3)" in caplog.text
    assert "train_dataset.filter(" in caplog.text
    with pytest.raises(InputError, match=r"every row of train_dataset has an empty 'text': there is nothing to "
                                         r"train on \(the loss would be 0"):
        check(Dataset.from_dict({"text": ["", "", " "]}), tokenizer)
    empty = [{"text": ""}] * 3
    with pytest.raises(InputError, match="each of the first 3 rows of train_dataset has an empty 'text'"):
        check(IterableDataset.from_generator(lambda: iter(empty)), tokenizer)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.guards"):
        check(make_dataset("text", n=8), tokenizer)  # nothing empty: nothing said
    assert "empty" not in caplog.text


def test_empty_answers_are_named_when_only_answers_train(tokenizer, caplog):
    rows = [{"messages": chat(("user", "q"), ("assistant", "a"))},
            {"messages": chat(("user", "q"), ("assistant", ""))},
            {"messages": chat(("user", "q"), ("assistant", "a"), ("user", "q2"), ("assistant", " "))}]  # one answer
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.guards"):
        check(Dataset.from_list(rows), tokenizer, cfg(assistant_only_loss=True))
    assert "1 of 3 rows of train_dataset have only empty assistant turns (row 1)" in caplog.text
    assert "answer with nothing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.guards"):
        check(Dataset.from_list(rows), tokenizer, cfg())  # every token trains: an empty answer is one of them
    assert "empty" not in caplog.text
    silent = [{"messages": chat(("user", "q"), ("assistant", ""))}] * 2
    with pytest.raises(InputError, match="every row of train_dataset has only empty assistant turns"):
        check(Dataset.from_list(silent), tokenizer, cfg(assistant_only_loss=True))
    caplog.clear()
    pc = [{"prompt": "q", "completion": " a"}, {"prompt": "q", "completion": ""}]
    with caplog.at_level(logging.WARNING, logger="nbkit.reliability.guards"):
        check(Dataset.from_list(pc), tokenizer)
    assert "1 of 2 rows of train_dataset have an empty completion (row 1)" in caplog.text


# ---------------------------------------------------------------------------------------------------------------
# ShareGPT


def sharegpt(*turns: tuple[str, str]) -> list[dict]:
    return [{"from": role, "value": text} for role, text in turns]


def test_sharegpt_chats_are_refused_with_the_converter_named(tokenizer):
    rows = [{"conversations": sharegpt(("human", "q"), ("gpt", "a"))} for _ in range(3)]
    for args in (cfg(), cfg(assistant_only_loss=True)):
        with pytest.raises(InputError, match=r"ShareGPT roles \['gpt', 'human'\] in rows 0, 1, 2.*"
                                             r"from nbkit.reliability import from_sharegpt; train_dataset = "
                                             r"from_sharegpt\(train_dataset\)"):
            check(Dataset.from_list(rows), tokenizer, args)
    keys = [{"messages": sharegpt(("user", "q"), ("assistant", "a"))}]  # from/value keys TRL does not convert here
    with pytest.raises(InputError, match=r"ShareGPT keys 'from'/'value' in a 'messages' column.*row 0"):
        check(Dataset.from_list(keys), tokenizer)
    named = [{"conversations": chat(("user", "q"), ("assistant", "a"))}]  # TRL reads role/content from 'messages'
    with pytest.raises(InputError, match=r"'role'/'content' messages in a 'conversations' column"):
        check(Dataset.from_list(named), tokenizer)
    standard = [{"conversations": sharegpt(("user", "q"), ("assistant", "a"))}]  # TRL converts this one itself
    check(Dataset.from_list(standard), tokenizer, cfg(assistant_only_loss=True))


def test_standardized_chats_beside_a_text_column_are_read_as_text_as_trl_does(tokenizer):
    # Unsloth's recipes keep role/content chats in 'conversations' and render them into 'text': TRL trains on 'text'
    rows = [{"conversations": chat(("user", "q"), ("assistant", "a")), "text": "q a"}]
    assert detect_format("train_dataset", Dataset.from_list(rows)).kind == "text"
    check(Dataset.from_list(rows), tokenizer)
    sharegpt_rows = [{"conversations": sharegpt(("human", "q"), ("gpt", "a")), "text": "q a"}]  # TRL converts these
    with pytest.raises(InputError, match=r"ShareGPT roles"):
        check(Dataset.from_list(sharegpt_rows), tokenizer)


def test_from_sharegpt_gives_trls_messages_that_pass_and_mask_the_answers(tokenizer):
    from nbkit.reliability import from_sharegpt
    from nbkit.reliability.guards import from_sharegpt as same

    assert same is from_sharegpt
    rows = [{"conversations": sharegpt(("system", "s"), ("human", "q"), ("gpt", "a")), "id": 7}]
    for data in (Dataset.from_list(rows), IterableDataset.from_generator(lambda: iter(rows))):
        converted = from_sharegpt(data)
        first = next(iter(converted))
        assert first["messages"] == chat(("system", "s"), ("user", "q"), ("assistant", "a"))
        assert "conversations" not in first and first["id"] == 7
        assert check(converted, tokenizer, cfg(assistant_only_loss=True)).kind == "messages"
    out = tokenizer.apply_chat_template(first["messages"], return_dict=True, return_assistant_tokens_mask=True)
    assert sum(out["assistant_masks"]) > 0  # the chat template now finds the answer
    in_messages = from_sharegpt(Dataset.from_list([{"messages": sharegpt(("human", "q"), ("gpt", "a"))}]))
    assert in_messages[0]["messages"] == chat(("user", "q"), ("assistant", "a"))


def test_fastsft_refuses_sharegpt_and_trains_on_its_conversion(tokenizer, tmp_path):
    from nbkit.demo.models import tiny_model
    from nbkit.reliability import from_sharegpt

    model = tiny_model("qwen3", len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    data = Dataset.from_list([{"conversations": sharegpt(("human", f"q{i}"), ("gpt", f"a{i}"))} for i in range(8)])
    args = cfg(output_dir=str(tmp_path), assistant_only_loss=True, max_steps=1, per_device_train_batch_size=2)
    with pytest.raises(InputError, match="from_sharegpt"):  # not TRL's complaint about the chat template
        FastSFT(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer = FastSFT(model=model, args=args, train_dataset=from_sharegpt(data), processing_class=tokenizer)
    labels = next(iter(trainer.get_train_dataloader()))["labels"]
    assert (labels != -100).any()  # the answers are found and trained on
    trainer.train()


# ---------------------------------------------------------------------------------------------------------------
# settings


def test_packing_with_a_custom_collator():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    with pytest.raises(InputError, match=r"packing=True \(packing_strategy='bfd'\) cannot be combined with a custom "
                                         "data_collator"):
        validate_training_inputs(cfg(packing=True), make_dataset("text", n=4), data_collator=collator)
    validate_training_inputs(cfg(packing=False), make_dataset("text", n=4), data_collator=collator)


def test_incompatible_switches(tokenizer):
    text = make_dataset("text", n=4)
    with pytest.raises(InputError, match="completion_only_loss=True but the dataset is language-modeling"):
        check(text, tokenizer, cfg(completion_only_loss=True))
    with pytest.raises(InputError, match="completion_only_loss=True.*Use assistant_only_loss=True"):
        check(make_dataset("messages", n=4), tokenizer, cfg(completion_only_loss=True))
    with pytest.raises(InputError, match="assistant_only_loss=True needs conversational data"):
        check(make_dataset("prompt", n=4), tokenizer, cfg(assistant_only_loss=True))
    with pytest.raises(InputError, match=r"attention_kernel='sdpa_loop' has no effect with cached_packing=False"):
        check(text, tokenizer, cfg(cached_packing=False, attention_kernel="sdpa_loop"))
    with pytest.raises(InputError, match="offload_checkpointing=True needs gradient_checkpointing=True"):
        check(text, tokenizer, cfg(offload_checkpointing=True, gradient_checkpointing=False))
    with pytest.raises(InputError, match="skip_prepare_dataset.*needs a tokenized train_dataset"):
        check(text, tokenizer, cfg(dataset_kwargs={"skip_prepare_dataset": True}))


def test_formatting_func_must_return_text(tokenizer):
    data = Dataset.from_dict({"q": ["a", "b"], "a": ["c", "d"]})
    assert check(data, tokenizer, formatting_func=lambda row: f"{row['q']} {row['a']}").kind == "formatted"
    with pytest.raises(InputError, match="formatting_func returned a list.*row 0"):
        check(data, tokenizer, formatting_func=lambda row: [row["q"]])


# ---------------------------------------------------------------------------------------------------------------
# wiring into FastSFT


def test_fastsft_checks_before_trl_prepares(tokenizer, tmp_path, monkeypatch):
    from nbkit.demo.models import tiny_model

    model = tiny_model("qwen3", len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    prepared = []
    monkeypatch.setattr(FastSFT, "_prepare_dataset", lambda self, *a, **k: prepared.append(1))
    bad = Dataset.from_dict({"text": ["fine", None, "fine"]})
    with pytest.raises(InputError, match="train_dataset row 1"):
        FastSFT(model=model, args=cfg(output_dir=str(tmp_path)), train_dataset=bad, processing_class=tokenizer)
    assert not prepared  # the error came first
    with pytest.raises(InputError, match="row 1"):  # a plain SFTConfig gets the checks too (switch default: on)
        FastSFT(model, SFTConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to=[]), None, bad,
                processing_class=tokenizer)
    with pytest.raises(InputError, match="train_dataset is empty"):
        FastSFT(model=model, args=cfg(output_dir=str(tmp_path)), train_dataset=Dataset.from_dict({"text": []}),
                processing_class=tokenizer)


def test_validate_inputs_false_turns_the_checks_off(tokenizer, tmp_path, monkeypatch):
    from nbkit.demo.models import tiny_model

    model = tiny_model("qwen3", len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    bad = Dataset.from_dict({"text": ["fine", None, "fine"]})
    with pytest.raises(Exception) as caught:  # TRL's own failure, deeper in its dataset preparation
        FastSFT(model=model, args=cfg(output_dir=str(tmp_path), validate_inputs=False), train_dataset=bad,
                processing_class=tokenizer)
    assert not isinstance(caught.value, InputError)


def test_detect_format_matches_trl_on_the_first_row():
    assert detect_format("d", make_dataset("prompt", n=2)).conversational is False
    conv = Dataset.from_list([{"prompt": chat(("user", "q")), "completion": chat(("assistant", "a"))}])
    fmt = detect_format("d", conv)
    assert fmt.kind == "prompt_completion" and fmt.conversational
    assert detect_format("d", Dataset.from_dict({"input_ids": [[1, 2]], "text": ["x"]})).kind == "tokenized"


@pytest.mark.parametrize("value", [0, -1])
def test_a_plain_sftconfig_max_length_below_one_is_named_by_the_length_rule(tokenizer, value):
    """SFTConfig does not check max_length; FastSFT given one checks it with FastSFTConfig's rule, before any
    document is measured against it."""
    args = SFTConfig(output_dir="unused", bf16=False, use_cpu=True, report_to=[], max_length=value)
    with pytest.raises(InputError) as caught:
        check(make_dataset("text", n=4), tokenizer, args)
    assert str(caught.value) == f"max_length={value}: use None or a positive int (a number of tokens)"


# ---------------------------------------------------------------------------------------------------------------
# TRL's exception types kept


def _both_raise(tokenizer, tmp_path, dataset, **settings):
    """The exception SFTTrainer raises for ``dataset`` and the one FastSFT raises."""
    from trl import SFTTrainer

    from nbkit.demo.models import tiny_model

    caught = []
    for trainer_cls, config_cls, extra in ((SFTTrainer, SFTConfig, {}), (FastSFT, FastSFTConfig, {"live_dashboard": False})):
        args = config_cls(output_dir=str(tmp_path / trainer_cls.__name__), bf16=False, use_cpu=True, report_to=[],
                          **settings, **extra)
        model = tiny_model("qwen3", len(tokenizer), pad_token_id=tokenizer.pad_token_id)
        with pytest.raises(Exception) as error:
            trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        caught.append(error.value)
    return caught


@pytest.mark.parametrize("splits", ["DatasetDict", "dict"])
def test_a_dataset_dict_is_trls_type_error_and_names_the_split_to_pass(tokenizer, tmp_path, splits):
    from datasets import DatasetDict

    from nbkit.reliability.guards import DatasetTypeError

    data = {"train": make_dataset("text", n=4), "test": make_dataset("text", n=2)}
    trl_error, ours = _both_raise(tokenizer, tmp_path, DatasetDict(data) if splits == "DatasetDict" else data)
    assert isinstance(trl_error, TypeError)
    assert isinstance(ours, TypeError) and isinstance(ours, DatasetTypeError)
    assert "pass dataset['train']" in str(ours) and "columns" not in str(ours)


@pytest.mark.parametrize("columns", [{"foo": ["a b"]}, {"prompt": ["a b"]}])
def test_missing_columns_are_trls_key_error(tokenizer, tmp_path, columns):
    trl_error, ours = _both_raise(tokenizer, tmp_path, Dataset.from_dict(columns))
    assert isinstance(trl_error, KeyError) and isinstance(ours, KeyError) and isinstance(ours, InputError)
    assert not str(ours).startswith("'")  # the message itself, not KeyError's quoted form


def test_a_chat_without_an_assistant_turn_is_trls_runtime_error(tokenizer, tmp_path):
    data = Dataset.from_list([{"messages": chat(("user", "hi"))}, {"messages": chat(("user", "a"), ("assistant", "b"))}])
    trl_error, ours = _both_raise(tokenizer, tmp_path, data, assistant_only_loss=True)
    assert isinstance(trl_error, RuntimeError) and isinstance(ours, RuntimeError) and isinstance(ours, InputError)
    assert "row 0" in str(ours)


def test_a_list_of_rows_is_trls_type_error(tokenizer, tmp_path):
    trl_error, ours = _both_raise(tokenizer, tmp_path, [{"text": "a b"}])
    assert isinstance(trl_error, TypeError) and isinstance(ours, TypeError)
    assert "Dataset.from_list" in str(ours)
