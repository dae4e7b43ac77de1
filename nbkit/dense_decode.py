"""Greedy decoding on a dense copy of the model, one CUDA graph a step: chat and batched answers at several times
the speed of the model's own step, when the GPU has room for the copy.

Why: a decode step of a 4-bit model with LoRA adapters, run through transformers, bitsandbytes and PEFT, is ~50
kernels a layer, most of them tiny (``graphed_decode`` replays them without the host, but keeps them all). This path
decodes from a copy of the weights made once: each projection's 4-bit weight dequantized, its active LoRA adapters
merged in (``W + scale * B @ A``, in float32, rounded once to the compute dtype), q/k/v fused into one matrix and
gate/up into another. A step is then ~10 kernels a layer: four matmuls (the residual added in place by the output
ones) and, on a CUDA device, one Triton kernel each for the two norms, q/k norm + rotary + key/value write,
attention over fixed key/value buffers under a mask (and the combine of its splits), and the SiLU product
(``nbkit.ops.decode_kernels``). The step is recorded once as a single CUDA graph that also picks the next token and
advances the position, so decoding is one ``replay()`` a token with no host sync until the tokens are read. The
prompt goes through the same copy in one eager pass.

Contract:
- ``check(model, ...)`` returns None or the reason this path does not apply (no CUDA, a family outside
  ``FAMILIES``, a quantization or adapter kind it cannot merge, a generation config that changes greedy choices,
  sliding windows shorter than the conversation, not enough memory). The rule for memory: the dense copy, its
  key/value buffers and the prompt's activations must fit twice over between what the process holds and its limit
  (``nbkit.memory.room_for``).
- ``generate(model, input_ids, attention_mask, ...)`` decodes a left-padded batch greedily: the prompt goes through
  the dense copy at once (``prefill``, positions and masks as ``generate``'s), writing the key/value buffers and
  giving the first token, then the captured step runs. Rows that emitted a stop id get the pad id afterwards, as in
  ``generate``.
- The dense copy is rebuilt when any parameter of the model changes (its storage or its in-place version counter:
  training between two chats) or the adapters are switched; ``release()`` frees it.
- Tokens: the same arithmetic as the model's step, in other kernels (merged and fused matmuls, dense instead of
  4-bit matmuls), so logits differ by rounding; a greedy token can differ from ``generate``'s only where its two
  best logits are within that rounding (tests hold it to that, on CPU and GPU).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import memory
from .graphed_decode import Unsupported, greedy_changers, parameter_signature
from .model_parts import unwrap_model
from .ops import decode_kernels as kernels

logger = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # pre-norm, SiLU-gated MLP, rotary attention; Qwen3: q/k norms
_BLOCK = 512  # key/value capacity grows in steps of this many positions
_CHUNK = 8  # steps replayed between two reads of the tokens (stopping and streaming)
_STOPS = 8  # room for this many stop ids in a captured step
_STATIC_ROPE = (None, "default", "linear", "llama3", "yarn", "longrope_static")


@dataclass
class _Layer:
    """One decoder layer's dense weights (``[out, in]``, compute dtype) and norm weights."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    wgu: torch.Tensor
    bgu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: the per-head norms of queries and keys
    k_norm: torch.Tensor | None


