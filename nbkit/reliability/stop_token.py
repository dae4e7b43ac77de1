"""The token that ends an assistant turn, and whether training teaches the model to emit it.

Why: a fine-tuned model stops answering only if it learned to emit its chat template's end-of-turn token
(``<|im_end|>`` for ChatML, ``<end_of_turn>`` for Gemma, ``<|eot_id|>`` for Llama 3, ``</s>`` for Mistral). If that
token never carries a label -- the template closes the turn outside its ``{% generation %}`` block, or
prompt-completion text was tokenized without an eos -- training succeeds, the loss falls, and the model then runs on
to ``max_new_tokens`` every time it answers. Nothing fails; the run is wasted.

Contract:
- ``end_of_turn_token(tokenizer)``: the token the template writes right after an assistant message's content
  (found by rendering a one-turn chat), else the tokenizer's eos token, else None.
- ``stop_token_ids(tokenizer, generation_config)``: every id that ends an answer, template's first: that token,
  the tokenizer's eos and the generation config's eos ids, without repeats.
- ``check_stop_token(tokenizer, rows)``: looks at a few tokenized training rows (``input_ids`` with ``labels``, as
  TRL prepares them, or with ``completion_mask`` / ``assistant_masks`` before TRL folds those into labels) and,
  when none of the stop ids is among the trained labels, logs one warning naming the token and what to change. It
  returns a ``StopTokenCheck``; it never raises and never changes the rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

logger = logging.getLogger(__name__)

_SENTINEL = "nbkit stop token probe"
ROWS_CHECKED = 64  # enough rows to see a trained stop token if the data trains one at all


def end_of_turn_token(tokenizer: Any) -> str | None:
    """The token the chat template closes an assistant turn with; the eos token without a usable template."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False
            )
        except Exception:  # a template that needs a system turn, tools, ...: fall back on eos
            text = ""
        if isinstance(text, str) and _SENTINEL in text:
            suffix = text[text.rindex(_SENTINEL) + len(_SENTINEL):].lstrip()
            if suffix:
                ids = tokenizer.encode(suffix, add_special_tokens=False)
                special = set(getattr(tokenizer, "all_special_ids", ())) | {
                    i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special
                }
                if ids and ids[0] in special:
                    return tokenizer.convert_ids_to_tokens(ids[0])
    return getattr(tokenizer, "eos_token", None)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Every token id that ends an answer: the template's end-of-turn token first, then eos ids, no repeats."""
    ids: list[int] = []
    token = end_of_turn_token(tokenizer)
    if token is not None:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
            ids.append(token_id)
    ids += _as_list(getattr(tokenizer, "eos_token_id", None))
    if generation_config is not None:
        ids += _as_list(getattr(generation_config, "eos_token_id", None))
    return list(dict.fromkeys(ids))


@dataclass
class StopTokenCheck:
    """What ``check_stop_token`` saw: ``ok`` is False when no checked row trains any stop id."""

    ok: bool
    token: str | None
    ids: list[int]
    rows_checked: int
    rows_training_it: int
    message: str | None = None
    trained_label_count: int = field(default=0, repr=False)


def _trained_labels(row: Mapping[str, Any]) -> list[int]:
    """The label ids of one row that the loss sees (TRL's masks or labels; every token when there is neither)."""
    labels = row.get("labels")
    ids = list(labels if labels is not None else row["input_ids"])
    # TRL builds labels from the ids and applies completion/assistant masks in the collator: both count
    masks = [row[k] for k in ("completion_mask", "assistant_masks") if row.get(k) is not None]
    return [int(t) for t, *bits in zip(ids, *masks) if all(bits) and int(t) != -100]


def check_stop_token(
    tokenizer: Any, rows: Iterable[Mapping[str, Any]], generation_config: Any = None, limit: int = ROWS_CHECKED
) -> StopTokenCheck:
    """Warn (once, by logging) when no stop token is trained on in the first ``limit`` tokenized ``rows``."""
    ids = stop_token_ids(tokenizer, generation_config)
    token = end_of_turn_token(tokenizer)
    checked = training_it = label_count = 0
    for row in rows:
        if checked >= limit:
            break
        labels = _trained_labels(row)
        checked += 1
        label_count += len(labels)
        training_it += any(t in ids for t in labels)
    if checked == 0 or label_count == 0 or not ids or training_it:
        # nothing to judge (no rows, nothing trained: other checks report those), or the stop token is trained
        return StopTokenCheck(True, token, ids, checked, training_it, None, label_count)
    names = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} (id {i})" for i in ids)
    message = (
        f"nbkit: none of the {checked} training rows checked has a stop token among its trained labels ({names}): "
        "the model will not learn to end its answers and will run on to max_new_tokens. Fix it before training: "
        "with assistant_only_loss, put the end-of-turn token inside the template's {% generation %} ... "
        "{% endgeneration %} block; for prompt-completion or text data, end each completion with "
        f"tokenizer.eos_token ({getattr(tokenizer, 'eos_token', None)!r}) or set SFTConfig(eos_token=...) to the "
        f"template's end-of-turn token ({token!r})."
    )
    logger.warning(message)
    return StopTokenCheck(False, token, ids, checked, 0, message, label_count)
