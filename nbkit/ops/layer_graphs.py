"""Graph capture and replay of one module's forward and backward over static buffers, for any graph backend.

Why a separate engine: a CUDA graph replays the kernels it recorded on the memory it recorded them on. Everything
Python decided during the capture (a cache hit, a branch, a tensor some object held) is frozen into it. A layer is
exact under graphs only if everything that changes between calls reaches the graph through its static buffers.
This module owns that contract and nothing else. ``nbkit.speedups.cuda_graphs`` decides which layers and
buckets to graph.

Backends:

- ``CudaGraphBackend``: ``torch.cuda.CUDAGraph``. The warm-up runs on a side stream, so kernels are compiled and
  workspaces exist before the capture; the capture runs on that stream too, without emptying the allocator's caches
  before each graph.
- ``TapeBackend``: an eager stand-in with the same semantics, on any device (CPU tests). A ``Tape`` records the ATen
  ops run during its capture, with the very tensors they read and wrote. A replay runs those ops again on the same
  tensors and writes each result into the tensor recorded for it. Python is not re-run: a tensor computed outside
  the capture and read inside it stays the one read at capture, as on a GPU. A host read of a device value
  (``item()``, ``nonzero``) fails the capture, as it does on a GPU.

Contract of ``GraphedLayer``:

- ``static_kwargs()`` is called twice: once for the warm-up, once for the capture. Per-call objects (a
  ``PackedRun`` and its mask caches) are therefore made inside the capture, never carried in from the warm-up.
- The graphs differentiate stand-ins of the layer's trainable parameters. A stand-in shares its parameter's
  memory, so an in-place optimizer step is seen, and it is swapped into the modules while the layer's forward and
  backward are captured. Why: an
  autograd node of the real parameters, kept alive by the caller (a loss), would pin the capture's gradients to
  the caller's stream. Anything inside the layer must therefore read its parameters from its module at call
  time. A trainable parameter that gets no gradient through the stand-ins (one held by reference elsewhere) fails
  the capture with ``UnreachedParameters``, so the layer runs eagerly instead of training without it.
- One forward, then its backward. A second forward before the backward raises ``RuntimeError``: the graph keeps
  one forward's activations. Graphs of one pool must replay in the order they were captured. The caller captures
  all forwards in layer order, then all backwards in reverse.

``Segments``: one capture cut into several graphs of one pool, for a step with parts that must run eagerly at each
replay (the graphed decoder's attention over a length that grows every token). Every graph capture in nbkit goes
through these backends, so the CPU tests drive each captured path on tapes.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
# ops that read a device value on the host: a CUDA capture fails on them, so the tape does too
_HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
               aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default}


class UnreachedParameters(RuntimeError):
    """Trainable parameters of the layer that its graph does not differentiate (held by reference elsewhere)."""


# ---------------------------------------------------------------------------------------------------------------
# backends


class CudaGraphBackend:
    """Real CUDA graphs: one memory pool per capture call, warm-up and capture on one side stream.

    ``capturing`` begins and ends the capture itself rather than through ``torch.cuda.graph``, whose entry
    synchronizes the device and empties the allocator's caches (device and pinned host) before every graph: a
    bucket of a 28-layer model is 56 graphs, and each emptied cache is refilled by the next step's allocations.
    What it keeps of it: the capture runs on its own stream, after the work queued on the current one, and the
    current stream waits for it after.
    """

    device_type: Optional[str] = "cuda"

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def _stream(self) -> Any:
        device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    @contextlib.contextmanager
    def capturing(self, graph: Any, pool: Any) -> Iterator[None]:
        side, current = self._stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()
        current.wait_stream(side)

    def warm_up(self, fn: Callable[[], Any], device: torch.device) -> None:
        side, current = self._stream(), torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            raise RuntimeError(f"{func} reads a device value on the host: a graph cannot be captured here")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride())


class Tape:
    """The ATen ops of one capture, replayed on the tensors they were recorded with (see module docstring)."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with _Recorder(self.ops):
            yield

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                result = func(*args, **kwargs)
                for recorded, new in zip(tree_leaves(out), tree_leaves(result)):
                    if isinstance(recorded, torch.Tensor) and recorded is not new and not _same_memory(recorded, new):
                        recorded.copy_(new)  # a fresh result: into the memory the later ops read


