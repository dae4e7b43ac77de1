"""Decoding on a dense copy of the model, one CUDA graph a step: chat and batched answers at several times the speed
of the model's own step, when the GPU has room for the copy.

Why: a decode step of a 4-bit model with LoRA adapters, run through transformers, bitsandbytes and PEFT, is ~50
kernels a layer, most of them tiny (``nbkit.decode.graphed`` replays them without the host, but keeps them all). This path
decodes from a copy of the weights made once: each projection's 4-bit weight dequantized, its active LoRA adapters
merged in (``W + scale * B @ A``, in float32, rounded once to the compute dtype), q/k/v fused into one matrix and
gate/up into another. A step is then ~10 kernels a layer: four matmuls (the residual added in place by the output
ones) and, on a CUDA device, one Triton kernel each for the two norms, q/k norm + rotary + key/value write,
attention over fixed key/value buffers under a mask (and the combine of its splits), and the SiLU product
(``nbkit.ops.decode_kernels``). The step is recorded once (through a ``nbkit.ops.layer_graphs`` backend) as a single
CUDA graph that also picks the next token and advances the position, so decoding is one ``replay()`` a token with no
host sync until the tokens are read. The prompt goes through the same copy in one eager pass (``dense_step``; the
copy itself is ``dense_weights``).

Contract:
- ``check(model, ...)`` returns None or the reason this path does not apply (no CUDA, a family outside
  ``FAMILIES``, a quantization or adapter kind it cannot merge, a generation config that changes greedy choices,
  sliding windows shorter than the conversation, not enough memory). The rule for memory: the dense copy, its
  key/value buffers and the prompt's activations must fit twice over between what the process holds and its limit
  (``nbkit.memory.room_for``).
- ``prepare(model, batch, total_len, ...)`` makes (or keeps) the copy, the buffers and the captured step.
- ``generate(model, input_ids, config, attention_mask, ...)`` decodes a left-padded batch: the prompt goes through
  the dense copy at once (``prefill``, positions and masks as ``generate``'s), writing the key/value buffers and
  giving the first token, then the captured step runs. Rows that emitted a stop id get the pad id afterwards, as in
  ``generate``.
- The dense copy is rebuilt when any parameter of the model changes (its storage or its in-place version counter:
  training between two chats) or the adapters are switched; ``release()`` frees it.
- Sampling (``settings`` a sampling ``GenerationSettings``): the captured step draws each token on the device from
  noise refilled before each replay (one ``exponential_`` kernel, no host read; ``nbkit.ops.sampling``), so a
  sampled token costs what a greedy one does plus the filters; greedy steps are captured without any of it.
- Tokens: the same arithmetic as the model's step, in other kernels (merged and fused matmuls, dense instead of
  4-bit matmuls), so logits differ by rounding; a greedy token can differ from ``generate``'s only where its two
  best logits are within that rounding (tests hold it to that, on CPU and GPU).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from .. import memory
from ..model_parts import unwrap_model
from ..ops import decode_kernels as kernels
from .config import GenerationSettings
from .dense_step import _STOPS, _State, decode_step, prefill
from .dense_weights import DenseWeights, _compute_dtype, dense_bytes
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

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # pre-norm, SiLU-gated MLP, rotary attention; Qwen3: q/k norms
_BLOCK = 512  # key/value capacity grows in steps of this many positions
_CHUNK = 8  # steps replayed between two reads of the tokens (stopping and streaming)
_STATIC_ROPE = (None, "default", "linear", "llama3", "yarn", "longrope_static")


def signature_of(model: torch.nn.Module) -> tuple:
    """What the dense copy depends on: every parameter's storage and in-place version, and the adapter switches."""
    return parameter_signature(model, versions=True)


def _supported(model: torch.nn.Module, total_len: int) -> str | None:
    base = unwrap_model(model)
    config = text_config(base)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"model family {family!r} (the dense step covers {', '.join(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type not in _STATIC_ROPE:
        return f"rotary embedding of type {rope_type!r} (its frequencies depend on the length)"
    window = window_reason(config, total_len)
    if window:
        return window
    changers = greedy_changers(base.generation_config)
    if changers:
        return "the generation config changes greedy choices: " + ", ".join(changers)
    return None


