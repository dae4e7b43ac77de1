"""CUDA graphs for the decoder layers that are not checkpointed: each layer's forward and backward is one replay.

Why: on short rows a QLoRA step is bound by the host. Every decoder layer's forward and backward launch a few hundred
kernels from Python (PEFT's and nbkit's LoRA functions, bitsandbytes' dequantization, Liger's kernels, autograd's
engine), and the GPU finishes each before the next is launched. A captured graph launches them all from one call.

How:

- Buckets. A graph has fixed shapes, and packed or padding-free micro-batches do not: a micro-batch of ``T`` tokens
  runs on the graphs of the smallest bucket (``BUCKETS``: 256 tokens to ``max_tokens``, steps of at most 1.5x) that
  holds it. Its hidden states are copied into the layer's static input and the rest of the bucket zeroed; the
  padding is one more document in the static ``cu_seqlens`` (zero-length documents fill the rest), so attention never
  mixes it with real tokens, and the gradient reaching it is zero, so it adds exactly nothing to the LoRA gradients.
  Only the GEMMs' shapes change: results agree with the eager layer to rounding.
- Static metadata. The varlen kernels read ``cu_seqlens`` from one static buffer per bucket (copied once per forward)
  with the bucket's length as the bound; cos/sin and position ids likewise. Nothing is read on the host.
- Capture, per bucket at its first call, through ``nbkit.ops.layer_graphs`` (the engine and its contract): every
  eligible layer's forward graph in layer order, then every backward graph in reverse, before any replay has written
  the static inputs that autograd saved. That is the order they replay in, which is what lets the graphs of one
  capture share one memory pool. A layer that becomes eligible later (the one whose call decided
  ``selective_checkpointing``) is captured at its next call, in a pool of its own. Each layer's graph gets its own
  ``PackedRun`` over the bucket's static buffers, made inside its capture, so a mask an attention kernel builds on
  first use is built by that graph at every replay.

Eager instead, per call and said once per reason: not training, no grad, the layer checkpointed (its recompute
is not graphed), more tokens than ``max_tokens``, more documents than a bucket holds, an argument the graph cannot
take (a padding mask, a KV cache, an unknown tensor), no varlen kernel (``cached_packing`` with the ``varlen`` or
``flash_attn`` kernel), hooks on a module inside the layer (a graph would run them once, at capture), not enough
free memory for another layer's graphs (what is left of the process's limit, as ``selective_checkpointing`` reads it,
must stay above ``RESERVE`` of that limit and above the step's peak so far less what it holds now), a trainable
parameter the graph does not reach (held by reference outside its module). Not attached:
not CUDA, a MoE model (the experts' shapes depend on the routing), dropout in a decoder layer (random numbers would
repeat).

Modes: "auto" graphs a bucket only while a layer's parameters x the bucket's tokens stay below ``AUTO_MAX_WORK``:
larger layers keep the GPU busy on their own, and then the padding and the static copies cost more than the
launches saved (where the crossing was measured: BENCHMARKS.md section 13). True graphs every bucket up to
``max_tokens``.

Contract: the same losses and gradients as the eager layers up to rounding; a layer's forward must be followed by its
backward before it runs forward again in the same bucket (``RuntimeError`` otherwise, as in a custom loop that runs
two forwards before their backwards); ``detach()`` puts every ``forward`` back and drops the graphs.
``backend=TapeBackend()`` (CPU tests) runs the same code with tapes of ATen ops in place of CUDA graphs: Python is
frozen at capture as on a GPU, so a stale input or an unreached parameter shows on a CPU too.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Literal, Optional, Union

import torch

from ..ops.layer_graphs import CudaGraphBackend, GraphedLayer, UnreachedParameters, replay
from ..ops.varlen_attention import KERNEL_FNS, PackedRun
from ..settings import check_value
from .ledger import PatchLedger, unwrap_model
from .selective_checkpointing import memory_readings

logger = logging.getLogger(__name__)

Mode = Union[bool, Literal["auto"]]
BUCKETS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
MAX_TOKENS = 8192  # beyond this a layer's kernels are long enough to hide their launches: eager
AUTO_MAX_WORK = 6e11  # 'auto': a layer's parameters x a bucket's tokens, at most (BENCHMARKS.md section 13)
MIN_DOCS, MAX_DOCS = 16, 256  # documents a bucket holds: tokens / 8 within these (its padding document on top)
MAX_CAPTURES = 2 * len(BUCKETS)  # capture calls (buckets, argument states, layers un-checkpointed late)
RESERVE = 0.10  # of the memory this process may use, left free at least when capturing another layer's graphs
_FUSED_KERNELS = (KERNEL_FNS["varlen"], KERNEL_FNS["flash_attn"])
TOKENWISE_KWARGS = ("position_ids", "cache_position", "seq_idx")  # one value per token: copied into static twins
_NONE_KWARGS = ("attention_mask", "past_key_values", "past_key_value", "cache")
_DROPPED_KWARGS = ("nbkit_cu_seqlens_host", "num_items_in_batch")  # read by no kernel in a decoder layer
_MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def layer_parameters(layer: torch.nn.Module) -> int:
    """A layer's parameter count, 4-bit weights counted by their unpacked shape."""
    total = 0
    for p in layer.parameters():
        state = getattr(p, "quant_state", None)
        total += int(torch.Size(state.shape).numel()) if state is not None and getattr(state, "shape", None) else p.numel()
    return total


