"""Greedy decoding whose one-token step is replayed from CUDA graphs: token for token what ``generate`` gives.

Why: at batch size 1 a decode step of a (4-bit, LoRA-adapted) model is a few thousand small kernels, each issued
by Python (transformers modules, bitsandbytes dequantization, PEFT adapters); the GPU mostly waits for the host.
Replaying the recorded step removes that host work.

How, and why the tokens stay exactly those of ``model.generate(do_sample=False)``:
- the prompt goes through ``model.generate(max_new_tokens=1)`` itself (the same kernels, the same first token);
  its key/value cache is copied into preallocated per-layer buffers;
- one decode step is captured once per model (again when its parameters, adapters or buffer sizes change), from
  the embedding to the logits, in segments that end at each attention call. Between segments the attention runs
  eagerly, through the model's own attention function (sdpa or eager), on contiguous keys and values of exactly
  the cached length: the call, shapes and kernels of ``generate``'s step. A CUDA graph replays the kernels it
  recorded unchanged, so every number of the step, and so every greedy token, is the same. (Attending over a
  fixed padded length, as compiled static-cache decoding does, changes kernels and rounding: its tokens drift
  from ``generate``'s.)
- the next token is the argmax of the float32 logits, as in ``generate`` without logits processors.
"The same tokens" holds as far as ``generate`` reproduces itself: where two logits nearly tie (a random-weight
model after a few hundred tokens, say), run-to-run differences in GPU kernels (e.g. bitsandbytes' 4-bit kernels)
can flip a token in two plain ``generate`` calls already, and then in this path too.

Not covered (``GraphedDecoder.unsupported`` names the reason; callers then use ``generate``): no CUDA; generation
settings that change greedy choices (repetition penalty, forced or suppressed tokens, ...); attention
implementations other than sdpa/eager; sliding-window layers shorter than the conversation; models whose step
cannot be captured (a host sync in the forward, e.g. data-dependent MoE routing loops).
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

from .model_parts import unwrap_model
from .trl_seam import ALL_MASK_ATTENTION_FUNCTIONS, DynamicLayer

logger = logging.getLogger(__name__)

_IMPL = "nbkit_graphed_"  # + the original implementation's name
_KWARG = "nbkit_graphed"
_BLOCK = 512  # buffer capacity grows in steps of this many positions
_GREEDY_CHANGERS = (  # generation-config fields that make greedy decoding differ from a plain argmax
    ("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0), ("bad_words_ids", None), ("min_length", 0),
    ("min_new_tokens", 0), ("forced_bos_token_id", None), ("forced_eos_token_id", None),
    ("suppress_tokens", None), ("begin_suppress_tokens", None), ("sequence_bias", None),
    ("exponential_decay_length_penalty", None), ("guidance_scale", 1.0), ("remove_invalid_values", False),
    ("watermarking_config", None), ("encoder_repetition_penalty", 1.0),
)


class Unsupported(RuntimeError):
    """This model or setting cannot take the graphed path; the message is the reason, for one log line."""


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
    """Warm-up and capture of one decode step, then its replay at any cached length."""

    def __init__(self, original: Callable, eager_impl: bool, layers: list[_BufferLayer]) -> None:
        self.original, self.eager_impl, self.layers = original, eager_impl, layers
        self.capturing = False
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.sites: list[_Site] = []
        self.pool = None
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
        self.graphs[-1].capture_end()
        like = self.out_like[module.layer_idx]
        out = torch.empty_like(like)
        self.sites.append(_Site(module, query, out, layer, kwargs))
        self._begin()
        return out

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def capture(self, forward: Callable[[], Any]) -> Any:
        self.pool = torch.cuda.graph_pool_handle()
        self.capturing = True
        self._begin()
        try:
            out = forward()
            self.graphs[-1].capture_end()
        except BaseException:
            try:  # leave the stream out of capture mode
                self.graphs[-1].capture_end()
            except Exception:
                pass
            self.graphs, self.sites = [], []
            raise
        finally:
            self.capturing = False
        return out

    def replay(self, length: int) -> None:
        for i, graph in enumerate(self.graphs):
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


def greedy_changers(generation_config: Any) -> list[str]:
    """The generation-config fields that would make ``generate``'s greedy tokens differ from a plain argmax."""
    found = []
    for name, neutral in _GREEDY_CHANGERS:
        value = getattr(generation_config, name, neutral)
        if value is not None and value != neutral and not (neutral == 0 and value == 0):
            found.append(f"{name}={value!r}")
    return found