class DenseDecoder:
    """Decoding through a dense copy and one captured step (see the module docstring).

    ``graphs=False`` runs the same step eagerly (any device): what the CPU tests compare with ``generate``.
    ``backend``: the ``nbkit.ops.layer_graphs`` backend the step is captured with (default: CUDA graphs when
    ``graphs``; ``TapeBackend()`` captures and replays on any device, the CPU tests' stand-in).
    ``kernels``: "auto" (the step's small ops as Triton kernels on a CUDA device where they take the head size,
    else torch), "triton" or "torch". ``build_s`` is the time the last dense copy took; ``captures`` counts the
    captured steps (one per batch size and way of choosing: greedy, sampling, sampling with top-k/top-p).
    """

    def __init__(self, graphs: bool = True, kernels: str = "auto", backend: Any = None) -> None:
        if kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be 'auto', 'triton' or 'torch', not {kernels!r}")
        self.backend = backend if backend is not None else default_backend(graphs)
        self.graphs = self.backend is not None
        self.kernels = kernels
        self.weights: DenseWeights | None = None
        self.build_s: float | None = None
        self.captures = 0
        self.reported = False
        self._signature: tuple | None = None
        self._states: dict[int, tuple[_State, dict]] = {}  # batch -> (state, {mode: graph})
        self._failed: tuple[tuple, str] | None = None  # (signature, reason) of a copy or capture that failed
        self._failed_modes: dict[str, tuple[tuple, str]] = {}  # a sampling step's failed capture, by mode

    def release(self) -> None:
        """Free the dense copy, buffers and graphs (they are rebuilt on the next call)."""
        self.weights, self._signature, self._states = None, None, {}

    def uses_triton(self) -> bool:
        """Whether the step's small ops run as Triton kernels (decided from the dense copy; False before one)."""
        w = self.weights
        if w is None or self.kernels == "torch":
            return False
        if self.kernels == "triton":
            return True
        return w.embed.is_cuda and kernels.supported(w.head_dim)

    @staticmethod
    def _mode(settings: GenerationSettings | None) -> str:
        if settings is None or not settings.sampling:
            return "greedy"
        return "sample_sorted" if settings.needs_sort else "sample"

    def _step(self, state: _State, mode: str = "greedy") -> None:
        draws = None if mode == "greedy" else state.sampling_draws()
        decode_step(self.weights, state, self.uses_triton(), draws, mode == "sample_sorted")

    def check(self, model: torch.nn.Module, total_len: int, batch: int = 1,
              signature: tuple | None = None) -> str | None:
        """None if ``model`` can decode ``batch`` rows of up to ``total_len`` positions here, else the reason.
        ``signature``: the model's ``signature_of`` when the caller has it (it walks every module)."""
        reason = placement_reason(model, self.backend)
        if reason:
            return reason
        base = unwrap_model(model)
        device = next(base.parameters()).device
        reason = _supported(model, total_len)
        if reason:
            return reason
        signature = signature or signature_of(model)
        if self._failed is not None and self._failed[0] == signature:
            return self._failed[1]
        kept = self.weights is not None and self._signature == signature
        need = 0 if kept else dense_bytes(model)
        config = text_config(base)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        capacity = -(-total_len // _BLOCK) * _BLOCK
        size = torch.tensor([], dtype=self.weights.dtype if kept else _compute_dtype(base)).element_size()
        need += 2 * size * len(base.model.layers) * batch * int(config.num_key_value_heads) * capacity * head_dim
        width = 2 * int(config.intermediate_size) + (int(config.num_attention_heads) + 2 * int(
            config.num_key_value_heads)) * head_dim + 4 * int(config.hidden_size)
        need += size * batch * total_len * width  # the prompt's activations, one layer at a time
        if not memory.room_for(device, need):
            return f"not enough free GPU memory for a dense copy ({memory.fmt_bytes(need)}, twice over)"
        return None

    def prepare(self, model: torch.nn.Module, batch: int, total_len: int, signature: tuple | None = None,
                settings: GenerationSettings | None = None) -> _State:
        """The dense copy (made or kept) and a captured step for ``batch`` rows of ``total_len`` positions, choosing
        tokens as ``settings`` say (default greedy); raises ``Unsupported`` (and remembers why until the model
        changes) when the copy or the capture fails. A sampling step that cannot be captured refuses sampling only
        (the chooser then samples on the graphed path); the copy and the greedy steps stay."""
        signature = signature or signature_of(model)
        mode = self._mode(settings)
        failed = self._failed_modes.get(mode)
        if failed is not None and failed[0] == signature:
            raise Unsupported(failed[1])
        try:
            return self._prepare(model, signature, batch, total_len, mode)
        except Unsupported as error:
            if mode != "greedy" and self.weights is not None:  # greedy decoding keeps its copy and its steps
                self._failed_modes[mode] = (signature, str(error))
                raise
            self.release()
            self._failed = (signature, str(error))
            raise

    def _prepare(self, model: torch.nn.Module, signature: tuple, batch: int, total_len: int, mode: str) -> _State:
        if self.weights is None or signature != self._signature:
            self.release()
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    self.weights = DenseWeights(model)
            except Unsupported:
                raise
            except Exception as error:  # a layout this copy does not know: say so, decode another way
                raise Unsupported(f"its weights cannot be copied ({type(error).__name__}: {error})") from error
            self.build_s = time.perf_counter() - t0
            self._signature = signature
        state, graphs = self._states.get(batch, (None, {}))
        if state is None or total_len > state.capacity:
            device = self.weights.embed.device
            capacity = max(state.capacity if state else 0, -(-total_len // _BLOCK) * _BLOCK)
            self._states.pop(batch, None)
            state, graphs = _State(self.weights, batch, capacity, device), {}
            self._states[batch] = (state, graphs)
        if self.backend is not None and mode not in graphs:
            graphs[mode] = self._capture(state, mode)
        return state

    def _capture(self, state: _State, mode: str) -> Any:
        """Record ``decode_step`` on ``state`` as one graph of the backend (after two warm-up steps)."""
        state.slot.zero_()  # the warm-up and the capture write at slots 0-2; generate sets every input afterwards
        state.pos.zero_()
        if mode != "greedy":
            state.sampling_draws()  # made here, on the caller's stream, before the warm-up's side stream

        def warm_up() -> None:
            for _ in range(2):
                self._step(state, mode)

        with torch.no_grad():
            self.backend.warm_up(warm_up, state.ids.device)
        graph = self.backend.new_graph()
        try:
            with torch.no_grad(), self.backend.capturing(graph, self.backend.pool()):
                self._step(state, mode)
        except Exception as error:
            raise Unsupported(f"its dense step cannot be captured ({type(error).__name__}: {error})") from error
        self.captures += 1
        return graph

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, input_ids: torch.Tensor, config: Any,
                 attention_mask: torch.Tensor | None = None,
                 on_tokens: Callable[[torch.Tensor], None] | None = None,
                 signature: tuple | None = None, settings: GenerationSettings | None = None) -> list[list[int]]:
        """Tokens for each row of the left-padded ``input_ids`` (B, P) under generation ``config``
        (``max_new_tokens``, ``eos_token_id``, ``pad_token_id`` are read from it), greedy unless ``settings``
        sample, each row up to and including its first stop id. ``on_tokens`` gets each new chunk of tokens,
        (B, n), as they are read; ``signature``: the model's ``signature_of``, when the caller took it for
        ``check`` already."""
        batch, prompt_len = input_ids.shape
        max_new = int(config.max_new_tokens)
        eos = config.eos_token_id
        stops = [eos] if isinstance(eos, int) else list(eos or [])
        pad = config.pad_token_id if config.pad_token_id is not None else (stops or [0])[0]
        if len(stops) > _STOPS:
            raise Unsupported(f"more than {_STOPS} stop ids")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        signature = signature or signature_of(model)
        reason = self.check(model, prompt_len + max_new, batch, signature)
        if reason:
            raise Unsupported(reason)
        mode = self._mode(settings)
        state = self.prepare(model, batch, prompt_len + max_new, signature, settings)
        graph = self._states[batch][1].get(mode)
        draws = None
        if mode != "greedy":
            draws = state.sampling_draws()
            draws.load(settings)
            draws.refill()
        token = prefill(self.weights, state, input_ids, attention_mask, self.uses_triton(), draws,
                        mode == "sample_sorted")
        low = torch.finfo(state.mask.dtype).min
        state.mask.fill_(low)
        state.mask[:, :prompt_len].masked_fill_(attention_mask.bool(), 0.0)
        state.ids.copy_(token)
        state.pos.copy_(attention_mask.sum(dim=1))
        state.slot.fill_(prompt_len)
        stop_t = torch.tensor(stops or [-1], dtype=torch.long, device=state.ids.device)
        state.stops.fill_(-1)
        state.stops[: len(stops)].copy_(stop_t[: len(stops)])
        state.pad.fill_(int(pad))
        state.unfinished.copy_(~torch.isin(token, stop_t))
        state.tokens[:, prompt_len - 1].copy_(token)
        made = 1
        if on_tokens:
            on_tokens(token[:, None])
        while made < max_new and bool(state.unfinished.any()):
            n = min(_CHUNK, max_new - made)
            for _ in range(n):
                if draws is not None:
                    draws.refill()  # on the device: the step reads the new noise
                if graph is not None:
                    graph.replay()
                else:
                    self._step(state, mode)
            chunk = state.tokens[:, prompt_len - 1 + made : prompt_len - 1 + made + n]
            if on_tokens:
                on_tokens(chunk)
            made += n
        rows = state.tokens[:, prompt_len - 1 : prompt_len - 1 + made].tolist()
        result = []
        for row in rows:
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            result.append(row[:end])
        return result