def _dense(module: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``module``'s effective weight and bias as a dense ``dtype`` tensor: 4-bit/8-bit weights dequantized, active
    LoRA adapters that are not merged yet added in float32."""
    from .trl_seam import BaseTunerLayer, LoraLayer, dequantize_module_weight

    base, deltas = module, []
    if isinstance(module, BaseTunerLayer):
        if not isinstance(module, LoraLayer):
            raise Unsupported(f"adapters of kind {type(module).__name__} (only LoRA is merged)")
        base = module.get_base_layer()
        if not module.disable_adapters:
            for name in module.active_adapters:
                if name not in module.lora_A or name in module.merged_adapters:
                    continue
                if getattr(module, "lora_variant", {}).get(name) is not None:
                    raise Unsupported(f"LoRA variant {type(module.lora_variant[name]).__name__} (DoRA, ...)")
                if getattr(module, "lora_bias", {}).get(name):
                    raise Unsupported("LoRA adapters with lora_bias")
                deltas.append(name)
    if getattr(base, "fan_in_fan_out", False):
        raise Unsupported("fan_in_fan_out weights")
    weight = dequantize_module_weight(base)
    if weight.dim() != 2:
        raise Unsupported(f"a {type(base).__name__} weight of shape {tuple(weight.shape)}")
    if deltas:
        weight = weight.to(torch.float32, copy=True)  # the model's weight is not touched
        for name in deltas:
            weight += module.get_delta_weight(name).float()
    bias = getattr(base, "bias", None)
    return weight.detach().to(dtype), (None if bias is None else bias.detach().to(dtype))


def _fused(parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([w for w, _ in parts])
    if all(b is None for _, b in parts):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _compute_dtype(base: torch.nn.Module) -> torch.dtype:
    for module in base.modules():
        dtype = getattr(module, "compute_dtype", None)  # bitsandbytes' 4-bit layers
        if isinstance(dtype, torch.dtype):
            return dtype
    return base.get_input_embeddings().weight.dtype


def signature_of(model: torch.nn.Module) -> tuple:
    """What the dense copy depends on: every parameter's storage and in-place version, and the adapter switches."""
    return parameter_signature(model, versions=True)


class DenseWeights:
    """The dense, merged, fused weights of a supported model, and what a step needs to know of its shape."""

    def __init__(self, model: torch.nn.Module) -> None:
        base = unwrap_model(model)
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        inner = base.model
        self.dtype = _compute_dtype(base)
        embed = base.get_input_embeddings()
        if type(embed) is not torch.nn.Embedding:
            raise Unsupported(f"input embeddings of type {type(embed).__name__}")
        self.embed = embed.weight.detach().to(self.dtype)
        self.lm_head, lm_bias = _dense(base.get_output_embeddings(), self.dtype)
        if lm_bias is not None:
            raise Unsupported("an lm_head with a bias")
        self.final_norm, self.eps = inner.norm.weight.detach().to(self.dtype), _eps(inner.norm)
        self.rotary = inner.rotary_emb
        first = inner.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.scaling = float(first.scaling)
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _fused([_dense(attn.q_proj, self.dtype), _dense(attn.k_proj, self.dtype),
                          _dense(attn.v_proj, self.dtype)])
            gu = _fused([_dense(mlp.gate_proj, self.dtype), _dense(mlp.up_proj, self.dtype)])
            wo, bo = _dense(attn.o_proj, self.dtype)
            wd, bd = _dense(mlp.down_proj, self.dtype)
            q_norm = k_norm = None
            if hasattr(attn, "q_norm"):
                q_norm, k_norm = (attn.q_norm.weight.detach().to(self.dtype),
                                  attn.k_norm.weight.detach().to(self.dtype))
            self.layers.append(_Layer(layer.input_layernorm.weight.detach().to(self.dtype),
                                      layer.post_attention_layernorm.weight.detach().to(self.dtype),
                                      qkv[0], qkv[1], wo, bo, gu[0], gu[1], wd, bd, q_norm, k_norm))
        self.intermediate = self.layers[0].wgu.shape[0] // 2
        self.nbytes = sum(t.numel() * t.element_size() for layer in self.layers for t in vars(layer).values()
                          if isinstance(t, torch.Tensor))
        if self.lm_head.data_ptr() != base.get_output_embeddings().weight.data_ptr():
            self.nbytes += self.lm_head.numel() * self.lm_head.element_size()


def dense_bytes(model: torch.nn.Module) -> int:
    """The bytes a dense copy of ``model``'s decoder-layer projections takes in its compute dtype (nothing is made)."""
    base = unwrap_model(model)
    size = torch.tensor([], dtype=_compute_dtype(base)).element_size()
    names = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
             ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
    total = 0
    for layer in base.model.layers:
        for part, name in names:
            module = getattr(getattr(layer, part), name)
            module = module.get_base_layer() if hasattr(module, "get_base_layer") else module
            total += int(module.in_features) * int(module.out_features)
    return total * size


class _State:
    """The static tensors one captured step reads and writes, for a batch of ``batch`` rows and ``capacity``
    positions: token ids, rotary positions, the slot being written, the mask, key/value buffers, the tokens made."""

    def __init__(self, weights: DenseWeights, batch: int, capacity: int, device: torch.device) -> None:
        dtype, kv, d = weights.dtype, weights.kv_heads, weights.head_dim
        self.batch, self.capacity = batch, capacity
        self.split = kernels.split_for(batch * weights.kv_heads, capacity)  # keys per attention program
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.stops = torch.full((_STOPS,), -1, dtype=torch.long, device=device)
        self.pad = torch.zeros((), dtype=torch.long, device=device)
        self.mask = torch.zeros((batch, capacity), dtype=dtype, device=device)
        self.tokens = torch.zeros((batch, capacity), dtype=torch.long, device=device)
        self.logits = torch.zeros((batch, weights.lm_head.shape[0]), dtype=dtype, device=device)  # the last step's
        shape = (batch, kv, capacity, d)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in weights.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in weights.layers]
        positions = torch.arange(capacity, device=device)[None]
        probe = torch.zeros((1, 1, d), dtype=dtype, device=device)
        with torch.no_grad():
            cos, sin = weights.rotary(probe, positions)
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)  # (capacity, head_dim)