class TapeBackend:
    """Graphs as ``Tape`` s, on any device: the CPU tests' stand-in for CUDA graphs."""

    device_type: Optional[str] = None  # any

    def pool(self) -> Any:
        return None

    def new_graph(self) -> Tape:
        return Tape()

    def capturing(self, graph: Tape, pool: Any) -> contextlib.AbstractContextManager:
        return graph.recording()

    def warm_up(self, fn: Callable[[], Any], device: torch.device) -> None:
        fn()


# ---------------------------------------------------------------------------------------------------------------
# one layer's graphs


def load_static(static: torch.Tensor, x: torch.Tensor) -> None:
    """Copy ``x`` (its tokens on dim 1) into the front of a graph's static buffer, and zero the rest."""
    tokens = x.shape[1]
    with torch.no_grad():
        static[:, :tokens].copy_(x)
        if tokens < static.shape[1]:
            static[:, tokens:].zero_()


def trainable_parameters(module: torch.nn.Module) -> tuple:
    """A module's trainable parameters, each once, in the order its graphs return their gradients."""
    return tuple({id(p): p for m in module.modules() for p in m._parameters.values()
                  if p is not None and p.requires_grad}.values())


class LayerGrads(list):
    """One layer's parameter-gradient buffers (a list of tensors, in ``trainable``'s order), shared by its graphs of
    every bucket, and how many of its forward replays await their backward (``awaiting``)."""

    awaiting: int = 0

    def due(self, owner: object) -> Callable[[], None]:
        """Count one more forward awaiting its backward, until the returned callable is called (the backward: once,
        however often a retained graph is backpropagated) or ``owner`` (the forward's autograd node) is freed
        without a backward."""
        self.awaiting += 1
        return weakref.finalize(owner, self._done)

    def _done(self) -> None:
        self.awaiting -= 1

    @staticmethod
    def count(ctx: Any, buffers: Any) -> None:
        """In a replay's forward: count it on ``buffers`` (a ``LayerGrads``; anything else is not counted) until its
        backward, when a backward will follow."""
        ctx.grads = buffers if isinstance(buffers, LayerGrads) and any(ctx.needs_input_grad) else None
        if ctx.grads is not None:
            ctx.done = ctx.grads.due(ctx)

    @staticmethod
    def hand_out(ctx: Any, grads: list) -> list:
        """In that replay's backward: the parameter gradients to give autograd, copies while another forward's
        backward is still to replay into the same buffers."""
        if ctx.grads is None:
            return grads
        ctx.done()
        return [g.clone() if g is not None else None for g in grads] if ctx.grads.awaiting > 0 else grads


