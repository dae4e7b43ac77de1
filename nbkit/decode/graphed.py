"""Decoding whose one-token step is replayed from captured graphs: greedy, token for token what ``generate`` gives.

Why: at batch size 1 a decode step of a (4-bit, LoRA-adapted) model is a few thousand small kernels, each issued
by Python (transformers modules, bitsandbytes dequantization, PEFT adapters); the GPU mostly waits for the host.
Replaying the recorded step removes that host work.

How, and why greedy tokens stay exactly those of ``model.generate(do_sample=False)``:
- the prompt goes through ``model.generate(max_new_tokens=1)`` itself (the same kernels, the same first token);
  its key/value cache is copied into preallocated per-layer buffers;
- one decode step is captured once per model (again when its parameters, adapters or buffer sizes change), from
  the embedding to the logits, in segments that end at each attention call (``nbkit.ops.layer_graphs.Segments``,
  through the decoder's backend: CUDA graphs, or tapes on any device for the CPU tests). Between segments the
  attention runs eagerly, through the model's own attention function (sdpa or eager), on contiguous keys and values
  of exactly the cached length: the call, shapes and kernels of ``generate``'s step. A CUDA graph replays the
  kernels it recorded unchanged, so every number of the step, and so every greedy token, is the same. (Attending
  over a fixed padded length, as compiled static-cache decoding does, changes kernels and rounding: its tokens
  drift from ``generate``'s.)
- greedy: the next token is the argmax of the float32 logits, as in ``generate`` without logits processors.
  Sampling (``GenerationSettings``): the prompt's logits come from ``generate`` and every token, the first one
  included, is drawn on the device from the step's logits (``nbkit.ops.sampling``, one seeded generator); the token
  is read on the host once a step, as in greedy decoding.
"The same tokens" holds as far as ``generate`` reproduces itself: where two logits nearly tie (a random-weight
model after a few hundred tokens, say), run-to-run differences in GPU kernels (e.g. bitsandbytes' 4-bit kernels)
can flip a token in two plain ``generate`` calls already, and then in this path too.

Not covered (``GraphedDecoder.check`` names the reason; callers then use ``generate``): no device the backend
captures on (CUDA for CUDA graphs); generation settings that change greedy choices (repetition penalty, forced or
suppressed tokens, ...); attention implementations other than sdpa/eager; sliding-window layers shorter than the
conversation; models whose step cannot be captured (a host sync in the forward, e.g. data-dependent MoE routing
loops).
"""

from __future__ import annotations

import copy
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..model_parts import unwrap_model
from ..ops.layer_graphs import Segments
from ..trl_seam import ALL_MASK_ATTENTION_FUNCTIONS, DynamicLayer
from .config import GenerationSettings
from .sampler import Draws
from .shared import (
    Unsupported,
    default_backend,
    greedy_changers,
    parameter_signature,
    placement_reason,
    text_config,
    window_reason,
)

logger = logging.getLogger(__name__)

_IMPL = "nbkit_graphed_"  # + the original implementation's name
_KWARG = "nbkit_graphed"
_BLOCK = 512  # buffer capacity grows in steps of this many positions


class _BufferLayer(DynamicLayer):
    """One layer's keys and values in fixed buffers (batch 1): a step writes its position, given on the device."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        super().__init__()
        self.kbuf, self.vbuf, self.position = keys, values, position
        self.length = 0
        self.device = keys.device
        self.is_initialized = True
        self.keys, self.values = keys[:, :, :0], values[:, :, :0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if key_states.shape[-2] != 1:
            raise Unsupported("the graphed step takes one token at a time")
        self.kbuf.index_copy_(2, self.position, key_states)
        self.vbuf.index_copy_(2, self.position, value_states)
        self.length += 1
        self.keys, self.values = self.kbuf[:, :, : self.length], self.vbuf[:, :, : self.length]
        return self.keys, self.values

    def get_seq_length(self, *args: Any) -> int:
        return self.length

    def get_mask_sizes(self, query: Any = 1, *args: Any) -> tuple[int, int]:
        q = query if isinstance(query, int) else int(query.shape[0])
        return self.length + q, 0

    def get_max_length(self) -> int:
        return self.kbuf.shape[2]


@dataclass
class _Site:
    """One attention call of the captured step: what the eager attention between two graph segments needs."""

    module: torch.nn.Module
    query: torch.Tensor  # written by the segment before
    out: torch.Tensor  # read by the segment after
    layer: _BufferLayer
    kwargs: dict


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function the model runs while a step is warmed up or captured (see ``_Step.attend``)."""
    step: _Step = kwargs.pop(_KWARG)
    return step.attend(module, query, attention_mask, kwargs), None


