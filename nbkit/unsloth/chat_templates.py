"""Chat templates by family name, ShareGPT standardising, and each family's turn markers, for Unsloth's recipes.

Why: Unsloth's notebooks set the chat format with ``get_chat_template(tokenizer, chat_template="llama-3.1")`` and
read ShareGPT data through ``standardize_sharegpt``; a notebook ported to nbkit keeps those lines.

Contract:

- ``get_chat_template(tokenizer, chat_template="chatml", mapping=None, map_eos_token=True, system_message=None)``
  sets ``tokenizer.chat_template`` to the family's template (``TEMPLATES``; aliases such as ``"llama3"``,
  ``"qwen2.5"``) and returns the same tokenizer. ``mapping`` (``{"role": "from", "content": "value", "user": "human",
  "assistant": "gpt"}``) makes the template read other keys and role names. ``system_message`` replaces the family's
  default system prompt. ``chat_template`` may also be a ``(jinja template, stop word)`` pair. With
  ``map_eos_token`` the family's stop word becomes the tokenizer's eos when it is one token of the vocabulary. No token
  is ever added: markers the vocabulary lacks (Llama 3's headers on another model's tokenizer) are learned as text,
  and a warning says so.
- Message contents may be a string or a list of ``{"type": "text", "text": ...}`` parts (Gemma 3's form).
- ``standardize_sharegpt(dataset)``: ShareGPT ``from``/``value`` turns as ``role``/``content`` with TRL's role names
  (``nbkit.reliability.from_sharegpt``), kept in the column they came from (Unsloth's recipes read
  ``conversations`` afterwards). ``standardize_data_formats`` is the same.
- ``turn_markers(template_text)``: the (instruction part, response part) of the family whose markers the template
  uses, or None; ``train_on_responses_only`` reads them when not given.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

logger = logging.getLogger(__name__)

EOS = object()  # the tokenizer's eos_token, where a format needs it
Piece = Union[str, object]


@dataclass(frozen=True)
class Family:
    """One chat format: the text around each role's content, as (before, after) pieces."""

    user: tuple[tuple[Piece, ...], tuple[Piece, ...]]
    assistant: tuple[tuple[Piece, ...], tuple[Piece, ...]]
    system: Optional[tuple[tuple[Piece, ...], tuple[Piece, ...]]]  # None: the system text opens the first user turn
    generation: tuple[Piece, ...]
    stop: str  # the text that ends an assistant turn ("eos_token": the tokenizer's)
    markers: tuple[str, str]  # (instruction part, response part) for train_on_responses_only
    bos: bool = False
    default_system: Optional[str] = None
    system_always: bool = False  # a system turn even when the chat has none (Llama 3.1's dated header)
    thinking_switch: bool = False  # Qwen3: enable_thinking=False adds an empty think block to the generation prompt


def _chatml(default_system: Optional[str] = None, thinking: bool = False) -> Family:
    return Family(user=(("<|im_start|>user\n",), ("<|im_end|>\n",)),
                  assistant=(("<|im_start|>assistant\n",), ("<|im_end|>\n",)),
                  system=(("<|im_start|>system\n",), ("<|im_end|>\n",)),
                  generation=("<|im_start|>assistant\n",), stop="<|im_end|>",
                  markers=("<|im_start|>user\n", "<|im_start|>assistant\n"), default_system=default_system,
                  thinking_switch=thinking)


def _llama3(dated: bool) -> Family:
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    date = "Cutting Knowledge Date: December 2023\nToday Date: 26 July 2024\n\n" if dated else ""
    return Family(user=((header.format("user"),), ("<|eot_id|>",)),
                  assistant=((header.format("assistant"),), ("<|eot_id|>",)),
                  system=((header.format("system") + date,), ("<|eot_id|>",)),
                  generation=(header.format("assistant"),), stop="<|eot_id|>",
                  markers=(header.format("user"), header.format("assistant")), bos=True, system_always=dated,
                  default_system="" if dated else None)


def _gemma() -> Family:
    return Family(user=(("<start_of_turn>user\n",), ("<end_of_turn>\n",)),
                  assistant=(("<start_of_turn>model\n",), ("<end_of_turn>\n",)), system=None,
                  generation=("<start_of_turn>model\n",), stop="<end_of_turn>",
                  markers=("<start_of_turn>user\n", "<start_of_turn>model\n"), bos=True)


_ALPACA_SYSTEM = ("Below are some instructions that describe some tasks. Write responses that appropriately "
                  "complete each request.")
_VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                  "helpful, detailed, and polite answers to the user's questions.")