def bucket_for(tokens: int, max_tokens: int = MAX_TOKENS) -> Optional[int]:
    """The smallest bucket holding ``tokens`` (None above ``max_tokens``)."""
    for size in BUCKETS:
        if size > max_tokens:
            return None
        if tokens <= size:
            return size
    return None


def doc_capacity(bucket: int) -> int:
    """Real documents a bucket's static ``cu_seqlens`` holds (its padding document comes on top)."""
    return min(MAX_DOCS, max(MIN_DOCS, bucket // 8))


class _Shared:
    """One bucket's static metadata, shared by its layers and refreshed once per forward."""

    def __init__(self, bucket: int, kernel: Callable, device: torch.device) -> None:
        self.bucket = bucket
        # (cos, sin) per layer type (``rope_key``): gemma3's sliding and full layers are handed other ones
        self.rope: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_given: dict[Any, torch.Tensor] = {}  # this forward's cos per layer type, by identity
        self.tokenwise: dict[str, torch.Tensor] = {}  # position_ids, cache_position, seq_idx: made at first sight
        slots = doc_capacity(bucket) + 2  # 0, the real documents' ends, the padding's end
        self.cu_q = torch.full((slots,), bucket, dtype=torch.int32, device=device)
        self.cu_k = torch.full((slots,), bucket, dtype=torch.int32, device=device)
        self.kernel = kernel
        self.grad_out: Optional[torch.Tensor] = None  # (1, bucket, hidden), made with the first layer's graphs
        self._source: Any = None

    def load(self, tokens: int, kwargs: dict, key: Any) -> bool:
        """Copy this forward's metadata in: the rows' once per forward, the position embeddings once per layer type.
        False when a layer of an already loaded type is handed other (cos, sin): its call must run eagerly."""
        run: PackedRun = kwargs["nbkit_run"]
        if self._source is not run:
            self._load_rows(tokens, kwargs, run)
            self._rope_given = {}
        cos, sin = kwargs["position_embeddings"]
        if key in self._rope_given:
            return self._rope_given[key] is cos
        static = self.rope_slot(key, (cos, sin))
        if static[0].shape[-1] != cos.shape[-1] or static[1].shape[-1] != sin.shape[-1]:
            return False
        static[0][:, :tokens].copy_(cos)
        static[1][:, :tokens].copy_(sin)
        self._rope_given[key] = cos
        return True

    def rope_slot(self, key: Any, like: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The static (cos, sin) of one layer type (made on first sight, shaped as ``like``)."""
        if key not in self.rope:
            self.rope[key] = tuple(t.new_zeros((1, self.bucket, t.shape[-1])) for t in like)
        return self.rope[key]

    def _load_rows(self, tokens: int, kwargs: dict, run: PackedRun) -> None:
        for key in TOKENWISE_KWARGS:
            if kwargs.get(key) is not None:
                self._static(key, kwargs[key])[..., :tokens].copy_(kwargs[key])
        for static, cu in ((self.cu_q, run.cu_q), (self.cu_k, run.cu_k)):
            n = cu.numel()
            static[:n].copy_(cu)
            static[n:].fill_(self.bucket)  # the padding's end, then zero-length documents
        self._source = run  # held: a later forward's run cannot reuse its id

    def _static(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The bucket-long static twin of a per-token tensor (tokens on its last dimension; the padding reads 0)."""
        if key not in self.tokenwise:
            self.tokenwise[key] = like.new_zeros((*like.shape[:-1], self.bucket))
        return self.tokenwise[key]

    def static_kwargs(self, given: dict, key: Any) -> Callable[[], dict]:
        """The layer's keyword arguments for a capture: the given ones with the static tensors in their place (the
        position embeddings of its layer type) and a new ``PackedRun`` over the static buffers at each call (its
        caches are filled inside the capture)."""
        out = {k: v for k, v in given.items() if k not in _DROPPED_KWARGS}
        out["position_embeddings"] = self.rope_slot(key, given["position_embeddings"])
        for key in TOKENWISE_KWARGS:
            if given.get(key) is not None:
                out[key] = self._static(key, given[key])
        out.update(cu_seq_lens_q=self.cu_q, cu_seq_lens_k=self.cu_k, max_length_q=self.bucket,
                   max_length_k=self.bucket)

        def make() -> dict:
            run = PackedRun(kernel=self.kernel, cu_q=self.cu_q, cu_k=self.cu_k, max_q=self.bucket, max_k=self.bucket,
                            host_offsets=None, training=True, tokens=self.bucket)
            return {**out, "nbkit_run": run}

        return make


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hooked(layer: torch.nn.Module) -> bool:
    """Whether a module inside ``layer`` (not the layer itself: its hooks run around the replay), or every module,
    has hooks: they run in Python, so a graph would run them once, at its capture."""
    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, f"_global{name}", None) for name in _HOOKS):
        return True
    return any(getattr(m, name, None) for m in layer.modules() if m is not layer for name in _HOOKS)


# reasons a layer's call runs eagerly that the code acts on (the others are only counted and said)
CHECKPOINTED = "checkpointed layer"  # its recompute is not graphed; captured at its next call once un-checkpointed
HOOKED = "hooks inside the layer"
UNREACHED = "trainable parameters the graph does not reach (held by reference outside their module)"
CAPTURE_FAILED = "capture failed"


def rope_key(layer: torch.nn.Module) -> Any:
    """Which (cos, sin) a decoder layer is handed: one per attention type where the model has several (gemma3's
    sliding layers take the local rope, its full ones the global), the same for all otherwise. A guess checked at
    every call (``_Shared.load``): a layer handed other ones than its type's runs eagerly."""
    types, index = getattr(getattr(layer, "config", None), "layer_types", None), getattr(layer, "layer_idx", None)
    if types and isinstance(index, int) and 0 <= index < len(types):
        return types[index]
    return getattr(layer, "attention_type", None)


def _layer_reason(layer: torch.nn.Module) -> Optional[str]:
    """Why this layer's call runs eagerly whatever the forward (None: it may run on graphs)."""
    if not layer.training or not torch.is_grad_enabled():
        return "not training"
    if getattr(layer, "gradient_checkpointing", False):
        return CHECKPOINTED
    return None


def _why_not_model(base: torch.nn.Module, layers: list[torch.nn.Module]) -> Optional[str]:
    config = getattr(base, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if any(getattr(text, key, None) for key in _MOE_CONFIG_KEYS):
        return "a MoE model (its experts' shapes depend on the routing)"
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        return "attention dropout > 0 (a graph would repeat its random numbers)"
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, torch.nn.Dropout) and m.p > 0:
                return "dropout > 0 in a decoder layer (a graph would repeat its random numbers)"
    return None


class CudaGraphs:
    """Replay un-checkpointed decoder layers as CUDA graphs, one set per token bucket (see module docstring).

    Since the last attach (kept after detach): ``captured`` counts the (layer, bucket) pairs captured, ``replays``
    the graphed layer calls, and ``eager`` the calls that ran eagerly, by reason.
    """

    name = "cuda_graphs"

    def __init__(self, mode: Mode = "auto", max_tokens: int = MAX_TOKENS, backend: Any = None) -> None:
        """``backend``: how graphs are made (default ``CudaGraphBackend``; tests pass ``layer_graphs.TapeBackend``)."""
        check_value("cuda_graphs", mode)
        self.mode = mode
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.max_tokens = self._given_max = max_tokens
        self._ledger = PatchLedger(self.name)
        self._said: set[str] = set()
        self._reset()
        self._count()

    def _count(self) -> None:
        self.captured = 0
        self.replays = 0
        self.eager: dict[str, int] = {}

    def _reset(self) -> None:
        self._layers: list[torch.nn.Module] = []
        self._originals: list[Callable] = []
        self._graphs: dict[tuple, Union[GraphedLayer, str]] = {}  # (layer, variant): its graphs, or why it has none
        self._shared: dict[int, _Shared] = {}
        self._captures = 0
        self._plan_run: Optional[PackedRun] = None
        self._plan_of_run: Union[str, tuple] = ""
        self._layer_bytes: Optional[int] = None

    @property
    def engaged(self) -> bool:
        """Whether any layer call has run as a graph replay."""
        return self.replays > 0

    # ------------------------------------------------------------------------------------------------ attach/detach
    def attach(self, model: torch.nn.Module) -> bool:
        self.detach()
        self._count()
        if self.mode is False:
            return False
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer
        except ImportError:
            self._say("old", "this transformers has no decoder layer class to find; stays off")
            return False
        base = unwrap_model(model)
        layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
        if not layers:
            self._say("nolayers", f"no decoder layers found in {type(base).__name__}; stays off")
            return False
        param = next(base.parameters(), None)
        wanted = self.backend.device_type
        if wanted is not None and (param is None or param.device.type != wanted):
            self._say("cpu", "off (the model is not on a CUDA GPU)", logging.WARNING if self.mode is True else logging.INFO)
            return False
        why = _why_not_model(base, layers)
        if why:
            self._say("model", f"off: {why}")
            return False
        kind = type(layers[0])
        self._layers = [m for m in layers if type(m) is kind]
        self.max_tokens = self._given_max
        if self.mode == "auto":  # large layers keep the GPU busy on their own: their launches hide behind them
            per_layer = layer_parameters(self._layers[0])
            self.max_tokens = min(self._given_max, int(AUTO_MAX_WORK // max(per_layer, 1)))
            if bucket_for(1, self.max_tokens) is None:
                self._say("large", f"off: a decoder layer of {per_layer / 1e6:.0f}M parameters keeps the GPU busy "
                          "without graphs ('auto'; cuda_graphs=True forces them)", logging.INFO)
                self._layers = []
                return False
        for i, layer in enumerate(self._layers):
            self._originals.append(layer.forward)
            self._ledger.set(layer, "forward", self._wrapper(i, layer))
        return True

    def detach(self) -> None:
        self._ledger.undo()
        self._reset()

    # ------------------------------------------------------------------------------------------------------- calls
    def _wrapper(self, index: int, layer: torch.nn.Module) -> Callable:
        original = self._originals[index]

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            why = _layer_reason(layer)
            if why is None:
                plan = self._plan(hidden_states, args, kwargs)
                graphs = plan if isinstance(plan, str) else self._graphs_for(index, plan, hidden_states, kwargs)
                if isinstance(graphs, GraphedLayer) and graphs.x.requires_grad == hidden_states.requires_grad:
                    if self._shared[plan[0]].load(hidden_states.shape[1], kwargs, rope_key(layer)):
                        self.replays += 1
                        return replay(graphs, hidden_states)
                    why = "position embeddings differ between layers of one type"
                else:
                    why = graphs if isinstance(graphs, str) else "the input's requires_grad differs from the capture's"
            if why not in self.eager:
                self._say(f"eager:{why}", f"a layer call ran eagerly: {why}", logging.INFO)
            self.eager[why] = self.eager.get(why, 0) + 1
            return original(hidden_states, *args, **kwargs)

        return forward

    def _plan(self, x: Any, args: tuple, kwargs: dict) -> Union[str, tuple]:
        """This forward's graph variant (bucket, autocast state, constant arguments, per-token arguments), or why
        its layer calls cannot run on graphs. The same for every layer of one forward: decided at its first call."""
        run = kwargs.get("nbkit_run")
        if run is None or run is not self._plan_run:
            plan = self._plan_for(x, args, kwargs)
            if isinstance(run, PackedRun):
                self._plan_run, self._plan_of_run = run, plan  # the run held: a later one cannot reuse its id
            return plan
        return self._plan_of_run

    def _plan_for(self, x: Any, args: tuple, kwargs: dict) -> Union[str, tuple]:
        if args or not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != 1:
            return "not one padding-free row"
        run = kwargs.get("nbkit_run")
        if not isinstance(run, PackedRun):
            return "no packed metadata (cached_packing off)"
        if self.backend.device_type == "cuda" and run.kernel not in _FUSED_KERNELS:
            return "attention kernel without static shapes (not varlen / flash_attn)"
        if any(kwargs.get(k) is not None for k in _NONE_KWARGS) or kwargs.get("use_cache"):
            return "a mask or KV cache argument"
        pe = kwargs.get("position_embeddings")
        if not (isinstance(pe, tuple) and len(pe) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 3
                                                               and t.shape[1] == x.shape[1] for t in pe)):
            return "no (cos, sin) position embeddings of the row's length"
        for key, value in kwargs.items():
            if not isinstance(value, torch.Tensor) or key in ("cu_seq_lens_q", "cu_seq_lens_k", *_DROPPED_KWARGS):
                continue
            if key not in TOKENWISE_KWARGS or value.shape[-1] != x.shape[1]:
                return f"a tensor argument the graph cannot take ({key})"
        bucket = bucket_for(x.shape[1], self.max_tokens)
        if bucket is None:
            return f"more than {self.max_tokens} tokens"
        if run.cu_q.numel() - 1 > doc_capacity(bucket):
            return "more documents than the bucket holds"
        constants = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))
                                 and k not in ("max_length_q", "max_length_k")))
        autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        tokenwise = tuple(k for k in TOKENWISE_KWARGS if kwargs.get(k) is not None)
        return (bucket, autocast, constants, tokenwise)

    def _graphs_for(self, index: int, variant: tuple, x: torch.Tensor, kwargs: dict) -> Any:
        """This layer's graphs for the forward's variant (captured now, from this layer on, if new); a reason string
        when it has none."""
        entry = self._graphs.get((index, variant))
        if entry is None or entry == CHECKPOINTED:  # new, or un-checkpointed since its bucket's capture
            if self._captures >= MAX_CAPTURES:
                return "too many captures"
            self._capture(index, variant, x, kwargs)
            entry = self._graphs[(index, variant)]
        return entry

    def _capture(self, first: int, variant: tuple, x: torch.Tensor, kwargs: dict) -> None:
        """Capture one variant's graphs for every eligible layer from ``first`` on that has none yet: all forwards
        in layer order, then all backwards in reverse, the order they replay in, so the captures of one call share
        one memory pool (each call its own: a layer captured later replays between the others), and each backward
        before any replay has written the static inputs autograd saved."""
        self._captures += 1
        pool = self.backend.pool()
        bucket = variant[0]
        shared = self._shared.get(bucket)
        if shared is None:
            shared = self._shared[bucket] = _Shared(bucket, kwargs["nbkit_run"].kernel, x.device)
        shared.load(x.shape[1], kwargs, rope_key(self._layers[first]))
        captured: list[GraphedLayer] = []
        attempted: list[int] = []
        x_grad = x.requires_grad
        try:
            for i in range(first, len(self._layers)):
                layer, entry = self._layers[i], self._graphs.get((i, variant))
                if entry is not None and entry != CHECKPOINTED:  # captured, or a lasting reason
                    x_grad = True
                    continue
                memory = None
                if getattr(layer, "gradient_checkpointing", False):
                    why = CHECKPOINTED
                elif _hooked(layer):
                    why = HOOKED
                    self._say(f"hooks{i}", f"layer {i} runs eagerly: a module inside it has hooks (they would run "
                              "at the capture only)")
                else:
                    why = memory = self._memory_problem(x.device)
                if why:
                    self._graphs[(i, variant)] = why
                    if memory:
                        self._say(f"mem{bucket}", f"layer {i} and later run eagerly at {bucket} tokens: {memory}")
                    x_grad = True  # an eager layer's output: it needs grad when anything before it trains
                    continue
                attempted.append(i)
                if shared.grad_out is None:
                    shared.grad_out = x.new_zeros((1, bucket, x.shape[-1]))
                graphs = GraphedLayer(layer, self._originals[i], shared.grad_out, x_grad,
                                      shared.static_kwargs(kwargs, rope_key(layer)), shared.grad_out, self.backend,
                                      pool, label=f"decoder layer {i}")
                before = torch.cuda.memory_allocated(x.device) if x.is_cuda else 0
                graphs.capture_forward()
                if x.is_cuda:  # what the forward's graph keeps, twice: the backward's graph comes on top
                    self._layer_bytes = max(self._layer_bytes or 0, 2 * (torch.cuda.memory_allocated(x.device) - before))
                captured.append(graphs)
                x_grad = x_grad or bool(graphs.trainable)
            for graphs in reversed(captured):
                graphs.capture_backward()
        except Exception as err:  # noqa: BLE001 - an op that cannot be captured: the bucket stays eager
            why = UNREACHED if isinstance(err, UnreachedParameters) else CAPTURE_FAILED
            for i in attempted:
                self._graphs[(i, variant)] = why
            self._say(f"fail{bucket}", f"layers run eagerly at {bucket} tokens: their capture failed "
                      f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
            return
        for i, graphs in zip(attempted, captured):
            self._graphs[(i, variant)] = graphs
        self.captured += len(captured)
        if captured:
            self._say("on", f"decoder layers replay as CUDA graphs (buckets of up to {self.max_tokens} tokens)",
                      logging.INFO)

    def _memory_problem(self, device: torch.device) -> Optional[str]:
        readings = memory_readings(device) if self._layer_bytes is not None else None
        if readings is None:  # off CUDA, or the first layer: nothing to size by yet
            return None
        limit, peak, allocated = readings
        # what the step may still need beyond what it holds now: the peak so far above the present, at least RESERVE
        headroom = max(RESERVE * limit, peak - allocated)
        if limit - allocated - self._layer_bytes < headroom:
            return (f"no memory for more graphs ({(limit - allocated) / 2**30:.1f} GiB left, a layer's graphs take "
                    f"~{self._layer_bytes / 2**30:.2f} GiB and {headroom / 2**30:.1f} GiB stay free for the step)")
        return None

    def _say(self, key: str, msg: str, level: int = logging.WARNING) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.log(level, "nbkit cuda_graphs: %s", msg)
