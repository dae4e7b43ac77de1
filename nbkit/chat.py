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
- ``fast=True`` on a CUDA GPU decodes through the fastest path that applies, in this order:
  ``nbkit.dense_decode`` (a dense copy of the weights, adapters merged, one CUDA graph a step; taken when the family
  is supported and the GPU has room for the copy; greedy tokens differ from ``generate``'s only where two logits tie
  within rounding), then ``nbkit.graphed_decode`` (the model's own step replayed from CUDA graphs: ``generate``'s
  tokens exactly), then ``model.generate``, logging once per model why a faster path was not taken.
  ``exact=True`` skips the dense path (only ``generate``'s own tokens); ``fast=False`` always runs ``model.generate``.
- Returns the answer's text, special tokens removed. ``answer(...)`` returns the token ids and the path taken too.

The decoders (the dense copy, the captured steps) are kept on the model object (``_nbkit_dense_decoder``,
``_nbkit_graphed_decoder``), so a second ``chat`` reuses them; they are rebuilt when the model's parameters or
adapters change (training in between included), ``release_decoders(model)`` frees them (``FastSFT.train`` does),
and copying or pickling the model drops them.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from .dense_decode import DenseDecoder, signature_of
from .graphed_decode import GraphedDecoder, Unsupported
from .model_parts import unwrap_model
from .reliability.stop_token import stop_token_ids

logger = logging.getLogger(__name__)

_DECODER_ATTR = "_nbkit_graphed_decoder"
_DENSE_ATTR = "_nbkit_dense_decoder"
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


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


def _kept(model: torch.nn.Module, attr: str, make: Callable[[], Any]) -> Any:
    """The decoder kept on ``model`` under ``attr`` (made on first use; not a module or parameter, so copying or
    pickling the model drops it)."""
    if attr not in model.__dict__:
        model.__dict__[attr] = make()
    return model.__dict__[attr]


def _decoder(model: torch.nn.Module) -> GraphedDecoder:
    return _kept(model, _DECODER_ATTR, GraphedDecoder)


def dense_decoder(model: torch.nn.Module) -> DenseDecoder:
    """The dense decoder kept on ``model`` (made on first use)."""
    return _kept(model, _DENSE_ATTR, DenseDecoder)


def release_decoders(model: torch.nn.Module) -> None:
    """Free the memory ``chat`` keeps on ``model`` for fast decoding (the dense copy and its buffers)."""
    decoder = model.__dict__.get(_DENSE_ATTR)
    if decoder is not None:
        decoder.release()


def dense_reason(model: torch.nn.Module, total_len: int, batch: int, signature: tuple | None = None) -> str | None:
    """None when the dense path applies to ``model`` here, else why (logged once per model). ``signature``: the
    model's ``dense_decode.signature_of``, taken once a call by the caller."""
    decoder = dense_decoder(model)
    reason = decoder.check(model, total_len, batch, signature)
    if reason is None:
        try:
            decoder.prepare(model, batch, total_len, signature)
        except Unsupported as error:
            reason = str(error)
    if reason is not None and not decoder.reported:
        logger.info("nbkit: fast decoding without a dense copy: %s", reason)
        decoder.reported = True
    return reason


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
) -> Answer:
    """``chat``, returning an ``Answer`` (text, token ids, path taken)."""
    messages = _messages(message_or_messages, system)
    ids = prompt_ids(tokenizer, messages, _device(model))
    config = greedy_config(model, tokenizer, max_new_tokens)
    sink = _print if stream is True else (stream if callable(stream) else None)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    reason = None if fast else "fast=False"
    path = "generate"
    total = ids.shape[1] + max_new_tokens
    signature = None
    try:
        if reason is None and not exact:
            signature = signature_of(model)
            reason = dense_reason(model, total, 1, signature)
            path = "dense" if reason is None else path
        if path != "dense" and fast:
            decoder = _decoder(model)
            graphed_reason = decoder.check(model, total)
            if graphed_reason is None:
                try:
                    decoder.prepare(model, total)
                    path = "graphed"
                except Unsupported as error:
                    graphed_reason = str(error)
            reason = graphed_reason or reason  # why generate, or else why not dense
            if graphed_reason is not None and not decoder.reported:
                logger.warning("nbkit chat: decoding with model.generate: %s", reason)
                decoder.reported = True
        out = _TextStream(tokenizer, sink, skip_first=False) if sink else None
        with torch.no_grad():
            if path == "dense":
                tokens = _dense_tokens(model, ids, config, out, signature)
            elif path == "graphed":
                put = (lambda t: out.put(torch.tensor([t]))) if out else None
                tokens = _decoder(model).generate(model, ids, config, on_token=put)
            else:
                if out:
                    out._skip = True  # generate puts the prompt first
                seq = model.generate(input_ids=ids, generation_config=config, streamer=out)
                tokens = [int(t) for t in seq[0, ids.shape[1]:].tolist()]
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
                  signature: tuple | None) -> list[int]:
    stops = config.eos_token_id
    stops = {stops} if isinstance(stops, int) else set(stops or [])
    streamed: list[int] = []

    def put(chunk: torch.Tensor) -> None:  # chunks run past the stop id (pads): stream up to and including it
        for token in chunk[0].tolist():
            if streamed and streamed[-1] in stops:
                return
            streamed.append(token)
            out.put(torch.tensor([token]))

    return dense_decoder(model).generate(model, ids, config, on_tokens=put if out else None, signature=signature)[0]


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
) -> str:
    """Answer ``message_or_messages`` greedily with the chat template, streaming it (see the module docstring)."""
    return answer(model, tokenizer, message_or_messages, max_new_tokens=max_new_tokens, stream=stream,
                  system=system, fast=fast, exact=exact).text