class _Step:
    """Warm-up and capture of one decode step in segments (``layer_graphs.Segments``), then its replay at any
    cached length."""

    def __init__(self, original: Callable, eager_impl: bool, layers: list[_BufferLayer], backend: Any) -> None:
        self.original, self.eager_impl, self.layers = original, eager_impl, layers
        self.capturing = False
        self.segments = Segments(backend)
        self.sites: list[_Site] = []
        self.out_like: dict[int, torch.Tensor] = {}

    def _eager(self, module: torch.nn.Module, query: torch.Tensor, layer: _BufferLayer, length: int,
               kwargs: dict) -> torch.Tensor:
        keys = layer.kbuf[:, :, :length].contiguous()
        values = layer.vbuf[:, :, :length].contiguous()
        # sdpa: generate's one-token step passes no mask; eager: it passes zeros (all positions visible), which
        # add nothing to the scores, so None gives the same numbers
        return self.original(module, query, keys, values, None, **kwargs)[0]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, mask: torch.Tensor | None,
               kwargs: dict) -> torch.Tensor:
        layer = self.layers[module.layer_idx]
        if not self.capturing:
            # the warm-up step runs as generate's does (under capture transformers builds a mask it would skip)
            if mask is not None and not self.eager_impl:
                raise Unsupported("the model's one-token step passes an attention mask to sdpa")
            out = self._eager(module, query, layer, layer.length, kwargs)
            self.out_like[module.layer_idx] = out
            return out
        self.segments.end()
        like = self.out_like[module.layer_idx]
        out = torch.empty_like(like)
        self.sites.append(_Site(module, query, out, layer, kwargs))
        self.segments.begin()
        return out

    def capture(self, forward: Callable[[], Any]) -> Any:
        self.capturing = True
        self.segments.begin()
        try:
            out = forward()
            self.segments.end()
        except BaseException:
            self.segments.abort()  # leave the stream out of capture mode
            self.sites = []
            raise
        finally:
            self.capturing = False
        return out

    def replay(self, length: int) -> None:
        for i, graph in enumerate(self.segments.graphs):
            graph.replay()
            if i < len(self.sites):
                site = self.sites[i]
                site.out.copy_(self._eager(site.module, site.query, site.layer, length, site.kwargs))


def step_buffers(model: torch.nn.Module, base: torch.nn.Module,
                 capacity: int) -> tuple[torch.Tensor, torch.Tensor, list[_BufferLayer]]:
    """A captured step's static inputs: the token and position ids, (1, 1) each, and one key/value buffer layer of
    ``capacity`` positions per decoder layer, shaped by one probe step of ``model`` (``base``: its transformers
    model) and written at the position the position ids hold."""
    device = next(base.parameters()).device
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    pos = torch.zeros((1, 1), dtype=torch.long, device=device)
    probe = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{_cache_kwarg(base): probe})
    layers = []
    for layer in probe.layers:
        k, v = layer.keys, layer.values
        kbuf = torch.zeros((1, k.shape[1], capacity, k.shape[3]), dtype=k.dtype, device=device)
        vbuf = torch.zeros((1, v.shape[1], capacity, v.shape[3]), dtype=v.dtype, device=device)
        layers.append(_BufferLayer(kbuf, vbuf, pos.view(1)))
    return ids, pos, layers


def _cache_kwarg(base: torch.nn.Module) -> str:
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _register(original_impl: str) -> str:
    """Register the graphed attention under a name whose masks are those of ``original_impl`` (idempotent)."""
    name = _IMPL + original_impl
    AttentionInterface.register(name, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original_impl])
    return name