def decode_step(w: DenseWeights, s: _State, use_triton: bool = False) -> None:
    """One greedy step for every row: attend at ``s.slot``, write the next token, advance. Only in-place writes to
    ``s``'s tensors; no host sync and no value read on the host, so it can be captured and replayed as it is.
    ``use_triton``: the step's small ops as ``nbkit.ops.decode_kernels``' Triton kernels (else their torch
    references)."""
    x = F.embedding(s.ids, w.embed)  # (b, hidden)
    s.mask.index_fill_(1, s.slot, 0.0)
    for layer, keys, values in zip(w.layers, s.keys, s.values):
        x = layer_step(x, layer, keys, values, s, w, use_triton)
    logits = F.linear(kernels.rms_norm(x, w.final_norm, w.eps, use_triton), w.lm_head)
    s.logits.copy_(logits)
    nxt = torch.where(s.unfinished, logits.argmax(dim=-1), s.pad)
    s.tokens.index_copy_(1, s.slot, nxt[:, None])
    s.unfinished &= ~(nxt[:, None] == s.stops[None, :]).any(dim=-1)
    s.ids.copy_(nxt)
    s.slot += 1
    s.pos += 1


def layer_step(x: torch.Tensor, layer: _Layer, keys: torch.Tensor, values: torch.Tensor, s: _State,
               w: DenseWeights, use_triton: bool = False) -> torch.Tensor:
    """One decoder layer on one token a row: ``x`` (b, hidden) in, the next residual stream out; writes the row's
    key and value at ``s.slot``."""
    b = x.shape[0]
    n = kernels.rms_norm(x, layer.ln1, w.eps, use_triton)
    qkv = F.linear(n, layer.wqkv, layer.bqkv)
    q = kernels.qk_rope_cache(qkv, keys, values, layer.q_norm, layer.k_norm, s.cos, s.sin, s.pos, s.slot, w.heads,
                              w.eps, use_triton)
    a = kernels.decode_attention(q, keys, values, s.mask, s.slot, w.scaling, use_triton, s.split)
    x = x.addmm_(a.reshape(b, -1), layer.wo.t())  # in place: the residual stream is this step's own tensor
    if layer.bo is not None:
        x = x + layer.bo
    n = kernels.rms_norm(x, layer.ln2, w.eps, use_triton)
    x = x.addmm_(kernels.silu_mul(F.linear(n, layer.wgu, layer.bgu), use_triton), layer.wd.t())
    if layer.bd is not None:
        x = x + layer.bd
    return x


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_triton: bool) -> torch.Tensor:
    return kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, use_triton).reshape(x.shape)