FAMILIES: dict[str, Family] = {
    "chatml": _chatml(),
    "qwen-2.5": _chatml("You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "qwen3": _chatml(thinking=True),
    "llama-3": _llama3(dated=False),
    "llama-3.1": _llama3(dated=True),
    "gemma": _gemma(),
    "gemma-3": _gemma(),
    "mistral": Family(user=(("[INST] ",), (" [/INST]",)), assistant=(("",), (EOS,)), system=None, generation=(),
                      stop="eos_token", markers=("[INST]", "[/INST]"), bos=True),
    "phi-3": Family(user=(("<|user|>\n",), ("<|end|>\n",)), assistant=(("<|assistant|>\n",), ("<|end|>\n",)),
                    system=(("<|system|>\n",), ("<|end|>\n",)), generation=("<|assistant|>\n",), stop="<|end|>",
                    markers=("<|user|>\n", "<|assistant|>\n")),
    "phi-4": Family(user=(("<|im_start|>user<|im_sep|>",), ("<|im_end|>",)),
                    assistant=(("<|im_start|>assistant<|im_sep|>",), ("<|im_end|>",)),
                    system=(("<|im_start|>system<|im_sep|>",), ("<|im_end|>",)),
                    generation=("<|im_start|>assistant<|im_sep|>",), stop="<|im_end|>",
                    markers=("<|im_start|>user<|im_sep|>", "<|im_start|>assistant<|im_sep|>")),
    "zephyr": Family(user=(("<|user|>\n",), (EOS, "\n")), assistant=(("<|assistant|>\n",), (EOS, "\n")),
                     system=(("<|system|>\n",), (EOS, "\n")), generation=("<|assistant|>\n",), stop="eos_token",
                     markers=("<|user|>\n", "<|assistant|>\n")),
    "alpaca": Family(user=(("### Instruction:\n",), ("\n\n",)), assistant=(("### Response:\n",), (EOS, "\n\n")),
                     system=(("",), ("\n\n",)), generation=("### Response:\n",), stop="eos_token",
                     markers=("### Instruction:\n", "### Response:\n"), bos=True, default_system=_ALPACA_SYSTEM),
    "vicuna": Family(user=(("USER: ",), (" ",)), assistant=(("ASSISTANT: ",), (EOS,)),
                     system=(("",), (" ",)), generation=("ASSISTANT:",), stop="eos_token",
                     markers=("USER:", "ASSISTANT:"), bos=True, default_system=_VICUNA_SYSTEM),
}
ALIASES = {"llama3": "llama-3", "llama-31": "llama-3.1", "llama3.1": "llama-3.1", "llama-3.2": "llama-3.1",
           "llama-3.3": "llama-3.1", "qwen-25": "qwen-2.5", "qwen25": "qwen-2.5", "qwen2.5": "qwen-2.5",
           "qwen-3": "qwen3", "qwen3-instruct": "qwen3", "gemma3": "gemma-3", "gemma2": "gemma", "phi-35": "phi-3",
           "phi-3.5": "phi-3", "phi4": "phi-4"}
TEMPLATES = tuple(sorted(FAMILIES) + sorted(ALIASES))

_DEFAULT_MAPPING = {"role": "role", "content": "content", "user": "user", "assistant": "assistant",
                    "system": "system"}


def _literal(text: str) -> str:
    return json.dumps(text)  # a Jinja string literal (Jinja reads Python escapes)


def _expr(pieces: tuple[Piece, ...]) -> list[str]:
    return ["eos_token" if piece is EOS else _literal(str(piece)) for piece in pieces if piece != ""]


def _emit(around: tuple[tuple[Piece, ...], tuple[Piece, ...]], content: str) -> str:
    return "{{ " + " + ".join(_expr(around[0]) + [content] + _expr(around[1])) + " }}"


def build_template(family: Family, mapping: Optional[dict[str, str]] = None,
                   system_message: Optional[str] = None) -> str:
    """The Jinja chat template of ``family``, reading the keys and role names of ``mapping``."""
    names = {**_DEFAULT_MAPPING, **(mapping or {})}
    role, content = _literal(names["role"]), _literal(names["content"])
    default = family.default_system if system_message is None else system_message
    system_turn = (_emit(family.system, "system") if family.system is not None else "")
    parts = [
        "{%- macro text(m) -%}{%- if m[" + content + "] is string -%}{{ m[" + content + "] }}{%- else -%}"
        "{%- for part in m[" + content + "] -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}{%- endmacro -%}",
        "{{- bos_token -}}" if family.bos else "",
        "{%- set system = " + ("none" if default is None else _literal(default)) + " -%}",
        "{%- set loop_messages = messages -%}",
        "{%- if messages and messages[0][" + role + "] == " + _literal(names["system"]) + " -%}"
        "{%- set system = text(messages[0]) -%}{%- set loop_messages = messages[1:] -%}{%- endif -%}",
    ]
    if family.system is not None:
        condition = "true" if family.system_always else "system is not none"
        parts.append("{%- if " + condition + " -%}{%- if system is none -%}{%- set system = '' -%}{%- endif -%}"
                     + system_turn + "{%- endif -%}")
    parts += [
        "{%- for message in loop_messages -%}",
        "{%- set body = text(message) -%}",
        "{%- if message[" + role + "] == " + _literal(names["user"]) + " -%}",
    ]
    if family.system is None:  # the system text opens the first user turn
        parts.append("{%- if loop.first and system is not none and system != '' -%}"
                     "{%- set body = system + '\\n\\n' + body -%}{%- endif -%}")
    parts += [
        _emit(family.user, "body"),
        "{%- elif message[" + role + "] == " + _literal(names["assistant"]) + " -%}",
        _emit(family.assistant, "body"),
        "{%- elif message[" + role + "] == " + _literal(names["system"]) + " and " + str(family.system is not None).lower()
        + " -%}",
        _emit(family.system, "body") if family.system is not None else "",
        "{%- else -%}{{ raise_exception('unknown role ' + message[" + role + "] + ': this template reads "
        + names["user"] + ", " + names["assistant"] + " and " + names["system"] + "') }}{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}" + ("{{ " + " + ".join(_expr(family.generation)) + " }}"
                                            if _expr(family.generation) else ""),
    ]
    if family.thinking_switch:
        parts.append("{%- if enable_thinking is defined and enable_thinking is false -%}"
                     "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}")
    parts.append("{%- endif -%}")
    return "".join(parts)


def family(name: str) -> Family:
    """The family ``name`` (or an alias) stands for; ``ValueError`` naming the known ones otherwise."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in FAMILIES:
        raise ValueError(f"chat_template={name!r}: nbkit knows {', '.join(TEMPLATES)}, or pass a "
                         "(jinja template, stop word) pair")
    return FAMILIES[key]


def _is_token(tokenizer: Any, text: str) -> bool:
    return text in tokenizer.get_vocab()


def get_chat_template(tokenizer: Any, chat_template: Any = "chatml", mapping: Optional[dict[str, str]] = None,
                      map_eos_token: bool = True, system_message: Optional[str] = None) -> Any:
    """Set ``tokenizer.chat_template`` to a family's template (module docstring); returns ``tokenizer``."""
    if isinstance(chat_template, (tuple, list)):
        template, stop = chat_template
    else:
        chosen = family(str(chat_template))
        template, stop = build_template(chosen, mapping, system_message), chosen.stop
    tokenizer.chat_template = template
    specials = dict.fromkeys(re.findall(r"<\|[a-z_]+\|>|<(?:start|end)_of_turn>", template))
    missing = [token for token in specials if not _is_token(tokenizer, token)]
    if missing:
        logger.warning("nbkit: %s's markers %s are not tokens of this tokenizer's vocabulary: the model learns "
                       "them as text (no token is added; the embeddings keep their size)", chat_template, missing)
    if map_eos_token and stop != "eos_token" and _is_token(tokenizer, stop) and tokenizer.eos_token != stop:
        tokenizer.eos_token = stop
    return tokenizer


# how each family's template shows itself, most specific first
_SIGNATURES = (("<|start_header_id|>", "llama-3"), ("<|im_sep|>", "phi-4"), ("<|im_start|>", "chatml"),
               ("<start_of_turn>", "gemma"), ("<|assistant|>", "phi-3"), ("### Response", "alpaca"),
               ("[/INST]", "mistral"), ("ASSISTANT:", "vicuna"))


def turn_markers(template: Optional[str]) -> Optional[tuple[str, str]]:
    """(instruction part, response part) of the family whose markers ``template`` holds, or None."""
    for signature, name in _SIGNATURES:
        if template and signature in template:
            return FAMILIES[name].markers
    return None


def standardize_sharegpt(dataset: Any, column: Optional[str] = None) -> Any:
    """``dataset``'s ShareGPT chats as ``role``/``content`` messages, in the column they came from."""
    from ..reliability.sharegpt import from_sharegpt

    names = getattr(dataset, "column_names", None) or list(next(iter(dataset)))
    source = column or ("conversations" if "conversations" in names else "messages")
    converted = from_sharegpt(dataset, source)
    return converted.rename_column("messages", source) if source != "messages" else converted


standardize_data_formats = standardize_sharegpt


def __getattr__(name: str) -> Any:
    # ``from unsloth.chat_templates import train_on_responses_only`` is how Unsloth's recipes import it
    if name == "train_on_responses_only":
        from .training import train_on_responses_only

        return train_on_responses_only
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
