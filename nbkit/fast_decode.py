"""Greedy chat decoding near the GPU's bandwidth: the whole one-token step, argmax included, replayed as one CUDA
graph on a dense copy of the model (``nbkit.dense_twin``).

Why: ``nbkit.graphed_decode`` replays the step in segments between eager attention calls, so that every kernel is
``generate``'s own; at batch 1 the host then still issues ~60 attention calls a token, and the 4-bit layers run
their dequantizing kernels and four adapter kernels each. Here the step holds no host work at all: attention reads
the fixed key/value buffers under a mask built on the device from the position, the next token is chosen and fed
back inside the graph, and the host reads the tokens back in chunks. The step's attention is the modeling module's
eager (math) attention with an additive mask (``_step_attention``). On the dense copy each linear layer is one
matrix-vector product; Liger's fused norm/SwiGLU/RoPE kernels are used where ``fused_kernels`` knows the family.

The tokens: the dense copy sums each layer's base weight and adapters in float32 and rounds once (bf16), and the
attention sums over a padded length, so the logits differ from the slow path by rounding at the level of its own
bf16 rounding; the greedy tokens are the same wherever the slow path's choice is not a near-tie (tested on a trained
model, measured on the benchmark's random-weight model: ``benchmarks/chat.py``).

Contract (``FastDecoder``): ``check(model, total_len)`` -> None or the reason this path does not apply (those of
``GraphedDecoder.check``, plus no room for the dense copy); ``prepare`` builds the copy (again when the model's
weights or adapters changed: ``dense_twin.signature``) and captures the step (again when more positions are
needed); ``generate`` returns the greedy tokens, the stop token included, as ``GraphedDecoder.generate`` does;
``release()`` frees the copy and the graph; ``dense(model)`` is the copy alone (batched evaluation decodes on it:
``nbkit.generation``). Raises ``Unsupported`` (from ``graphed_decode``) with the reason.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from typing import Any, Callable, Iterator

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from . import dense_twin
from .graphed_decode import GraphedDecoder, Unsupported, _BufferLayer, _cache_kwarg, step_buffers

logger = logging.getLogger(__name__)

_IMPL = "nbkit_whole_"  # + the original implementation's name
_KWARG = "nbkit_whole"
_BLOCK = 512  # buffer capacity grows in steps of this many positions
DECODER_ATTR = "_nbkit_fast_decoder"  # where the decoder is kept on the model
CHUNK = 16  # tokens replayed between two reads on the host (a stop token is found at most CHUNK - 1 steps late)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    step: _WholeStep = kwargs.pop(_KWARG)
    return step.attend(module, query, kwargs), None


def _register(original_impl: str) -> str:
    name = _IMPL + original_impl
    AttentionInterface.register(name, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original_impl])
    return name


class _WholeStep:
    """The attention of a captured step: every layer attends over its whole buffer, masked past the position."""

    def __init__(self, original: Callable, layers: list[_BufferLayer], position: torch.Tensor) -> None:
        self.original, self.layers, self.position = original, layers, position
        capacity = layers[0].kbuf.shape[2]
        self.arange = torch.arange(capacity, device=position.device)
        self.mask: torch.Tensor | None = None

    def attend(self, module: torch.nn.Module, query: torch.Tensor, kwargs: dict) -> torch.Tensor:
        layer = self.layers[module.layer_idx]
        if module.layer_idx == 0 or self.mask is None or self.mask.dtype != query.dtype:
            visible = self.arange <= self.position.view(1)
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            self.mask = torch.where(visible, zero, torch.finfo(query.dtype).min).view(1, 1, 1, -1)
        return self.original(module, query, layer.kbuf, layer.vbuf, self.mask, **kwargs)[0]


def _step_attention(twin: torch.nn.Module) -> Callable:
    """The attention the captured step runs: the modeling module's own eager (math) attention, whatever the model's
    implementation. Why: it takes the additive mask over the whole buffer as written (softmax in float32), where the
    fused SDPA kernels' handling of a broadcast mask at one query row is theirs to choose."""
    attn = next((m for m in twin.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")), None)
    eager = getattr(inspect.getmodule(type(attn)), "eager_attention_forward", None) if attn else None
    if eager is None:
        raise Unsupported("no eager attention function found in the model's modeling module")
    return eager


def decoder_of(model: torch.nn.Module) -> FastDecoder:
    """The ``FastDecoder`` kept on ``model`` (made at the first call; ``chat`` and ``generate_answers`` share it)."""
    decoder = model.__dict__.get(DECODER_ATTR)
    if decoder is None:
        decoder = model.__dict__[DECODER_ATTR] = FastDecoder()
    return decoder


class FastDecoder:
    """Greedy decoding of one model through its dense copy and one captured step (see the module docstring)."""

    def __init__(self) -> None:
        self.twin: torch.nn.Module | None = None
        self.captures = 0
        self.reported = False
        self.first_capture_s: float | None = None
        self.build_s: float | None = None
        self.fused: dict[str, int] = {}
        self._signature: tuple | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._layers: list[_BufferLayer] = []
        self._capacity = 0
        self._ids = self._pos = self._tokens = None

    @staticmethod
    def check(model: torch.nn.Module, total_len: int) -> str | None:
        return GraphedDecoder.check(model, total_len)

    def release(self) -> None:
        """Free the dense copy, the buffers and the graph."""
        self.twin = self._graph = self._signature = None
        self._layers, self._capacity = [], 0
        self._ids = self._pos = self._tokens = None

    @contextlib.contextmanager
    def _kernels(self) -> Iterator[None]:
        """Liger's fused kernels on the dense copy for the block, where the family has them (else plain)."""
        from .speedups.fused_kernels import FusedKernels

        fused = FusedKernels()
        try:
            if fused.attach(self.twin):
                self.fused = dict(fused.counts)
            yield
        finally:
            fused.detach()

    def dense(self, model: torch.nn.Module) -> torch.nn.Module:
        """The dense copy of ``model`` as it is now (built, or rebuilt when stale); raises ``Unsupported``."""
        signature = dense_twin.signature(model)
        if self.twin is None or signature != self._signature:
            self.release()
            reason = dense_twin.fits(model)
            if reason:
                raise Unsupported(reason)
            t0 = time.perf_counter()
            try:
                self.twin = dense_twin.build(model)
            except (ValueError, AttributeError, KeyError, RuntimeError) as error:  # a layout the copy does not know
                self.release()
                raise Unsupported(f"no dense copy: {error}") from error
            self.build_s = time.perf_counter() - t0
            self._signature = signature
        return self.twin

    def prepare(self, model: torch.nn.Module, total_len: int) -> None:
        """The dense copy and a step with room for ``total_len`` positions; raises ``Unsupported``."""
        reason = self.check(model, total_len)
        if reason:
            raise Unsupported(reason)
        self.dense(model)
        if self._graph is None or total_len > self._capacity:
            t0 = time.perf_counter()
            self._capture(-(-total_len // _BLOCK) * _BLOCK)
            if self.first_capture_s is None:
                self.first_capture_s = time.perf_counter() - t0

    def _allocate(self, capacity: int) -> None:
        self._ids, self._pos, self._layers = step_buffers(self.twin, self.twin, capacity)
        self._tokens = torch.zeros((capacity,), dtype=torch.long, device=self._ids.device)
        self._capacity = capacity

    def _capture(self, capacity: int) -> None:
        twin = self.twin
        self._graph = None
        self._allocate(capacity)
        original_impl = twin.config._attn_implementation
        step = _WholeStep(_step_attention(twin), self._layers, self._pos)
        kwargs = {"input_ids": self._ids, "position_ids": self._pos, _cache_kwarg(twin): Cache(layers=self._layers),
                  "use_cache": True, "logits_to_keep": 1, "return_dict": True, _KWARG: step}

        def body() -> None:
            logits = twin(**kwargs).logits
            token = logits[:, -1, :].to(torch.float32).argmax(dim=-1)
            self._tokens.index_copy_(0, self._pos.view(1), token)
            self._ids.copy_(token.view(1, 1))
            self._pos.add_(1)

        twin.set_attn_implementation(_register(original_impl))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), self._kernels():
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    body()  # warm-up: lazy initialisations outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
                self._pos.zero_()
                with torch.cuda.graph(graph):
                    body()
        except Exception as error:
            self.release()
            raise Unsupported(f"its decode step cannot be captured whole ({type(error).__name__}: {error})") from error
        finally:
            if self.twin is not None:
                twin.set_attn_implementation(original_impl)
        self._graph = graph
        self.captures += 1

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, input_ids: torch.Tensor, config: Any,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        """Greedy tokens for ``input_ids`` (1, P) under generation ``config`` (``max_new_tokens`` and
        ``eos_token_id`` are read from it). Stops after a stop id, which is included, as ``generate`` does."""
        prompt_len, max_new = input_ids.shape[1], int(config.max_new_tokens)
        eos = config.eos_token_id
        stop_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.prepare(model, prompt_len + max_new)
        twin = self.twin
        cache = DynamicCache()
        with self._kernels():
            out = twin(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{_cache_kwarg(twin): cache})
        first = out.logits[:, -1, :].to(torch.float32).argmax(dim=-1)
        tokens: list[int] = []

        def emit(token: int) -> bool:
            tokens.append(token)
            if on_token:
                on_token(token)
            return token in stop_ids or len(tokens) >= max_new

        if emit(int(first)):
            return tokens
        for layer, cached in zip(self._layers, cache.layers):
            layer.kbuf[:, :, :prompt_len].copy_(cached.keys)
            layer.vbuf[:, :, :prompt_len].copy_(cached.values)
        del out, cache
        self._ids.copy_(first.view(1, 1))
        self._pos.fill_(prompt_len)
        done, left = prompt_len, max_new - 1
        while left > 0:
            n = min(CHUNK, left)
            for _ in range(n):
                self._graph.replay()
            for token in self._tokens[done : done + n].tolist():
                if emit(token):
                    return tokens
            done, left = done + n, left - n
        return tokens