def prefill(w: DenseWeights, s: _State, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            use_triton: bool = False) -> torch.Tensor:
    """Run the left-padded prompts (B, P) through the dense copy at once: their keys and values are written to
    slots 0..P-1, the last position's logits to ``s.logits``; returns the first greedy token of each row. Positions
    and masking as ``generate``'s (a padded query sees itself only; no one sees a padded key)."""
    b, p = input_ids.shape
    h, kv, d = w.heads, w.kv_heads, w.head_dim
    keep = attention_mask.bool()
    pos = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    cos, sin = s.cos[pos][:, :, None], s.sin[pos][:, :, None]  # (b, p, 1, d)
    causal = torch.ones((p, p), dtype=torch.bool, device=input_ids.device).tril()
    diagonal = torch.eye(p, dtype=torch.bool, device=input_ids.device)
    seen = ((causal[None] & keep[:, None, :]) | diagonal[None])[:, None]  # (b, 1, p, p)
    x = F.embedding(input_ids, w.embed)
    for layer, keys, values in zip(w.layers, s.keys, s.values):
        qkv = F.linear(_norm(x, layer.ln1, w.eps, use_triton), layer.wqkv, layer.bqkv)
        q = qkv[..., : h * d].reshape(b, p, h, d)
        k = qkv[..., h * d : (h + kv) * d].reshape(b, p, kv, d)
        if layer.q_norm is not None:
            q, k = _norm(q, layer.q_norm, w.eps, use_triton), _norm(k, layer.k_norm, w.eps, use_triton)
        q = kernels.rotate(q, cos, sin).transpose(1, 2)
        k = kernels.rotate(k, cos, sin).transpose(1, 2)
        v = qkv[..., (h + kv) * d :].reshape(b, p, kv, d).transpose(1, 2)
        keys[:, :, :p].copy_(k)
        values[:, :, :p].copy_(v)
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1),
                                           attn_mask=seen, scale=w.scaling)
        x = x + F.linear(a.transpose(1, 2).reshape(b, p, h * d), layer.wo, layer.bo)
        gu = F.linear(_norm(x, layer.ln2, w.eps, use_triton), layer.wgu, layer.bgu).reshape(b * p, -1)
        x = x + F.linear(kernels.silu_mul(gu, use_triton).reshape(b, p, -1), layer.wd, layer.bd)
    logits = F.linear(kernels.rms_norm(x[:, -1], w.final_norm, w.eps, use_triton), w.lm_head)
    s.logits.copy_(logits)
    return logits.argmax(dim=-1)


def _supported(model: torch.nn.Module, total_len: int) -> str | None:
    base = unwrap_model(model)
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"model family {family!r} (the dense step covers {', '.join(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type not in _STATIC_ROPE:
        return f"rotary embedding of type {rope_type!r} (its frequencies depend on the length)"
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    sliding = window is not None and (types is None or "sliding_attention" in types)
    if family in ("qwen2",) and not getattr(config, "use_sliding_window", False):
        sliding = False
    if sliding and total_len >= window:
        return f"sliding-window attention ({window} positions) shorter than this conversation ({total_len})"
    changers = greedy_changers(base.generation_config)
    if changers:
        return "the generation config changes greedy choices: " + ", ".join(changers)
    return None


