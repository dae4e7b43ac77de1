"""CUDA graphs for the decoder layers the layer plan graphs: a kept layer's forward and backward are one replay
each; a checkpointed layer's forward, recompute and backward too.

Why: on short rows a QLoRA step is bound by the host. Every decoder layer's forward and backward launch a few hundred
kernels from Python (PEFT's and nbkit's LoRA functions, bitsandbytes' dequantization, Liger's kernels, autograd's
engine), and the GPU finishes each before the next is launched. A captured graph launches them all from one call.
Under a small card's memory most layers are checkpointed: their recompute is a third pass of launches.

Where it runs: an engine of the layer runner (``layer_runner``), which owns every decoder layer's ``forward``. The
runner calls ``call`` for a training call (the layer in training mode, grad enabled) of a kept layer whose plan says
``graphed`` (``runner.plans[i].graphed``), and ``call_checkpointed`` for a checkpointed one (its graphs keep only
the layer's input: ``ops.recompute_graphs``; None hands the call back to the runner's checkpointing); every other
call runs the layer's own forward (eval and no-grad calls) or the runner's checkpointing (offloaded layers, layers
with the MLP recomputed, step 1). ``prepare`` says whether the model can be graphed at all.

How:

- Buckets and static metadata (``graph_buckets``): a micro-batch of ``T`` tokens runs on the graphs of the smallest
  bucket that holds it (up to ``max_tokens``). Its hidden states are copied into the layer's static input and the
  rest of the bucket zeroed; the padding is one more document in the bucket's static ``cu_seqlens``, so attention
  never mixes it with real tokens, and the gradient reaching it is zero, so it adds exactly nothing to the LoRA
  gradients. Only the GEMMs' shapes change: results agree with the eager layer to rounding. A set of graphs is keyed
  by a ``Variant`` (bucket, autocast state, constant and per-token arguments), decided at a forward's first layer.
- Capture, per bucket at its first call, through ``nbkit.ops.layer_graphs`` (the engine and its contract): every
  graphed layer's forward graph in layer order, then every backward graph in reverse, before any replay has written
  the static inputs that autograd saved. That is the order they replay in, which is what lets the graphs of one
  capture share one memory pool. Every bucket's first capture goes into the run's one kept pool: between a forward
  and its backward a bucket's graphs keep their activations there, and in training no other bucket's replay comes
  between them, so a later bucket's capture takes the memory an earlier one's activations use only between replays,
  and the pool holds about one bucket's activations, not each bucket's (``layer_graphs.Turns``: while a bucket's
  forward awaits its backward, a forward of another bucket, as in a loop that sums two losses, runs eagerly). A
  bucket larger than any the pool held is sized whole: its tensors do not fit the smaller freed blocks. So the run's
  first capture is of the largest bucket its micro-batches reach (the plan's ``max_tokens``, which it sized the kept
  activations by), its forward replayed padded: the pool is sized once, and each smaller bucket, captured at its own
  first call, fits in the blocks the largest one's activations free between replays. Outside the pools a kept
  layer keeps one static input, sized by that largest bucket (every bucket's graphs read a view of it: one forward
  of a layer awaits its backward at a time), and each bucket one output and one input-gradient buffer that all its
  kept layers' graphs copy into (each replay's cloned out before the next): the pool keeps no layer's output for
  good, so a smaller bucket costs the pool next to nothing. A layer the plan graphs later (kept by the plan's first
  or second look, after step 1 ran it checkpointed) is captured at its next call, in a pool of its own: it replays
  between its bucket's other layers. Each layer's graph gets its own
  ``PackedRun`` over the bucket's static buffers, made inside its capture, so a mask an attention kernel builds on
  first use is built by that graph at every replay. One layer of each shape is warmed up per capture call (an
  eager step of it, so kernels and workspaces exist); the others capture on what it made, once they have run
  eagerly before (step 1's measurement, or a warm-up of an earlier capture). ``capture_s`` counts the seconds
  spent capturing.

Eager instead, per call the runner hands it, said once per reason and counted in ``eager`` (each reason a
``graph_eligibility.Eager``: its text, and whether it holds for this call, until the plan graphs the layer, or for
the variant): more tokens than ``max_tokens``, more documents than a bucket holds, an argument the graph cannot take
(a padding mask, a KV cache, an unknown tensor), no varlen kernel (``cached_packing`` with the ``varlen`` or
``flash_attn`` kernel), hooks on a module inside the layer (a graph would run them once, at capture), not enough
free memory for another layer's graphs (the run's budget decides, ``layer_budget.Budget.graphs_room``: what the
allocator has not reserved of the process's limit, less the graphs asked for, must stay above the budget's margin of
that limit and above the step's own peak so far less what it holds now; reserved, because the pools keep their
memory between replays; its own, because a peak a capture set is that pool's, reserved already:
``Budget.capturing``), a trainable parameter the graph does not reach (held by reference outside its module).

Near the memory limit: a pool keeps its memory for good, so a second copy of the activations it holds is what would
run the GPU out of memory. A row whose bucket has no graphs yet, when that bucket's capture does not fit, replays the
smallest captured bucket that holds it (padded, as every shorter row is; ``reused`` counts those forwards). An eager
call of a layer that has graphs keeps its activations when they fit beside the pools (the same test as a capture's,
for every graphed layer at the call's tokens, decided once per forward); else it is checkpointed (its input kept,
its forward recomputed in backward; ``recomputed`` counts them). Not taking part: not CUDA, a MoE model (the
experts' shapes depend on the routing), dropout in a decoder layer (random numbers would repeat).

Modes: "auto" graphs a bucket only while a layer's parameters x the bucket's tokens stay below ``AUTO_MAX_WORK``:
larger layers keep the GPU busy on their own, and then the padding and the static copies cost more than the
launches saved (where the crossing was measured: BENCHMARKS.md, cuda_graphs). True graphs every bucket up to
``max_tokens``.

Contract: the same losses and gradients as the eager layers up to rounding; a layer's forward must be followed by its
backward before it runs forward again in the same bucket (``RuntimeError`` otherwise, as in a custom loop that runs
two forwards before their backwards), and a second backward of a forward (``retain_graph``) after another bucket's
forward raises too; the runner's ``detach()`` drops the graphs (``CudaGraphs.attach`` /
``detach`` run it in a runner of its own). ``backend=TapeBackend()`` (CPU tests) runs the same code with tapes of
ATen ops in place of CUDA graphs: Python is frozen at capture as on a GPU, so a stale input or an unreached parameter
shows on a CPU too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from torch.utils.checkpoint import checkpoint

from ..memory import fmt_bytes, gpu_in_use, gpu_reserved, pool_reserved
from ..ops.layer_graphs import (
    CudaGraphBackend,
    GraphedLayer,
    LayerGrads,
    Turn,
    Turns,
    UnreachedParameters,
    replay,
    trainable_parameters,
)
from ..ops.recompute_graphs import RecomputedLayer, Shared, replay_checkpointed
from ..ops.varlen_attention import KERNEL_FNS, PackedRun
from ..say_once import SayOnce
from ..settings import check_value
from .graph_buckets import BUCKETS, DROPPED_KWARGS, TOKENWISE_KWARGS, BucketMetadata, bucket_for, doc_capacity, rope_key
from .graph_eligibility import (
    CAPTURE_FAILED,
    CHECKPOINTED,
    HOOKED,
    OTHER_GRAD,
    OTHER_ROPE,
    OTHER_TURN,
    TOO_MANY_CAPTURES,
    UNREACHED,
    Eager,
    Entry,
    Kind,
    Variant,
    hooked,
    layer_parameters,
    layer_reason,
    layer_shape,
    stale,
    why_not_model,
)
from .graph_memory import GraphMemory
from .layer_plan import KEPT, UNSIZED

if TYPE_CHECKING:
    from .packed_attention import PackedAttention

logger = logging.getLogger(__name__)

Mode = Union[bool, Literal["auto"]]
MAX_TOKENS = 8192  # beyond this a layer's kernels are long enough to hide their launches: eager
AUTO_MAX_WORK = 6e11  # 'auto': a layer's parameters x a bucket's tokens, at most (BENCHMARKS.md, cuda_graphs)
MAX_CAPTURES = 2 * len(BUCKETS)  # capture calls (buckets, argument states, layers un-checkpointed late)
_FUSED_KERNELS = (KERNEL_FNS["varlen"], KERNEL_FNS["flash_attn"])
_NONE_KWARGS = ("attention_mask", "past_key_values", "past_key_value", "cache")


class CudaGraphs:
    """Replay kept decoder layers as CUDA graphs, one set per token bucket (see module docstring).

    An engine of the layer runner (``layer_runner``): ``prepare`` says whether the model can be graphed at all, and
    the runner calls ``call`` for each layer its plan graphs. Since the last attach (kept after detach): ``captured``
    counts the (layer, bucket) pairs captured, ``capture_s`` the seconds spent capturing, ``replays`` the graphed
    layer calls, ``eager`` the calls that ran eagerly, by reason, ``recomputed`` those of them that were
    checkpointed, and ``reused`` the forwards that replayed a larger bucket for want of memory for their own.
    """

    name = "cuda_graphs"

    def __init__(self, mode: Mode = "auto", max_tokens: int = MAX_TOKENS, backend: Any = None,
                 packed: Optional[PackedAttention] = None, checkpointed: bool = False) -> None:
        """``backend``: how graphs are made (default ``CudaGraphBackend``; tests pass ``layer_graphs.TapeBackend``).
        ``packed``: the attached ``PackedAttention`` whose per-forward runs the graphs read (None: no packed metadata,
        every call eager). ``checkpointed``: checkpointed layers are graphed too (``cuda_graphs_checkpointed``)."""
        check_value("cuda_graphs", mode)
        self.mode = mode
        self.checkpointed = checkpointed
        self.packed = packed
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.max_tokens = self._given_max = max_tokens
        self._say = SayOnce(logger, "nbkit cuda_graphs")
        self._runner: Any = None
        self._reset()
        self._count()

    def _count(self) -> None:
        self.captured = 0
        self._captures = 0  # capture calls (bounded by MAX_CAPTURES)
        self.capture_s = 0.0
        self.replays = 0
        self.recomputed = 0
        self.reused = 0
        self.checkpointed_replays = 0
        self.eager: dict[str, int] = {}

    def _reset(self) -> None:
        self.memory = GraphMemory(self._runner)  # what the graphs hold, and whether more fit
        self._layers: list[Any] = []  # the runner's Layer records
        self._graphs: dict[tuple[int, Variant], Entry] = {}  # its graphs, or why it has none
        self._buffers: dict[tuple, Shared] = {}  # a bucket's static buffers, by bucket, dtype, x's grad (_shared_buffers)
        self._recompute_pool: Any = None  # every recomputed layer's graphs, whatever the bucket (recompute_graphs)
        self._kept_pool: Any = None  # kept layers' graphs, each variant's first capture (see _capture_from)
        self._own_pools: list = []  # kept layers' graphs captured late, a pool a capture call
        self._pooled: set[Variant] = set()  # the variants captured into it
        self._turns = Turns()  # whose forward may replay in it (layer_graphs.Turns)
        self._inputs: dict[tuple, torch.Tensor] = {}  # a kept layer's static input, every bucket's a view of it
        self._grads: dict[int, LayerGrads] = {}  # a graphed layer's parameter gradients, every bucket's and plan's
        self._shared: dict[int, BucketMetadata] = {}  # by bucket
        self._plan_run: Optional[PackedRun] = None
        self._plan_of_run: Union[Eager, Variant, None] = None
        self._eager_run: Optional[PackedRun] = None  # the forward whose eager graphed calls were decided
        self._eager_keeps = True  # whether they keep their activations (else recompute)
        self._graphed: set[int] = set()  # layers with graphs in some variant: their pools hold their activations
        self._warmed_layers: set[int] = set()  # layers a capture warmed up (run eagerly) at least once

    @property
    def engaged(self) -> bool:
        """Whether any layer call has run as a graph replay."""
        return self.replays > 0

    def counters(self) -> dict:
        """The counters, for benchmarks; with graphs on a GPU, ``pools_mib``: what their pools hold, by kind."""
        counters = {"captured": self.captured, "captures": self._captures, "capture_s": round(self.capture_s, 3),
                    "replays": self.replays, "checkpointed_replays": self.checkpointed_replays,
                    "eager": dict(self.eager), "recomputed": self.recomputed, "reused": self.reused}
        pools = self.pool_bytes()
        if pools:
            counters["pools_mib"] = {kind: round(held / 2**20, 1) for kind, held in pools.items()}
        return counters

    def pool_bytes(self, segments: Optional[list] = None) -> dict[str, int]:
        """What the graphs' pools hold (reserved), by kind: ``kept`` (the run's kept pool), ``kept_late`` (the late
        captures' own pools), ``recompute`` (the checkpointed layers'); {} with no pools or off CUDA. ``segments``:
        the allocator's snapshot (default: read now; ``memory.pool_reserved``)."""
        kinds = {"kept": [self._kept_pool], "kept_late": self._own_pools, "recompute": [self._recompute_pool]}
        wanted = {pool: kind for kind, pools in kinds.items() for pool in pools if isinstance(pool, tuple)}
        if not wanted:
            return {}
        held = pool_reserved(segments)
        out: dict[str, int] = {}
        for pool, kind in wanted.items():
            out[kind] = out.get(kind, 0) + held.get(pool, 0)
        return out

    # ---------------------------------------------------------------------------------------------- the runner's
    def prepare(self, runner: Any, base: torch.nn.Module) -> bool:
        """Whether ``runner``'s layers can be graphed at all (a CUDA model without MoE or dropout; for 'auto', a
        layer small enough for its launches to matter)."""
        self._runner = runner
        self._reset()
        self._count()
        if self.mode is False:
            return False
        layers = [layer.module for layer in runner.layers]
        param = next(base.parameters(), None)
        wanted = self.backend.device_type
        if wanted is not None and (param is None or param.device.type != wanted):
            self._say("cpu", "off (the model is not on a CUDA GPU)", logging.WARNING if self.mode is True else logging.INFO)
            return False
        why = why_not_model(base, layers)
        if why:
            self._say("model", f"off: {why}")
            return False
        self.max_tokens = self._given_max
        if self.mode == "auto":  # large layers keep the GPU busy on their own: their launches hide behind them
            per_layer = layer_parameters(layers[0])
            self.max_tokens = min(self._given_max, int(AUTO_MAX_WORK // max(per_layer, 1)))
            if bucket_for(1, self.max_tokens) is None:
                self._say("large", f"off: a decoder layer of {per_layer / 1e6:.0f}M parameters keeps the GPU busy "
                          "without graphs ('auto'; cuda_graphs=True forces them)", logging.INFO)
                return False
        self._layers = list(runner.layers)
        return True

    def release(self) -> None:
        """The runner detaches: drop the graphs (the counters stay)."""
        self._reset()

    # ----------------------------------------------------------------------------------------------- on its own
    def attach(self, model: torch.nn.Module) -> bool:
        """Outside FastSFT: a layer runner with this engine alone (every layer kept: the un-checkpointed ones graph;
        checkpointed layers stay checkpointed)."""
        from .layer_runner import standalone

        self.detach()
        self._count()
        runner = standalone(self, "graphs", model)
        self._runner = runner
        return runner.graphs is self

    def detach(self) -> None:
        runner = self._runner
        if runner is not None and runner.graphs is self:
            runner.detach()
        self._runner = None
        self._reset()

    # ------------------------------------------------------------------------------------------------------- calls
    def _replayable(self, runner: Any, layer: Any, hidden_states: torch.Tensor, args: tuple, kwargs: dict
                    ) -> tuple[Union[GraphedLayer, RecomputedLayer, Eager], Optional[Turn], Optional[Callable[[], None]]]:
        """The graphs this call replays, its bucket's metadata loaded, the turn its replay counts on (kept layers'
        graphs in the shared pool) and what loads that metadata again before its backward; or why it runs eagerly
        (said once per reason, counted)."""
        why, turn = layer_reason(runner, layer), None
        if why is None:
            plan = self._plan(hidden_states, args, kwargs)
            if isinstance(plan, Variant) and (open_turn := self._turns.open()) is not None and open_turn.key != plan:
                plan = OTHER_TURN  # nothing of this variant is captured or loaded before that backward
            graphs = plan if isinstance(plan, Eager) else self._graphs_for(layer.index, plan, hidden_states, kwargs)
            if isinstance(graphs, Eager):
                why = graphs
            elif graphs.x.requires_grad != hidden_states.requires_grad:
                why = OTHER_GRAD
            elif not (metadata := self._shared[plan.bucket]).load(
                    tokens := hidden_states.shape[1], kwargs, key := rope_key(layer.module), run := self._run(kwargs)):
                why = OTHER_ROPE
            else:
                self.replays += 1
                if isinstance(graphs, GraphedLayer) and plan in self._pooled:
                    turn = self._turns.take(plan)  # no other variant's is open: checked above
                # this forward's metadata, loaded again before its backward (another forward may have loaded its own)
                return graphs, turn, functools.partial(metadata.load, tokens, kwargs, key, run)
        self._say(f"eager:{why.text}", f"a layer call ran eagerly: {why.text}", logging.INFO)
        self.eager[why.text] = self.eager.get(why.text, 0) + 1
        return why, None, None

    def call_checkpointed(self, runner: Any, layer: Any, hidden_states: torch.Tensor, args: tuple,
                          kwargs: dict) -> Optional[torch.Tensor]:
        """One call of a checkpointed layer the plan graphs: a replay that keeps only the layer's input, or None
        (the runner then checkpoints the layer eagerly)."""
        graphs, _, restore = self._replayable(runner, layer, hidden_states, args, kwargs)
        if not isinstance(graphs, RecomputedLayer):
            return None
        self.checkpointed_replays += 1
        return replay_checkpointed(graphs, hidden_states, restore)

    def call(self, runner: Any, layer: Any, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """One call of a kept layer the plan graphs: a replay, or the eager layer (said once per reason, counted)."""
        index, original = layer.index, layer.original
        graphs, turn, restore = self._replayable(runner, layer, hidden_states, args, kwargs)
        if isinstance(graphs, GraphedLayer):
            return replay(graphs, hidden_states, turn, restore)
        why = graphs
        if index in self._graphed and why is not CHECKPOINTED and torch.is_grad_enabled() and layer.module.training \
                and not self._eager_keeps_activations(hidden_states, kwargs):
            # its graphs' pool holds its activations already: a second copy outside it is what runs a
            # GPU near its limit out of memory, so this call keeps only its input and recomputes
            self.recomputed += 1
            return checkpoint(original, hidden_states, *args, use_reentrant=False, **kwargs)
        return original(hidden_states, *args, **kwargs)

    def _eager_keeps_activations(self, x: torch.Tensor, kwargs: dict) -> bool:
        """Whether this forward's eager calls of graphed layers keep their activations: whether every graphed
        layer's, at this call's tokens, fits beside the pools (``GraphMemory.problem``). Decided at the forward's first
        such call, for all of them (its later layers' activations are not there yet to be counted)."""
        run = self._run(kwargs)
        if run is not None and run is self._eager_run:
            return self._eager_keeps
        problem = self.memory.problem(x.device, x.shape[1], max(len(self._graphed), 1))
        if isinstance(run, PackedRun):
            self._eager_run, self._eager_keeps = run, problem is None
        if problem is not None:
            self._say("recompute", f"graphed layers called eagerly recompute their forward in backward: {problem}",
                      logging.INFO)
        return problem is None

    def _run(self, kwargs: dict) -> Optional[PackedRun]:
        return self.packed.run_for(kwargs) if self.packed is not None else None

    def _plan(self, x: Any, args: tuple, kwargs: dict) -> Union[Eager, Variant]:
        """This forward's graph variant (bucket, autocast state, constant arguments, per-token arguments), or why
        its layer calls cannot run on graphs. The same for every layer of one forward: decided at its first call."""
        run = self._run(kwargs)
        if run is None or run is not self._plan_run:
            plan = self._plan_for(x, args, kwargs)
            if isinstance(run, PackedRun):
                self._plan_run, self._plan_of_run = run, plan  # the run held: a later one cannot reuse its id
            return plan
        return self._plan_of_run

    def _plan_for(self, x: Any, args: tuple, kwargs: dict) -> Union[Eager, Variant]:
        if args or not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != 1:
            return Eager("not one padding-free row")
        run = self._run(kwargs)
        if not isinstance(run, PackedRun):
            return Eager("no packed metadata (cached_packing off)")
        if self.backend.device_type == "cuda" and run.kernel not in _FUSED_KERNELS:
            return Eager("attention kernel without static shapes (not varlen / flash_attn)")
        if any(kwargs.get(k) is not None for k in _NONE_KWARGS) or kwargs.get("use_cache"):
            return Eager("a mask or KV cache argument")
        pe = kwargs.get("position_embeddings")
        if not (isinstance(pe, tuple) and len(pe) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 3
                                                               and t.shape[1] == x.shape[1] for t in pe)):
            return Eager("no (cos, sin) position embeddings of the row's length")
        for key, value in kwargs.items():
            if not isinstance(value, torch.Tensor) or key in ("cu_seq_lens_q", "cu_seq_lens_k", *DROPPED_KWARGS):
                continue
            if key not in TOKENWISE_KWARGS or value.shape[-1] != x.shape[1]:
                return Eager(f"a tensor argument the graph cannot take ({key})")
        bucket = bucket_for(x.shape[1], self.max_tokens)
        if bucket is None:
            return Eager(f"more than {self.max_tokens} tokens")
        if run.cu_q.numel() - 1 > doc_capacity(bucket):
            return Eager("more documents than the bucket holds")
        constants = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))
                                 and k not in ("max_length_q", "max_length_k")))
        autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        tokenwise = tuple(k for k in TOKENWISE_KWARGS if kwargs.get(k) is not None)
        return self._fitting(Variant(bucket, autocast, constants, tokenwise), x, run.cu_q.numel() - 1)

    def _fitting(self, variant: Variant, x: torch.Tensor, docs: int) -> Variant:
        """``variant``; before the run's first capture, the same at the largest bucket its micro-batches reach (the
        pools sized once: see the module docstring); or, when it has no graphs yet and the memory its capture takes
        is not there, the smallest variant already captured for a larger bucket that holds the row (padded as every
        shorter row is): a new bucket's pools beside the others' are what runs a GPU near its limit out of memory."""
        if self._captures == 0:
            top = self._top_bucket()
            if top <= variant.bucket or doc_capacity(top) < docs:
                return variant
            self._say("top", f"the first capture is of the {top}-token bucket, the longest micro-batch's, its rows "
                      "padded: the graphs' pools are sized once, and smaller buckets fit in them", logging.INFO)
            return replace(variant, bucket=top)
        if self.memory.layer_bytes is None or any(v == variant for _, v in self._graphs):
            return variant
        eligible = [layer for layer in self._layers if self._runner.plans[layer.index].graphed
                    and self._runner.plans[layer.index].activations == KEPT]
        grads = sum(self._new_grads(layer.index, layer.module) for layer in eligible)
        if self.memory.problem(x.device, variant.bucket, max(len(eligible), 1), taken=0, grads=grads) is None:
            return variant
        larger = sorted({v for (i, v), e in self._graphs.items() if isinstance(e, GraphedLayer)
                         and v.bucket > variant.bucket and doc_capacity(v.bucket) >= docs
                         and (v.autocast, v.constants, v.tokenwise) == (variant.autocast, variant.constants,
                                                                         variant.tokenwise)},
                        key=lambda v: v.bucket)
        if not larger:
            return variant  # captured layer by layer while memory lasts; the rest run eagerly, recomputed
        self.reused += 1
        self._say(f"reuse{variant.bucket}", f"rows of up to {variant.bucket} tokens replay the {larger[0].bucket}-token "
                  "graphs: no memory for another bucket's", logging.INFO)
        return larger[0]

    def _graphs_for(self, index: int, variant: Variant, x: torch.Tensor, kwargs: dict) -> Entry:
        """This layer's graphs for the forward's variant (captured now, from this layer on, if new), or why it has
        none."""
        entry = self._graphs.get((index, variant))
        if entry is None or stale(entry, self._kept(index)):  # new, or its plan changed since its bucket's capture
            if self._captures >= MAX_CAPTURES:
                return TOO_MANY_CAPTURES
            self._capture(index, variant, x, kwargs)
            entry = self._graphs[(index, variant)]
        return entry

    def _capture(self, first: int, variant: Variant, x: torch.Tensor, kwargs: dict) -> None:
        """Capture one variant's graphs for every eligible layer from ``first`` on that has none yet, in the order
        they replay in, so the graphs of one call share a memory pool (each call its own: a layer captured later
        replays between the others). Kept layers: all forwards in layer order, then all backwards in reverse, each
        backward before any replay has written the static inputs autograd saved. Checkpointed layers: all forwards
        (without grad) in layer order, then each recompute and its backward in reverse, in the run's one pool for
        them (``ops.recompute_graphs``: nothing of theirs is alive in it between two replays)."""
        self._captures += 1
        started = time.perf_counter()
        budget = self._runner.budget if self._runner is not None else None
        try:
            with budget.capturing() if budget is not None else contextlib.nullcontext():
                self._capture_from(first, variant, x, kwargs)
        finally:
            if x.is_cuda:  # pools change only here: the budget reads this, not the allocator's snapshot, per call
                self.memory.pools_reserved = sum(self.pool_bytes().values())
            self.capture_s += time.perf_counter() - started

    def _kept(self, index: int) -> bool:
        return self._runner.plans[index].activations == KEPT

    def _capture_from(self, first: int, variant: Variant, x: torch.Tensor, kwargs: dict) -> None:
        bucket = variant.bucket
        reserved = gpu_reserved(x.device)
        shared = self._shared.get(bucket)
        if shared is None:
            shared = self._shared[bucket] = BucketMetadata(bucket, self.packed, x.device)
        shared.load(x.shape[1], kwargs, rope_key(self._layers[first].module))
        # kept layers: the run's kept pool for a variant's first capture (no other variant's replays come between
        # its forwards and backwards: Turn), else a pool of this call's own (its layers replay between the
        # variant's others); recomputed layers: the run's one pool for them
        pooled = not any(v == variant and isinstance(e, GraphedLayer) for (_, v), e in self._graphs.items())
        pools: dict[bool, Any] = {}
        kept: list[GraphedLayer] = []
        recomputed: list[RecomputedLayer] = []
        attempted: list[int] = []
        captured: list[tuple[int, Union[GraphedLayer, RecomputedLayer]]] = []
        warmed: set[tuple] = set()  # (kept, layer shape) warmed up in this call: its kernels and workspaces exist
        x_grad = x.requires_grad
        try:
            for i in range(first, len(self._layers)):
                record, entry = self._layers[i], self._graphs.get((i, variant))
                layer, keep = record.module, self._kept(i)
                if entry is not None and not stale(entry, keep):  # captured, or a lasting reason
                    x_grad = True
                    continue
                why: Optional[Eager] = None
                # what a kept capture makes for good beside its pool: gradient buffers, static input (first time)
                made = self._new_grads(i, layer) + self._new_input(i, bucket, x, x_grad) if keep else 0
                if not self._runner.plans[i].graphed:
                    why = CHECKPOINTED
                elif hooked(layer):
                    why = HOOKED
                    self._say(f"hooks{i}", f"layer {i} runs eagerly: a module inside it has hooks (they would run "
                              "at the capture only)")
                elif (keep or not recomputed) and (no_room := self.memory.problem(
                        x.device, bucket, taken=len(kept) if pooled else None, grads=made)
                        if keep else self.memory.problem(
                        x.device, bucket - self.memory.recompute_tokens, stands_in=True)) is not None:
                    # the recomputed layers' one pool holds one layer's activations at its largest bucket: what a
                    # larger bucket adds to it, checked once a call
                    why = Eager(no_room, Kind.LASTING)
                    self._say(f"mem{bucket}", f"layer {i} and later run eagerly at {bucket} tokens: {no_room}")
                if why is not None:
                    self._graphs[(i, variant)] = why
                    x_grad = True  # an eager layer's output: it needs grad when anything before it trains
                    continue
                attempted.append(i)
                if shared.grad_out is None:
                    shared.grad_out = x.new_zeros((1, bucket, x.shape[-1]))
                if keep not in pools:
                    if not keep and self._recompute_pool is None:
                        self._recompute_pool = self.backend.pool()
                    if keep and pooled and self._kept_pool is None:
                        self._kept_pool = self.backend.pool()
                    if keep and not pooled:
                        self._own_pools.append(self.backend.pool())
                    pools[keep] = (self._kept_pool if pooled else self._own_pools[-1]) if keep else self._recompute_pool
                static_kwargs = shared.static_kwargs(kwargs, rope_key(layer))
                label = f"decoder layer {i}"
                # a layer never run before warms up too: whatever it sets up at its first call is not captured
                shape = (keep, x_grad, layer_shape(layer))
                warm = shape not in warmed or not (record.measured or i in self._warmed_layers)
                if warm:
                    warmed.add(shape)
                    self._warmed_layers.add(i)
                if keep:
                    need = self.memory.need(bucket, taken=len(kept) if pooled else None)
                    self.memory.give_back_cache(x.device, None if need is None else need + made)
                    graphs = GraphedLayer(layer, record.original, shared.grad_out, x_grad, static_kwargs,
                                          shared.grad_out, self.backend, pools[keep], label=label,
                                          grads_into=self._layer_grads(i, layer),
                                          static_x=self._static_input(i, bucket, x, x_grad),
                                          outputs=self._shared_buffers(bucket, x, True).outputs)
                    before = gpu_in_use(x.device)
                    graphs.capture_forward(warm=warm)
                    if x.is_cuda:  # what the forward's graph keeps, twice: the backward's graph comes on top
                        self.memory.measured(2 * (gpu_in_use(x.device) - before), bucket)
                    kept.append(graphs)
                else:
                    if not recomputed:
                        self.memory.give_back_cache(
                            x.device, self.memory.recompute_need(bucket - self.memory.recompute_tokens), stands_in=True)
                    graphs = RecomputedLayer(layer, record.original, self._shared_buffers(bucket, x, x_grad),
                                             static_kwargs, shared.grad_out, self.backend, pools[keep], label=label,
                                             grads_into=self._layer_grads(i, layer))
                    graphs.capture_forward(warm=warm)
                    recomputed.append(graphs)
                captured.append((i, graphs))
                x_grad = x_grad or bool(graphs.trainable)
            for graphs in reversed(kept):
                graphs.capture_backward()
            for graphs in reversed(recomputed):  # each recompute's activations freed before the next one's
                held = graphs.capture_recompute(lambda: gpu_in_use(x.device))
                if x.is_cuda:
                    self.memory.measured(2 * held, bucket)
        except Exception as err:  # noqa: BLE001 - an op that cannot be captured: the bucket stays eager
            why = UNREACHED if isinstance(err, UnreachedParameters) else CAPTURE_FAILED
            for i in attempted:
                self._graphs[(i, variant)] = why
                if not any(j == i and not isinstance(e, Eager) for (j, _), e in self._graphs.items()):
                    self._grads.pop(i, None)  # no graphs of it write these buffers
                    for key in [key for key in self._inputs if key[0] == i]:
                        del self._inputs[key]
            self._say(f"fail{bucket}", f"layers run eagerly at {bucket} tokens: their capture failed "
                      f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
            return
        if recomputed:
            self.memory.recompute_tokens = max(self.memory.recompute_tokens, bucket)
        if kept and pooled:
            self._pooled.add(variant)
            self.memory.pooled(len(kept), bucket)
        for i, graphs in captured:
            self._graphs[(i, variant)] = graphs
            if isinstance(graphs, GraphedLayer):
                self._graphed.add(i)
        self.captured += len(captured)
        # the pools' memory is reserved, mostly not allocated: what reading an out-of-memory needs
        logger.debug("nbkit cuda_graphs: %d layers captured at %d tokens (%d checkpointed); reserved GPU memory "
                     "%s -> %s", len(attempted), bucket, len(recomputed), fmt_bytes(reserved),
                     fmt_bytes(gpu_reserved(x.device)))
        if attempted:
            self._say("on", f"decoder layers replay as CUDA graphs (buckets of up to {self.max_tokens} tokens)",
                      logging.INFO)

    def _shared_buffers(self, bucket: int, x: torch.Tensor, x_grad: bool) -> Shared:
        """A bucket's static buffers: the recomputed layers' input, output and input gradient; the kept layers copy
        their output and input gradient into the same two (``Shared.outputs``: every replay's are cloned out before
        the next replay, kept or recomputed), so that no layer's stay in the pool."""
        key = (bucket, x.dtype, x_grad)
        if key not in self._buffers:
            self._buffers[key] = Shared.make((1, bucket, x.shape[-1]), x.dtype, x.device, x_grad)
        return self._buffers[key]

    def _new_grads(self, index: int, layer: torch.nn.Module) -> int:
        """What a capture of layer ``index`` makes for good beside what ``GraphMemory.need`` sizes: its parameter-gradient
        buffers, at its first capture (``_layer_grads``; small with LoRA, a full fine-tune's are the layer's size)."""
        if index in self._grads:
            return 0
        return sum(p.numel() * p.element_size() for p in trainable_parameters(layer))

    def _layer_grads(self, index: int, layer: torch.nn.Module) -> LayerGrads:
        """Layer ``index``'s parameter-gradient buffers, shared by all its graphs (every bucket, kept or
        checkpointed): made at its first capture, outside the pools."""
        if index not in self._grads:
            self._grads[index] = LayerGrads(torch.zeros_like(p) for p in trainable_parameters(layer))
        return self._grads[index]

    def _static_input(self, index: int, bucket: int, x: torch.Tensor, x_grad: bool) -> torch.Tensor:
        """Kept layer ``index``'s static input at ``bucket`` tokens: a view of one buffer its graphs of every bucket
        share (sized by the largest bucket the run reaches: ``_top_bucket``), as one forward of a layer awaits its
        backward at a time (``Turns``; a second forward of the bucket raises). Made at the first capture needing it."""
        if tokens := self._input_to_make(index, bucket, x, x_grad):
            self._inputs[(index, x.dtype, x_grad)] = x.new_zeros((1, tokens, x.shape[-1]))
        view = self._inputs[(index, x.dtype, x_grad)][:, :bucket]
        return view.requires_grad_(x_grad) if x_grad else view

    def _new_input(self, index: int, bucket: int, x: torch.Tensor, x_grad: bool) -> int:
        """The bytes ``_static_input`` makes for layer ``index`` at ``bucket`` tokens (0 when its buffer holds it)."""
        return self._input_to_make(index, bucket, x, x_grad) * x.shape[-1] * x.element_size()

    def _input_to_make(self, index: int, bucket: int, x: torch.Tensor, x_grad: bool) -> int:
        buffer = self._inputs.get((index, x.dtype, x_grad))
        return 0 if buffer is not None and buffer.shape[1] >= bucket else max(bucket, self._top_bucket())

    def recompute_reserve(self, runner: Any) -> int:
        """Bytes the checkpointed layers' graphs will still hold for good, for the plan to leave free (their pool
        is not the step's to spend): one layer's activations at the largest bucket the run's micro-batches reach,
        above what the pool holds already; each graphable checkpointed layer's parameter-gradient buffers not made
        yet; the buckets' shared input, output and input-gradient buffers not made yet. Sized by the plan's
        measurements (``runner.costs`` at ``runner.max_tokens``); 0 before them. A layer with hooks inside runs
        eagerly whatever the plan (``HOOKED``): nothing is held back for it."""
        sized = [c for c in runner.costs if c.kept < UNSIZED]
        layers = [layer for layer in runner.layers if layer.checkpointed and layer.graphable and not hooked(layer.module)]
        if not self.checkpointed or self._runner is not runner or not sized or not layers or not runner.max_tokens:
            return 0
        top = self._top_bucket()
        activations = max(c.kept for c in sized) * max(0, top - self.memory.recompute_tokens) // runner.max_tokens
        grads = sum(self._new_grads(layer.index, layer.module) for layer in layers)
        made = {key[0] for key in self._buffers}
        per_token = max(c.input for c in sized) / runner.max_tokens
        buffers = int(3 * per_token * sum(b for b in BUCKETS if b <= top and b not in made))
        return activations + grads + buffers

    def _top_bucket(self) -> int:
        """The largest bucket the run's micro-batches reach: the one holding the runner's ``max_tokens`` (what the
        plan sizes activations by), or the largest graphed one below them; 0 before the plan knows them."""
        tokens = getattr(self._runner, "max_tokens", 0)
        if not tokens:
            return 0
        return bucket_for(tokens, self.max_tokens) or max((b for b in BUCKETS if b <= self.max_tokens), default=0)
