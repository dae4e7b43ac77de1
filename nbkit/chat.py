"""``chat``: talk to the model you just trained, in a notebook cell or a terminal, with the answer streamed.

Contract of ``chat(model, tokenizer, message_or_messages, ...) -> str``:
- ``message_or_messages``: a string (one user turn) or a list of ``{"role", "content"}`` messages; ``system=``
  puts a system turn first (unless the messages already start with one).
- The prompt is the tokenizer's chat template with ``add_generation_prompt=True``, tokenized the way TRL tokenizes
  training chats (the template writes its own special tokens).
- Decoding is greedy and stops after the template's end-of-turn token or an eos id
  (``nbkit.reliability.stop_token.stop_token_ids``: ``<|im_end|>`` for ChatML, ``<end_of_turn>`` for Gemma,
  ``<|eot_id|>`` for Llama 3, ...), or after ``max_new_tokens``.
- ``stream=True`` prints the answer as it is generated, token by token (``print(..., end="", flush=True)``, which a
  notebook cell and a terminal both show as it comes); a callable gets each new piece of text instead; ``False``
  prints nothing.
- The model runs in eval mode with the KV cache on for the call, and every module gets its previous train/eval mode
  back afterwards, so ``chat`` can sit between ``FastSFT.train()`` calls, on a 4-bit or 16-bit base, with or
  without PEFT adapters.
- ``fast=True`` on a CUDA GPU decodes through ``nbkit.graphed_decode`` (the step replayed from CUDA graphs: the same
  tokens as ``model.generate(do_sample=False)``, in less time); where that cannot apply it logs the reason once per
  model and runs ``model.generate``. ``fast=False`` always runs ``model.generate``.
- Returns the answer's text, special tokens removed. ``answer(...)`` returns the token ids and the path taken too.

The captured decode step is kept on the model object (``_nbkit_graphed_decoder``), so a second ``chat`` reuses it;
it is recaptured when the model's parameters or adapters change, and copying or pickling the model drops it.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from .graphed_decode import GraphedDecoder, Unsupported
from .model_parts import unwrap_model
from .reliability.stop_token import stop_token_ids

logger = logging.getLogger(__name__)

_DECODER_ATTR = "_nbkit_graphed_decoder"
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


@dataclass
class Answer:
    """One reply: its text, its token ids (the stop token included when it stopped), the path and why."""

    text: str
    token_ids: list[int]
    path: str  # "graphed" or "generate"
    reason: str | None = None  # why the graphed path was not taken


class _TextStream(BaseStreamer):
    """Prints (or hands to ``sink``) each new piece of the decoded answer; skips the prompt ``generate`` puts first."""

    def __init__(self, tokenizer: Any, sink: Callable[[str], None], skip_first: bool) -> None:
        self.tokenizer, self.sink = tokenizer, sink
        self.ids: list[int] = []
        self.shown = 0
        self._skip = skip_first

    def put(self, value: torch.Tensor) -> None:
        if self._skip:
            self._skip = False
            return
        self.ids += [int(x) for x in value.reshape(-1).tolist()]
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
            return
        if len(text) > self.shown:
            self.sink(text[self.shown:])
            self.shown = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if len(text) > self.shown:
            self.sink(text[self.shown:])
        self.shown = len(text)


def _print(text: str) -> None:
    print(text, end="", flush=True)


def _messages(message_or_messages: str | Sequence[dict], system: str | None) -> list[dict]:
    if isinstance(message_or_messages, str):
        messages = [{"role": "user", "content": message_or_messages}]
    else:
        messages = [dict(m) for m in message_or_messages]
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("chat: pass a string, or a non-empty list of {'role': ..., 'content': ...} messages")
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _device(model: torch.nn.Module) -> torch.device:
    return next(p.device for p in model.parameters())


def prompt_ids(tokenizer: Any, messages: list[dict], device: torch.device) -> torch.Tensor:
    """The chat-template prompt (generation prompt added) as a (1, P) tensor of ids on ``device``."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat: the tokenizer has no chat template; set tokenizer.chat_template (a Jinja string)")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return torch.tensor([list(encoded["input_ids"])], dtype=torch.long, device=device)


def greedy_config(model: torch.nn.Module, tokenizer: Any, max_new_tokens: int) -> Any:
    """The model's generation config for greedy decoding that stops at the template's end-of-turn token."""
    base = unwrap_model(model)
    config = copy.deepcopy(base.generation_config)
    config.do_sample = False
    for name in _SAMPLING_FIELDS:  # unused when greedy; cleared so generate does not warn about them
        if hasattr(config, name):
            setattr(config, name, None)
    stops = stop_token_ids(tokenizer, base.generation_config)
    config.eos_token_id = stops or None
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or [None])[0]
    config.max_new_tokens = max_new_tokens
    config.use_cache = True
    return config


def _decoder(model: torch.nn.Module) -> GraphedDecoder:
    decoder = model.__dict__.get(_DECODER_ATTR)
    if decoder is None:
        decoder = GraphedDecoder()
        model.__dict__[_DECODER_ATTR] = decoder
    return decoder


def answer(
    model: torch.nn.Module,
    tokenizer: Any,
    message_or_messages: str | Sequence[dict],
    *,
    max_new_tokens: int = 256,
    stream: bool | Callable[[str], None] = True,
    system: str | None = None,
    fast: bool = True,
) -> Answer:
    """``chat``, returning an ``Answer`` (text, token ids, path taken)."""
    messages = _messages(message_or_messages, system)
    ids = prompt_ids(tokenizer, messages, _device(model))
    config = greedy_config(model, tokenizer, max_new_tokens)
    sink = _print if stream is True else (stream if callable(stream) else None)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    reason = None if fast else "fast=False"
    try:
        if reason is None:
            decoder = _decoder(model)
            reason = decoder.check(model, ids.shape[1] + max_new_tokens)
            if reason is None:
                try:
                    decoder.prepare(model, ids.shape[1] + max_new_tokens)
                except Unsupported as error:
                    reason = str(error)
            if reason is not None and not decoder.reported:
                logger.warning("nbkit chat: decoding with model.generate: %s", reason)
                decoder.reported = True
        out = _TextStream(tokenizer, sink, skip_first=False) if sink else None
        with torch.no_grad():
            if reason is None:
                put = (lambda t: out.put(torch.tensor([t]))) if out else None
                tokens = decoder.generate(model, ids, config, on_token=put)
                path = "graphed"
            else:
                if out:
                    out._skip = True  # generate puts the prompt first
                seq = model.generate(input_ids=ids, generation_config=config, streamer=out)
                tokens = [int(t) for t in seq[0, ids.shape[1]:].tolist()]
                path = "generate"
        if out:
            out.end()
            if sink is _print:
                print(flush=True)
    finally:
        for module, mode in modes:
            module.training = mode
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return Answer(text, tokens, path, reason)


def chat(
    model: torch.nn.Module,
    tokenizer: Any,
    message_or_messages: str | Sequence[dict],
    *,
    max_new_tokens: int = 256,
    stream: bool | Callable[[str], None] = True,
    system: str | None = None,
    fast: bool = True,
) -> str:
    """Answer ``message_or_messages`` greedily with the chat template, streaming it (see the module docstring)."""
    return answer(model, tokenizer, message_or_messages, max_new_tokens=max_new_tokens, stream=stream,
                  system=system, fast=fast).text