class DenseDecoder:
    """Greedy decoding through a dense copy and one captured step (see the module docstring).

    ``graphs=False`` runs the same step eagerly (any device): what the CPU tests compare with ``generate``.
    ``kernels``: "auto" (the step's small ops as Triton kernels on a CUDA device where they take the head size,
    else torch), "triton" or "torch". ``build_s`` is the time the last dense copy took; ``captures`` counts the
    captured steps.
    """

    def __init__(self, graphs: bool = True, kernels: str = "auto") -> None:
        if kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be 'auto', 'triton' or 'torch', not {kernels!r}")
        self.graphs = graphs
        self.kernels = kernels
        self.weights: DenseWeights | None = None
        self.build_s: float | None = None
        self.captures = 0
        self.reported = False
        self._signature: tuple | None = None
        self._states: dict[int, tuple[_State, Any]] = {}  # batch -> (state, graph or None)
        self._failed: tuple[tuple, str] | None = None  # (signature, reason) of a copy or capture that failed

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

    def _step(self, state: _State) -> None:
        decode_step(self.weights, state, self.uses_triton())

    def check(self, model: torch.nn.Module, total_len: int, batch: int = 1,
              signature: tuple | None = None) -> str | None:
        """None if ``model`` can decode ``batch`` rows of up to ``total_len`` positions here, else the reason.
        ``signature``: the model's ``signature_of`` when the caller has it (it walks every module)."""
        base = unwrap_model(model)
        try:
            device = next(base.parameters()).device
        except StopIteration:
            return "the model has no parameters"
        if self.graphs and (not torch.cuda.is_available() or device.type != "cuda"):
            return "no CUDA device" if not torch.cuda.is_available() else f"the model is on {device.type}"
        if getattr(base, "hf_device_map", None) and len(set(map(str, base.hf_device_map.values()))) > 1:
            return "the model is spread over several devices"
        reason = _supported(model, total_len)
        if reason:
            return reason
        signature = signature or signature_of(model)
        if self._failed is not None and self._failed[0] == signature:
            return self._failed[1]
        kept = self.weights is not None and self._signature == signature
        need = 0 if kept else dense_bytes(model)
        config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
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

    def prepare(self, model: torch.nn.Module, batch: int, total_len: int,
                signature: tuple | None = None) -> _State:
        """The dense copy (made or kept) and a captured step for ``batch`` rows of ``total_len`` positions; raises
        ``Unsupported`` (and remembers why until the model changes) when the copy or the capture fails."""
        signature = signature or signature_of(model)
        try:
            return self._prepare(model, signature, batch, total_len)
        except Unsupported as error:
            self.release()
            self._failed = (signature, str(error))
            raise

    def _prepare(self, model: torch.nn.Module, signature: tuple, batch: int, total_len: int) -> _State:
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
        state, graph = self._states.get(batch, (None, None))
        if state is not None and total_len <= state.capacity:
            return state
        device = self.weights.embed.device
        capacity = max(state.capacity if state else 0, -(-total_len // _BLOCK) * _BLOCK)
        self._states.pop(batch, None)
        state = _State(self.weights, batch, capacity, device)
        graph = self._capture(state) if self.graphs else None
        self._states[batch] = (state, graph)
        return state

    def _capture(self, state: _State) -> Any:
        """Record ``decode_step`` on ``state`` as one CUDA graph (after a warm-up on a side stream)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(2):
                self._step(state)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), torch.cuda.graph(graph):
                self._step(state)
        except Exception as error:
            raise Unsupported(f"its dense step cannot be captured ({type(error).__name__}: {error})") from error
        self.captures += 1
        return graph

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, input_ids: torch.Tensor, config: Any,
                 attention_mask: torch.Tensor | None = None,
                 on_tokens: Callable[[torch.Tensor], None] | None = None,
                 signature: tuple | None = None) -> list[list[int]]:
        """Greedy tokens for each row of the left-padded ``input_ids`` (B, P) under generation ``config``
        (``max_new_tokens``, ``eos_token_id``, ``pad_token_id`` are read from it), each row up to and including its
        first stop id. ``on_tokens`` gets each new chunk of tokens, (B, n), as they are read; ``signature``: the
        model's ``signature_of``, when the caller took it for ``check`` already."""
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
        state = self.prepare(model, batch, prompt_len + max_new, signature)
        graph = self._states[batch][1]
        token = prefill(self.weights, state, input_ids, attention_mask, self.uses_triton())
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
                if graph is not None:
                    graph.replay()
                else:
                    self._step(state)
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
