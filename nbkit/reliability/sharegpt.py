"""ShareGPT chats (``{"from": "human" | "gpt", "value": ...}`` in a ``conversations`` column) in TRL's messages form.

Why: TRL renames ShareGPT's keys (``from``/``value`` to ``role``/``content``) only in a ``conversations`` column,
and never renames its roles. ``human`` and ``gpt`` then reach the chat template as they are: a ChatML template
renders ``<|im_start|>gpt`` without a word, the model learns role names it will never be prompted with, and with
``assistant_only_loss=True`` TRL finds no assistant turn and blames the chat template.

Contract:

- ``from_sharegpt(dataset)`` returns the dataset with a ``messages`` column of ``{"role", "content"}`` messages:
  ``human`` -> ``user``, ``gpt`` (and ``chatgpt``, ``bing``, ``bard``) -> ``assistant``, other roles unchanged; the
  source column (``conversations``, else ``messages``) is replaced. Works on ``Dataset`` and ``IterableDataset``.
- ``sharegpt_form(column, chat)`` says what in one chat TRL would not read as intended (None when nothing):
  guards uses it to point at ``from_sharegpt``.
"""

from __future__ import annotations

from typing import Any, Optional

ROLE_NAMES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
SHAREGPT_KEYS = ("from", "value")


def _message(message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role", message.get("from"))
    content = message.get("content", message.get("value"))
    return {"role": ROLE_NAMES.get(role, role), "content": content}


def from_sharegpt(dataset: Any, column: Optional[str] = None) -> Any:
    """``dataset`` with its ShareGPT chats (``column``: ``conversations`` if present, else ``messages``) as a
    ``messages`` column of ``{"role", "content"}`` messages with TRL's role names. Other keys of a message (e.g.
    a per-turn ``weight``) are dropped."""
    names = getattr(dataset, "column_names", None) or list(next(iter(dataset)))
    source = column or ("conversations" if "conversations" in names else "messages")
    if source not in names:
        raise ValueError(f"from_sharegpt: no {source!r} column (columns: {names})")

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [_message(m) for m in row[source]]}

    return dataset.map(convert, remove_columns=[source] if source != "messages" else None)


def sharegpt_form(column: str, chat: Any) -> Optional[str]:
    """What of ShareGPT's form this chat has that TRL would not convert (None: nothing)."""
    if not isinstance(chat, list):
        return None
    messages = [m for m in chat if isinstance(m, dict)]
    roles = sorted({m.get("role", m.get("from")) for m in messages} & set(ROLE_NAMES))
    if roles:
        return f"ShareGPT roles {roles}"
    sharegpt_keys = any(k in m for m in messages for k in SHAREGPT_KEYS)
    if sharegpt_keys and column != "conversations":
        return f"ShareGPT keys 'from'/'value' in a '{column}' column (TRL converts them only in 'conversations')"
    if not sharegpt_keys and column == "conversations" and messages:
        return "'role'/'content' messages in a 'conversations' column (TRL reads those only from 'messages')"
    return None
