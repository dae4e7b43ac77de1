"""``chat``: talk to the model you just trained, in a notebook cell or a terminal, with the answer streamed.

Contract of ``chat(model, tokenizer, message_or_messages, ...) -> str``:
- ``message_or_messages``: a string (one user turn) or a list of ``{"role", "content"}`` messages; ``system=``
  puts a system turn first (unless the messages already start with one).
- The prompt is the tokenizer's chat template with ``add_generation_prompt=True``, tokenized the way TRL tokenizes
  training chats (the template writes its own special tokens).
- Decoding is greedy unless ``temperature``, ``top_p``, ``top_k`` or ``min_p`` is given (or ``do_sample=True``):
  then each token is drawn after those filters, in ``generate``'s order; ``seed`` makes the draws repeat
  (``nbkit.decode.config.GenerationSettings``). It stops after the template's end-of-turn token or an eos id
  (``nbkit.reliability.stop_token.stop_token_ids``: ``<|im_end|>`` for ChatML, ``<end_of_turn>`` for Gemma,
  ``<|eot_id|>`` for Llama 3, ...), or after ``max_new_tokens``.
- ``stream=True`` prints the answer as it is generated, token by token (``print(..., end="", flush=True)``, which a
  notebook cell and a terminal both show as it comes); a callable gets each new piece of text instead; ``False``
  prints nothing.
- The model runs in eval mode with the KV cache on for the call, and every module gets its previous train/eval mode
  back afterwards, so ``chat`` can sit between ``FastSFT.train()`` calls, on a 4-bit or 16-bit base, with or
  without PEFT adapters.
- ``fast=True`` on a CUDA GPU decodes through the fastest path that applies (``nbkit.decode.choose``), in this
  order: ``nbkit.decode.dense`` (a dense copy of the weights, adapters merged, one CUDA graph a step; taken when the
  family is supported and the GPU has room for the copy; greedy tokens differ from ``generate``'s only where two
  logits tie within rounding), then ``nbkit.decode.graphed`` (the model's own step replayed from CUDA graphs:
  ``generate``'s greedy tokens exactly), then ``model.generate`` (``nbkit.decode.plain``), logging once per model
  why a faster path was not taken. ``exact=True`` skips the dense path (greedy: only ``generate``'s own tokens);
  ``fast=False`` always runs ``model.generate`` (sampling: ``generate``'s own draws for the seed). The fast paths
  sample on the device from their own seeded generator: the same distribution as ``generate``'s, other draws.
- Returns the answer's text, special tokens removed. ``answer(...)`` returns the token ids and the path taken too.

The decoders (the dense copy, the captured steps) are kept beside the model, not on it (``nbkit.decode.choose``), so
a second ``chat`` reuses them; they are rebuilt when the model's parameters or adapters change (training in between
included), ``release_decoders(model)`` frees them (``FastSFT.train`` does), and they go with the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from .choose import choose, decoders_of
from .config import GenerationSettings, chat_config
from .dense import signature_of


@dataclass
class Answer:
    """One reply: its text, its token ids (the stop token included when it stopped), the path and why."""

    text: str
    token_ids: list[int]
    path: str  # "dense", "graphed" or "generate"
    reason: str | None = None  # why the next faster path was not taken


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


def answer(
    model: torch.nn.Module,
    tokenizer: Any,
    message_or_messages: str | Sequence[dict],
    *,
    max_new_tokens: int = 256,
    stream: bool | Callable[[str], None] = True,
    system: str | None = None,
    fast: bool = True,
    exact: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    do_sample: bool | None = None,
) -> Answer:
    """``chat``, returning an ``Answer`` (text, token ids, path taken)."""
    settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  min_p=min_p, seed=seed, do_sample=do_sample)
    messages = _messages(message_or_messages, system)
    ids = prompt_ids(tokenizer, messages, _device(model))
    config = chat_config(model, tokenizer, settings)
    sink = _print if stream is True else (stream if callable(stream) else None)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        signature = signature_of(model) if fast and not exact else None  # one walk over the modules a call
        path, reason = choose(model, ids.shape[1] + max_new_tokens, 1, settings, fast, exact, signature)
        decoders = decoders_of(model)
        out = _TextStream(tokenizer, sink, skip_first=False) if sink else None
        with torch.no_grad():
            if path == "dense":
                tokens = _dense_tokens(model, ids, config, out, settings, signature)
            elif path == "graphed":
                put = (lambda t: out.put(torch.tensor([t]))) if out else None
                tokens = decoders.graphed.generate(model, ids, config, on_token=put, settings=settings)
            else:
                if out:
                    out._skip = True  # generate puts the prompt first
                tokens = decoders.plain.generate(model, ids, config, streamer=out, settings=settings)[0]
        if out:
            out.end()
            if sink is _print:
                print(flush=True)
    finally:
        for module, mode in modes:
            module.training = mode
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return Answer(text, tokens, path, reason)


def _dense_tokens(model: torch.nn.Module, ids: torch.Tensor, config: Any, out: _TextStream | None,
                  settings: GenerationSettings, signature: tuple | None) -> list[int]:
    stops = config.eos_token_id
    stops = {stops} if isinstance(stops, int) else set(stops or [])
    streamed: list[int] = []

    def put(chunk: torch.Tensor) -> None:  # chunks run past the stop id (pads): stream up to and including it
        for token in chunk[0].tolist():
            if streamed and streamed[-1] in stops:
                return
            streamed.append(token)
            out.put(torch.tensor([token]))

    return decoders_of(model).dense.generate(model, ids, config, on_tokens=put if out else None,
                                             signature=signature, settings=settings)[0]


def chat(
    model: torch.nn.Module,
    tokenizer: Any,
    message_or_messages: str | Sequence[dict],
    *,
    max_new_tokens: int = 256,
    stream: bool | Callable[[str], None] = True,
    system: str | None = None,
    fast: bool = True,
    exact: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    do_sample: bool | None = None,
) -> str:
    """Answer ``message_or_messages`` with the chat template, streaming it: greedy, or sampled where
    ``temperature``, ``top_p``, ``top_k`` or ``min_p`` is given (see the module docstring)."""
    return answer(model, tokenizer, message_or_messages, max_new_tokens=max_new_tokens, stream=stream,
                  system=system, fast=fast, exact=exact, temperature=temperature, top_p=top_p, top_k=top_k,
                  min_p=min_p, seed=seed, do_sample=do_sample).text