class GraphedDecoder:
    """Decoding of one model through its own captured decode step (see the module docstring).

    ``check(model, total_len)`` returns None or the reason the path does not apply; ``prepare`` captures (or keeps)
    the step; ``generate(...)`` decodes. ``backend``: the ``nbkit.ops.layer_graphs`` backend the step is captured
    with (default CUDA graphs; ``TapeBackend()`` replays on any device: the CPU tests'). ``first_capture_s`` is the
    time the first capture took (warm-up, capture); ``captures`` counts them.
    """

    def __init__(self, backend: Any = None) -> None:
        self.backend = backend if backend is not None else default_backend(True)
        self.captures = 0
        self.reported = False  # the fallback reason was logged once
        self.first_capture_s: float | None = None
        self._step: _Step | None = None
        self._signature: tuple | None = None
        self._layers: list[_BufferLayer] = []
        self._ids = self._pos = self._logits = None
        self._draws: Draws | None = None
        self._capacity = 0

    # -- applicability ---------------------------------------------------------------------------------------------
    def check(self, model: torch.nn.Module, total_len: int) -> str | None:
        """None if ``model`` can decode up to ``total_len`` positions on this path here, else the reason."""
        reason = placement_reason(model, self.backend)
        if reason:
            return reason
        base = unwrap_model(model)
        impl = getattr(base.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            return f"attention implementation {impl!r} (the graphed step runs sdpa or eager)"
        changers = greedy_changers(base.generation_config)
        if changers:
            return "the generation config changes greedy choices: " + ", ".join(changers)
        return window_reason(text_config(base), total_len)

    # -- state -----------------------------------------------------------------------------------------------------
    def _allocate(self, model: torch.nn.Module, base: torch.nn.Module, capacity: int) -> None:
        self._ids, self._pos, self._layers = step_buffers(model, base, capacity)
        self._capacity = capacity

    def _capture(self, model: torch.nn.Module, base: torch.nn.Module) -> None:
        original_impl = base.config._attn_implementation
        original = ALL_ATTENTION_FUNCTIONS[original_impl] if original_impl != "eager" else None
        if original is None:
            attn = next((m for m in base.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")), None)
            original = getattr(inspect.getmodule(type(attn)), "eager_attention_forward", None) if attn else None
            if original is None:
                raise Unsupported("no eager attention function found in the model's modeling module")
        step = _Step(original, original_impl == "eager", self._layers, self.backend)
        cache = Cache(layers=self._layers)
        kwargs = {"input_ids": self._ids, "position_ids": self._pos, _cache_kwarg(base): cache, "use_cache": True,
                  "logits_to_keep": 1, "return_dict": True, _KWARG: step}
        for layer in self._layers:
            layer.length = 0
        self._pos.zero_()
        device = self._ids.device
        base.set_attn_implementation(_register(original_impl))
        try:
            with torch.no_grad():
                # warm-up: lazy initialisations, and the attention output shapes
                self.backend.warm_up(lambda: model(**kwargs), device)
                for layer in self._layers:
                    layer.length = 0
                out = step.capture(lambda: model(**kwargs))
        except Unsupported:
            raise
        except Exception as error:
            raise Unsupported(f"its decode step cannot be captured ({type(error).__name__}: {error})") from error
        finally:
            base.set_attn_implementation(original_impl)
        self._step, self._logits = step, out.logits
        self.captures += 1

    def prepare(self, model: torch.nn.Module, total_len: int) -> None:
        """Capture (or keep) a step for ``model`` with room for ``total_len`` positions; raises ``Unsupported``."""
        reason = self.check(model, total_len)
        if reason:
            raise Unsupported(reason)
        base = unwrap_model(model)
        signature = parameter_signature(model)
        if self._step is not None and signature == self._signature and total_len <= self._capacity:
            return
        t0 = time.perf_counter()
        self._step = None
        capacity = max(self._capacity, -(-total_len // _BLOCK) * _BLOCK)
        self._allocate(model, base, capacity)
        self._capture(model, base)
        self._signature = parameter_signature(model)
        if self.first_capture_s is None:
            self.first_capture_s = time.perf_counter() - t0

    def release(self) -> None:
        """Free the captured step and its buffers (captured again on the next call)."""
        self._step, self._signature, self._layers = None, None, []
        self._ids = self._pos = self._logits = None
        self._draws, self._capacity = None, 0

    # -- decoding --------------------------------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, settings: GenerationSettings | None) -> torch.Tensor:
        """The next token (1,): greedy, the argmax of the float32 logits as ``generate``'s; sampling, a draw on the
        device (``nbkit.ops.sampling``)."""
        if settings is None or not settings.sampling:
            return logits.to(torch.float32).argmax(dim=-1)
        self._draws.refill()
        return self._draws.choose(logits)

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, input_ids: torch.Tensor, config: Any,
                 on_token: Callable[[int], None] | None = None,
                 settings: GenerationSettings | None = None) -> list[int]:
        """Tokens for ``input_ids`` (1, P) under generation ``config`` (``max_new_tokens`` and ``eos_token_id``
        are read from it), greedy unless ``settings`` sample. Stops after an eos id, which is included, as
        ``generate`` does. Greedy: ``generate``'s tokens; sampling: each token drawn from the step's logits."""
        prompt_len, max_new = input_ids.shape[1], int(config.max_new_tokens)
        eos = config.eos_token_id
        stop_ids = set([eos] if isinstance(eos, int) else (eos or []))
        sampling = settings is not None and settings.sampling
        self.prepare(model, prompt_len + max_new)
        first = copy.deepcopy(config)
        first.max_new_tokens = 1
        first.return_dict_in_generate = True
        if sampling:  # the prompt's logits through generate, the draw here (one generator for every token)
            first.do_sample = False
            for name in ("temperature", "top_p", "top_k", "min_p"):
                setattr(first, name, None)
            first.output_logits = True
            vocab = self._logits.shape[-1]
            if self._draws is None or self._draws.noise.shape[-1] != vocab:
                self._draws = Draws(1, vocab, self._ids.device)
            self._draws.load(settings)
        out = model.generate(input_ids=input_ids, generation_config=first)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        token = int(self._choose(out.logits[0], settings)) if sampling else int(out.sequences[0, -1])
        tokens = [token]
        if on_token:
            on_token(token)
        if token in stop_ids or max_new <= 1:
            return tokens
        for layer, cached in zip(self._layers, cache.layers):
            layer.kbuf[:, :, :prompt_len].copy_(cached.keys)
            layer.vbuf[:, :, :prompt_len].copy_(cached.values)
        del out, cache
        self._ids.fill_(token)
        for position in range(prompt_len, prompt_len + max_new - 1):
            self._pos.fill_(position)
            self._step.replay(position + 1)
            nxt = self._choose(self._logits[:, -1, :], settings)
            self._ids.copy_(nxt.view(1, 1))
            token = int(nxt)
            tokens.append(token)
            if on_token:
                on_token(token)
            if token in stop_ids:
                break
        return tokens