class GraphedLayer:
    """One module's forward and backward graphs: static input, static output, static gradients."""

    def __init__(self, module: torch.nn.Module, forward_fn: Callable[..., Any], like: torch.Tensor, x_grad: bool,
                 static_kwargs: Callable[[], dict], grad_out: torch.Tensor, backend: Any, pool: Any,
                 label: str = "layer", grads_into: Optional[Sequence[torch.Tensor]] = None,
                 static_x: Optional[torch.Tensor] = None,
                 outputs: Optional[tuple[Optional[torch.Tensor], torch.Tensor]] = None) -> None:
        """``like``: a tensor of the static input's shape, dtype and device; ``grad_out``: the static buffer the
        incoming gradient is copied into (it may be shared by layers that replay one after another). ``grads_into``:
        buffers (one per trainable parameter, in ``trainable``'s order) the parameters' gradients are copied into
        instead, so that not even those stay in the pool (several buckets' graphs of one layer share them; a
        ``LayerGrads``: a backward hands autograd copies of them while another forward of the layer awaits its
        backward). ``static_x``: the static input (default: a new tensor like ``like``), e.g. one that other layers
        share (``RecomputedLayer``) or a view of a buffer the layer's graphs of every bucket share; ``outputs``:
        (output, input gradient) buffers of ``like``'s shape that layers replayed one at a time share: the graphs copy
        into them, so the pool keeps no output or input gradient of this layer between replays (output None: no
        one reads it, as a recompute's, and it is not copied)."""
        self.forward_fn, self.static_kwargs, self.grad_out = forward_fn, static_kwargs, grad_out
        self.backend, self.pool, self.label, self.grads_into = backend, pool, label, grads_into
        slots = [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if p is not None and p.requires_grad]
        stand_ins: dict[int, torch.nn.Parameter] = {}
        for _, _, p in slots:
            stand_ins.setdefault(id(p), torch.nn.Parameter(p.detach(), requires_grad=True))
        self.trainable = trainable_parameters(module)
        self._slots = [(m, n, p, stand_ins[id(p)]) for m, n, p in slots]
        self.outputs = outputs
        self.x = static_x if static_x is not None else \
            torch.zeros(like.shape, dtype=like.dtype, device=like.device, requires_grad=x_grad)
        self.inputs = ((self.x,) if x_grad else ()) + tuple(stand_ins[id(p)] for p in self.trainable)
        device = like.device.type
        self.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self.out: Optional[torch.Tensor] = None  # static output
        self._captured_out: Optional[torch.Tensor] = None  # the capture's output, kept for the backward's capture
        self.grads: Optional[tuple] = None
        self.fwd: Any = None
        self.bwd: Any = None
        self.generation = 0

    @contextlib.contextmanager
    def _stand_ins(self) -> Iterator[None]:
        """The stand-ins in the modules: in the forward, and in the backward too (a backward may run the modules
        again, as a tiled MLP's recompute does)."""
        for module, name, _, stand_in in self._slots:
            module._parameters[name] = stand_in
        try:
            yield
        finally:
            for module, name, param, _ in self._slots:
                module._parameters[name] = param

    def _run(self, kwargs: dict, grad: bool = True) -> torch.Tensor:
        enabled, dtype = self.autocast
        with self._stand_ins(), torch.set_grad_enabled(grad), torch.autocast(
                self.x.device.type, dtype=dtype, enabled=enabled, cache_enabled=False):
            out = self.forward_fn(self.x, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the layer returns {type(out).__name__}, not the hidden states tensor")
        return out

    def _grad(self, out: torch.Tensor) -> tuple:
        with self._stand_ins():
            return torch.autograd.grad(out, self.inputs, grad_outputs=self.grad_out, allow_unused=True)

    def warm_up(self) -> None:
        """One eager forward and backward on the capture's stream: kernels compiled, workspaces made."""
        self.backend.warm_up(lambda: self._grad(self._run(self.static_kwargs())), self.x.device)

    def capture_forward(self, warm: bool = True) -> None:
        """``warm``: warm up first (False: a layer of the same shapes was warmed up just before)."""
        if warm:
            self.warm_up()
        kwargs = self.static_kwargs()
        graph = self.backend.new_graph()
        with self.backend.capturing(graph, self.pool):
            out = self._run(kwargs)
            if self.outputs is not None and self.outputs[0] is not None:
                self.outputs[0].copy_(out.detach())
        self.fwd, self.out, self._captured_out = graph, self.outputs[0] if self.outputs else out.detach(), out

    def capture_backward(self) -> None:
        graph = self.backend.new_graph()
        with self.backend.capturing(graph, self.pool):
            grads = self._grad(self._captured_out)
            grad_x = self.outputs[1] if self.outputs is not None else None
            if grad_x is not None and self.x.requires_grad:
                grad_x.copy_(grads[0])
                grads = (grad_x, *grads[1:])  # this layer's own copy goes back to the pool
            unreached = sum(g is None for g in grads[len(self.inputs) - len(self.trainable):])
            if self.grads_into is not None and not unreached:
                first = len(self.inputs) - len(self.trainable)
                for buffer, g in zip(self.grads_into, grads[first:]):
                    buffer.copy_(g)
                grads = (*grads[:first], *self.grads_into)
        self._captured_out = None
        if unreached:
            raise UnreachedParameters(f"{unreached} trainable parameter(s) of {self.label} get no gradient through "
                                      "its modules (something holds them by reference)")
        self.bwd, self.grads = graph, grads

    def replay_forward(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        load_static(self.x, x)
        self.fwd.replay()
        self.generation += 1
        return self.out[:, :x.shape[1]].clone() if self.out is not None else None

    def replay_backward(self, grad: torch.Tensor, generation: int) -> tuple[Optional[torch.Tensor], list]:
        if generation != self.generation:
            raise RuntimeError(
                f"nbkit cuda_graphs: {self.label} ran its forward again before the backward of the previous one "
                "(its graph keeps one forward's activations): run each forward's backward first, or set "
                "cuda_graphs=False")
        tokens = grad.shape[1]
        self.grad_out[:, :tokens].copy_(grad)
        if tokens < self.grad_out.shape[1]:
            self.grad_out[:, tokens:].zero_()
        self.bwd.replay()
        grads = list(self.grads)
        grad_x = grads.pop(0)[:, :tokens].clone() if self.x.requires_grad else None
        return grad_x, grads  # the parameters' static gradients: autograd clones or adds them into .grad


class Turns:
    """Whose forward may replay in one pool that several sets of graphs share (one ``Turn`` at a time).

    Graphs captured into one pool at different times (one bucket's, then another's) may put what a forward leaves
    for its backward in the same memory. That is sound while one set's forwards and backwards never interleave with
    another's, as in training, where each micro-batch's backward follows its forward. ``take`` gives a forward its
    set's open turn, or a new one when none is open, or None while another set's forward awaits its backward (a
    loop that runs two forwards before their backwards: the caller runs that forward eagerly). A turn is held by the
    autograd graph of its forwards (``replay(..., turn=)``) and by weak reference here: a forward never
    backpropagated ends its turn with its graph. A backward whose turn is no longer the pool's newest raises
    (another set's forward may have written over its activations: a second backward after other forwards)."""

    def __init__(self) -> None:
        self.issued = 0
        self._last: Optional[weakref.ref] = None

    def open(self) -> Optional[Turn]:
        """The turn whose forwards await their backwards, if any."""
        turn = self._last() if self._last is not None else None
        return turn if turn is not None and turn.open > 0 else None

    def take(self, key: Any) -> Optional[Turn]:
        turn = self.open()
        if turn is not None:
            return turn if turn.key == key else None
        self.issued += 1
        turn = Turn(key, self, self.issued)
        self._last = weakref.ref(turn)
        return turn


class Turn:
    """The forward replays of one set of graphs in a shared pool whose backward replays are still to come
    (``open``); see ``Turns``."""

    def __init__(self, key: Any, turns: Turns, number: int) -> None:
        self.key, self.turns, self.number, self.open = key, turns, number, 0

    @property
    def newest(self) -> bool:
        return self.turns.issued == self.number


class _Replay(torch.autograd.Function):
    """A layer's forward as one graph replay; its backward as another."""

    @staticmethod
    def forward(ctx, layer: GraphedLayer, turn: Optional[Turn], restore: Optional[Callable[[], None]], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        out = layer.replay_forward(x)
        ctx.layer, ctx.generation, ctx.x_grad, ctx.restore = layer, layer.generation, x.requires_grad, restore
        ctx.turn = turn if any(ctx.needs_input_grad) else None  # a replay no backward follows holds no turn
        if ctx.turn is not None:
            ctx.turn.open += 1
        LayerGrads.count(ctx, layer.grads_into)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        turn = ctx.turn
        if turn is not None and not turn.newest:
            raise RuntimeError(
                f"nbkit cuda_graphs: {ctx.layer.label}'s backward came after a forward of another bucket, whose graphs "
                "share the pool that holds this forward's activations (a second backward after other forwards): "
                "run each forward's backwards before the next forward, or set cuda_graphs=False")
        if ctx.restore is not None:
            ctx.restore()
        grad_x, grads = ctx.layer.replay_backward(grad.contiguous(), ctx.generation)
        if turn is not None:
            turn.open = max(0, turn.open - 1)
        return (None, None, None, grad_x if ctx.x_grad else None, *LayerGrads.hand_out(ctx, grads))


def replay(layer: GraphedLayer, x: torch.Tensor, turn: Optional[Turn] = None,
           restore: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """``layer``'s forward on ``x`` (at most its static input's length) as a replay, differentiable to ``x`` and
    the real trainable parameters; counted on ``turn`` until its backward (``Turns``). ``restore``: called before
    the backward's replay, to put the forward's metadata back into the static buffers the graphs read (another
    forward of the bucket may have loaded its own since)."""
    return _Replay.apply(layer, turn, restore, x, *layer.trainable)


# ---------------------------------------------------------------------------------------------------------------
# one capture in segments


class Segments:
    """One capture cut into several graphs of one pool, for a step whose parts between two graphs must run eagerly
    at replay (an attention over a length that changes every step). ``begin()`` opens a graph, ``end()`` closes it;
    the caller replays ``graphs`` in order with its eager parts between them. ``abort()`` closes an open graph after
    a failure, so the stream leaves capture mode."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.pool = backend.pool()
        self.graphs: list[Any] = []
        self._open: Optional[tuple[Any, contextlib.AbstractContextManager]] = None

    def begin(self) -> None:
        if self._open is not None:
            raise RuntimeError("a segment is open already: end it first")
        graph = self.backend.new_graph()
        context = self.backend.capturing(graph, self.pool)
        context.__enter__()
        self._open = (graph, context)

    def end(self) -> None:
        graph, context = self._open
        self._open = None
        context.__exit__(None, None, None)
        self.graphs.append(graph)

    def abort(self) -> None:
        if self._open is not None:
            _, context = self._open
            self._open = None
            with contextlib.suppress(Exception):
                context.__exit__(None, None, None)
        self.graphs = []
