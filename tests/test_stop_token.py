"""The end-of-turn check before training: it warns when no trained label is a stop token, and only then."""

from __future__ import annotations

import copy
import logging

import pytest

from nbkit.reliability.stop_token import check_stop_token, end_of_turn_token, stop_token_ids

# the demo template with the turn's end moved outside {% generation %}: the model would never be trained to stop
BROKEN_CHATML = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] }}{%- endgeneration %}{{- '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATS = [[{"role": "user", "content": "Reverse the words: red fox"}, {"role": "assistant", "content": "fox red"}],
         [{"role": "user", "content": "Reverse the words: cat dog sun"}, {"role": "assistant", "content": "sun dog cat"}]]


@pytest.fixture()
def tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _rows(tokenizer, template=None):
    rows = []
    for chat in CHATS:
        out = tokenizer.apply_chat_template(chat, chat_template=template, return_dict=True,
                                            return_assistant_tokens_mask=True)
        rows.append({"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]})
    return rows


def test_no_warning_when_the_template_trains_its_end_of_turn_token(tok, caplog):
    with caplog.at_level(logging.WARNING):
        result = check_stop_token(tok, _rows(tok))
    assert result.ok and result.rows_training_it == 2 and result.token == "<|im_end|>"
    assert not caplog.records


def test_warns_when_the_end_of_turn_token_sits_outside_the_trained_span(tok, caplog):
    with caplog.at_level(logging.WARNING):
        result = check_stop_token(tok, _rows(tok, BROKEN_CHATML))
    assert not result.ok and result.rows_checked == 2
    assert len(caplog.records) == 1
    assert "'<|im_end|>' (id 2)" in caplog.text and "{% generation %}" in caplog.text


def test_labels_as_trl_builds_them_are_read(tok, caplog):
    good = [{"input_ids": r["input_ids"], "labels": [t if m else -100 for t, m in zip(r["input_ids"], r["assistant_masks"])]}
            for r in _rows(tok)]
    assert check_stop_token(tok, good).ok
    stripped = [dict(r, labels=[-100 if t == 2 else t for t in r["labels"]]) for r in good]
    with caplog.at_level(logging.WARNING):
        assert not check_stop_token(tok, stripped).ok
    assert "eos" in caplog.text


def test_prompt_completion_rows_without_eos_warn_and_with_it_do_not(tok, caplog):
    prompt = tok("Question: red fox\nAnswer:")["input_ids"]
    completion = tok(" fox red")["input_ids"]
    bare = {"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion)}
    ended = {"input_ids": bare["input_ids"] + [tok.eos_token_id], "completion_mask": bare["completion_mask"] + [1]}
    with caplog.at_level(logging.WARNING):
        assert not check_stop_token(tok, [bare]).ok
        assert check_stop_token(tok, [ended]).ok
    assert len(caplog.records) == 1


def test_trl_prepared_datasets_pass_and_a_broken_template_warns(tok, tmp_path, caplog):
    from trl import SFTConfig, SFTTrainer

    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model

    data = make_dataset("messages", n=16, split="train", seed=0)
    model = tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id)
    results = []
    for template in (None, BROKEN_CHATML):
        tokenizer = copy.deepcopy(tok)
        if template:
            tokenizer.chat_template = template
        args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, report_to=[], max_length=128,
                         use_cpu=True, dataloader_num_workers=0)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        results.append(check_stop_token(tokenizer, trainer.train_dataset))
    assert results[0].ok and results[0].rows_training_it == 16
    assert not results[1].ok


@pytest.mark.parametrize("template,specials,expected", [
    ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}",
     ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
     "{% endfor %}", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %} "
     "{{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}", [], "<|im_end|>"),
])
def test_the_end_of_turn_token_is_read_from_the_template(tok, template, specials, expected):
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    assert end_of_turn_token(tok) == expected
    assert stop_token_ids(tok)[0] == tok.convert_tokens_to_ids(expected)


def test_without_a_template_the_eos_token_is_the_stop_token_and_ids_are_not_repeated(tok):
    from transformers import GenerationConfig

    tok.chat_template = None
    assert end_of_turn_token(tok) == "<|im_end|>"
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[2, 0, 2])) == [2, 0]