def parameter_signature(model: torch.nn.Module, versions: bool = False) -> tuple:
    """What a decoder built from ``model`` depends on, in one walk over its modules: where every parameter lives
    (a captured step reads them there) and, with ``versions``, their in-place versions too (a copy of their values
    goes stale when an optimizer steps them in place); and each adapter layer's switches."""
    from .trl_seam import BaseTunerLayer

    params, flags = [], []
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                params.append((p.data_ptr(), p._version) if versions else p.data_ptr())
        if isinstance(module, BaseTunerLayer):
            flags.append((module.disable_adapters, tuple(module.active_adapters), tuple(module.merged_adapters)))
    return tuple(params), tuple(flags)


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
    """Greedy decoding of one model through a captured decode step (see the module docstring).

    ``check(model, total_len)`` returns None or the reason the path does not apply; ``generate(...)`` decodes.
    ``first_capture_s`` is the time the first capture took (warm-up, capture); ``captures`` counts them.
    """

    def __init__(self) -> None:
        self.captures = 0
        self.reported = False  # the fallback reason was logged once
        self.first_capture_s: float | None = None
        self._step: _Step | None = None
        self._signature: tuple | None = None
        self._layers: list[_BufferLayer] = []
        self._ids = self._pos = self._logits = None
        self._capacity = 0

    # -- applicability ---------------------------------------------------------------------------------------------
    @staticmethod
    def check(model: torch.nn.Module, total_len: int) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        base = unwrap_model(model)
        try:
            device = next(base.parameters()).device
        except StopIteration:
            return "the model has no parameters"
        if device.type != "cuda":
            return f"the model is on {device.type}"
        if getattr(base, "hf_device_map", None) and len(set(map(str, base.hf_device_map.values()))) > 1:
            return "the model is spread over several devices"
        impl = getattr(base.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            return f"attention implementation {impl!r} (the graphed step runs sdpa or eager)"
        changers = greedy_changers(base.generation_config)
        if changers:
            return "the generation config changes greedy choices: " + ", ".join(changers)
        text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        window = getattr(text, "sliding_window", None)
        types = getattr(text, "layer_types", None)
        sliding = window is not None and (types is None or "sliding_attention" in types)
        if sliding and total_len >= window:
            return f"sliding-window attention ({window} positions) shorter than this conversation ({total_len})"
        return None

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
        step = _Step(original, original_impl == "eager", self._layers)
        cache = Cache(layers=self._layers)
        kwargs = {"input_ids": self._ids, "position_ids": self._pos, _cache_kwarg(base): cache, "use_cache": True,
                  "logits_to_keep": 1, "return_dict": True, _KWARG: step}
        for layer in self._layers:
            layer.length = 0
        self._pos.zero_()
        base.set_attn_implementation(_register(original_impl))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.no_grad(), torch.cuda.stream(stream):
                model(**kwargs)  # warm-up: lazy initialisations, and the attention output shapes
                for layer in self._layers:
                    layer.length = 0
                torch.cuda.synchronize()
                out = step.capture(lambda: model(**kwargs))
        except Unsupported:
            raise
        except Exception as error:
            raise Unsupported(f"its decode step cannot be captured ({type(error).__name__}: {error})") from error
        finally:
            base.set_attn_implementation(original_impl)
            torch.cuda.current_stream().wait_stream(stream)
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

    # -- decoding --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, model: torch.nn.Module, input_ids: torch.Tensor, config: Any,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        """Greedy tokens for ``input_ids`` (1, P) under generation ``config`` (greedy; ``max_new_tokens`` and
        ``eos_token_id`` are read from it). Stops after an eos id, which is included, as ``generate`` does."""
        prompt_len, max_new = input_ids.shape[1], int(config.max_new_tokens)
        eos = config.eos_token_id
        stop_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.prepare(model, prompt_len + max_new)
        first = copy.deepcopy(config)
        first.max_new_tokens = 1
        out = model.generate(input_ids=input_ids, generation_config=first, return_dict_in_generate=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        token = int(out.sequences[0, -1])
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
            nxt = self._logits[:, -1, :].to(torch.float32).argmax(dim=-1)
            self._ids.copy_(nxt.view(1, 1))
            token = int(nxt)
            tokens.append(token)
            if on_token:
                on_token(token)
            if token in stop_ids:
                break
        return tokens
