"""A checkpointed layer as CUDA graphs: its forward without grad as one replay; in backward, its recompute and its
backward as two more, replayed back to back.

Why: under a small card's memory most decoder layers are checkpointed, and an eager checkpointed layer runs its
forward twice and its backward once from Python, a few hundred kernel launches each. On short rows the host then
takes longer than the GPU. A kept layer's graphs (``layer_graphs.GraphedLayer``) cannot stand in: their pool keeps
the layer's activations for good, which is what checkpointing is there to avoid.

How: the graphs of the checkpointed layers share one pool, captured in the order they replay in: each layer's
forward in layer order, then, layer by layer in reverse, its recompute and its backward. A recompute's activations
are freed by its backward before the next layer's recompute is captured, so the pool holds one layer's activations,
not one per layer. The static input, output and input gradient are ``Shared`` by the layers of a bucket (they replay
one at a time) and copied into inside the graphs, so no layer's own output stays in the pool; its parameters'
gradients likewise go into buffers of the layer's own (``grads_into``, a ``LayerGrads``), shared by its graphs of
every bucket; a backward hands autograd a copy of them only while another forward of the layer awaits its backward
(whose replay would write over them before autograd has summed the two). So
between any two replays nothing the pool's graphs wrote is alive: graphs of several captures (other buckets, layers
captured later) can share the pool and replay in any order, except a recompute and its backward, which replay back
to back.

Contract: the losses and gradients of non-reentrant checkpointing up to rounding (the recompute is the forward's own
graph, captured with grad). What backward needs is the layer's input, saved by ``save_for_backward`` (so
``saved_tensors_hooks`` see it, as they see checkpoint's), and the static metadata of the bucket as the forward left
it: no other forward of the bucket may run between a forward and its backward. Nothing else may be captured into
the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .layer_graphs import GraphedLayer, LayerGrads, load_static


@dataclass(frozen=True)
class Shared:
    """Static buffers shared by the recomputed layers of one bucket: input, forward output, input gradient."""

    x: torch.Tensor
    out: torch.Tensor
    grad_x: torch.Tensor

    @classmethod
    def make(cls, shape: tuple, dtype: torch.dtype, device: torch.device, x_grad: bool) -> Shared:
        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(zeros().requires_grad_(x_grad), zeros(), zeros())

    @property
    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, input gradient): what ``GraphedLayer``'s graphs copy into (``outputs``)."""
        return self.out, self.grad_x


class RecomputedLayer:
    """One checkpointed layer's three graphs: forward without grad, recompute, backward (see module docstring)."""

    def __init__(self, module: torch.nn.Module, forward_fn: Callable[..., Any], shared: Shared,
                 static_kwargs: Callable[[], dict], grad_out: torch.Tensor, backend: Any, pool: Any,
                 label: str = "layer", grads_into: Optional[Sequence[torch.Tensor]] = None) -> None:
        """``grads_into``: the layer's parameter-gradient buffers, shared by its graphs of every bucket (default:
        its graphs' own, in the pool)."""
        self.shared, self.grads_into = shared, grads_into
        self.graphed = GraphedLayer(module, forward_fn, shared.x, shared.x.requires_grad, static_kwargs, grad_out,
                                    backend, pool, label, grads_into=grads_into, static_x=shared.x,
                                    outputs=(None, shared.grad_x))  # nothing reads the recompute's output
        self.trainable = self.graphed.trainable
        self.x = shared.x
        self.fwd: Any = None

    def capture_forward(self, warm: bool = True) -> None:
        """The forward without grad (its output copied into the shared output), in layer order. ``warm``: warm up
        its forward and backward first; the layers after the first of a capture call, of the same shapes, need not
        (each warm-up is a whole eager step of the layer)."""
        graphed = self.graphed
        if warm:
            graphed.warm_up()
            graphed.backend.warm_up(lambda: graphed._run(graphed.static_kwargs(), grad=False), self.x.device)
        kwargs = graphed.static_kwargs()
        graph = graphed.backend.new_graph()
        with graphed.backend.capturing(graph, graphed.pool):
            self.shared.out.copy_(graphed._run(kwargs, grad=False))
        self.fwd = graph

    def capture_recompute(self, in_use: Optional[Callable[[], int]] = None) -> int:
        """The recompute and the backward, after every layer's forward, in reverse layer order. Returns the bytes
        the recompute's capture held (by ``in_use``, the device's bytes in use; 0 without it)."""
        before = in_use() if in_use is not None else 0
        self.graphed.capture_forward(warm=False)
        held = in_use() - before if in_use is not None else 0
        self.graphed.capture_backward()
        return held

    def replay_forward(self, x: torch.Tensor) -> torch.Tensor:
        load_static(self.x, x)
        self.fwd.replay()
        return self.shared.out[:, :x.shape[1]].clone()

    def replay_backward(self, x: torch.Tensor, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], list]:
        self.graphed.replay_forward(x)
        return self.graphed.replay_backward(grad, self.graphed.generation)


class _RecomputeReplay(torch.autograd.Function):
    """A checkpointed layer's forward as one replay, keeping only its input; its backward as two more."""

    @staticmethod
    def forward(ctx, layer: RecomputedLayer, restore: Optional[Callable[[], None]], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.layer, ctx.x_grad, ctx.restore = layer, x.requires_grad, restore
        LayerGrads.count(ctx, layer.grads_into)
        ctx.save_for_backward(x)
        return layer.replay_forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        if ctx.restore is not None:
            ctx.restore()
        grad_x, grads = ctx.layer.replay_backward(x, grad.contiguous())
        return (None, None, grad_x if ctx.x_grad else None, *LayerGrads.hand_out(ctx, grads))


def replay_checkpointed(layer: RecomputedLayer, x: torch.Tensor,
                        restore: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """``layer``'s forward on ``x`` as a replay, differentiable to ``x`` and the real trainable parameters, keeping
    ``x`` alone for backward. ``restore``: called before the recompute, to put this forward's metadata back into the
    static buffers the graphs read (another forward of the bucket may have loaded its own since)."""
    return _RecomputeReplay.apply(layer, restore, x, *layer.trainable)
