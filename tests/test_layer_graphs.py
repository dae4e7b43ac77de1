"""``nbkit.ops.layer_graphs``: the graph engine on the tape backend (CPU), checked against the eager module.

The tape must behave as a CUDA graph does, so that CPU tests see what a GPU would: replays recompute from the static
input and the parameters' current values, Python runs only at capture (a tensor read from outside the capture stays
the one read), a host read of a device value fails the capture, and a parameter the graph does not reach fails it
too; a capture cut in ``Segments`` replays its graphs in order with eager work between them.
``tests/gpu/test_layer_graphs_gpu.py`` runs the same scenarios on real CUDA graphs and compares.
"""

from __future__ import annotations

import pytest
import torch

from nbkit.ops.layer_graphs import GraphedLayer, Segments, TapeBackend, UnreachedParameters, replay

HIDDEN, TOKENS = 8, 12


class Block(torch.nn.Module):
    """A residual MLP whose forward also reads ``extra`` (a per-call input handed in through kwargs) and, when set,
    a tensor cached on the module (the pattern that went stale under graphs)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.cache: dict[str, torch.Tensor] = {}
        self.by_reference: list[torch.nn.Parameter] = []

    def forward(self, x: torch.Tensor, extra: torch.Tensor, read_item: bool = False) -> torch.Tensor:
        if read_item:
            extra = extra * float(extra.sum().item())
        h = torch.nn.functional.silu(self.up(x)) * extra
        if "scale" in self.cache:
            h = h * self.cache["scale"]
        if self.by_reference:  # a weight held in a list made at attach: not what the module holds now
            return x + h @ self.by_reference[0].t()
        return x + self.down(h)


def _graphed(block: Block, extra: torch.Tensor, backend, **kw) -> GraphedLayer:
    grad_out = torch.zeros(1, TOKENS, HIDDEN, device=extra.device)
    layer = GraphedLayer(block, block.forward, grad_out, True, lambda: {"extra": extra, **kw}, grad_out, backend,
                         backend.pool())
    layer.capture_forward()
    layer.capture_backward()
    return layer


def _eager(block: Block, x: torch.Tensor, extra: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_(True)
    out = block(x, extra)
    params = [p for p in block.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [x, *params], grad)
    return out.detach(), grads


def check_replays_recompute_from_the_static_input_and_the_parameters_as_they_are_now(backend, device):
    torch.manual_seed(0)
    block, extra = Block().to(device), torch.randn(1, TOKENS, 2 * HIDDEN, device=device)
    layer = _graphed(block, extra, backend)
    for step in range(3):
        x = torch.randn(1, TOKENS - step, HIDDEN, device=device)
        grad = torch.randn(1, TOKENS - step, HIDDEN, device=device)
        extra.copy_(torch.randn_like(extra))  # a per-call input written into its static buffer
        pad = TOKENS - x.shape[1]
        expect_out, expect_grads = _eager(block, torch.nn.functional.pad(x, (0, 0, 0, pad)), extra,
                                          torch.nn.functional.pad(grad, (0, 0, 0, pad)))
        xr = x.clone().requires_grad_(True)
        out = replay(layer, xr)
        out.backward(grad)
        torch.testing.assert_close(out, expect_out[:, : x.shape[1]])
        torch.testing.assert_close(xr.grad, expect_grads[0][:, : x.shape[1]])
        for p, g in zip(layer.trainable, expect_grads[1:]):
            torch.testing.assert_close(p.grad, g)
            p.grad = None
        with torch.no_grad():  # an optimizer step, in place
            for p in block.parameters():
                p.add_(0.1 * torch.randn_like(p))


def check_python_runs_only_at_capture(backend, device):
    """A tensor cached on the module before the capture is read by every replay, whatever the cache holds later:
    the stale read a graph makes. (The engine's contract keeps per-call caches inside the capture.)"""
    torch.manual_seed(1)
    block, extra = Block().to(device), torch.randn(1, TOKENS, 2 * HIDDEN, device=device)
    block.cache["scale"] = torch.full((), 2.0, device=device)
    layer = _graphed(block, extra, backend)
    x = torch.randn(1, TOKENS, HIDDEN, device=device)
    first = replay(layer, x).detach()
    old = block.cache["scale"]  # kept alive: a graph reading freed memory would read whatever is written there next
    block.cache["scale"] = torch.full((), 3.0, device=device)  # a new tensor: the graph still reads the old one
    torch.testing.assert_close(replay(layer, x).detach(), first)
    del block.cache["scale"]  # Python would now skip the multiply; the graph still does it
    torch.testing.assert_close(replay(layer, x).detach(), first)
    assert old.item() == 2.0


def check_a_host_read_of_a_device_value_fails_the_capture(backend, device):
    block, extra = Block().to(device), torch.randn(1, TOKENS, 2 * HIDDEN, device=device)
    with pytest.raises(RuntimeError):  # the tape names it; CUDA says the operation is not permitted while capturing
        _graphed(block, extra, backend, read_item=True)


def check_a_parameter_held_by_reference_fails_the_capture(backend, device):
    """The graph differentiates stand-ins swapped into the modules; a weight read from elsewhere gets no gradient."""
    block, extra = Block().to(device), torch.randn(1, TOKENS, 2 * HIDDEN, device=device)
    block.by_reference.append(block.down.weight)
    with pytest.raises(UnreachedParameters, match="1 trainable parameter"):
        _graphed(block, extra, backend)


def check_a_second_forward_before_the_backward_is_refused(backend, device):
    block, extra = Block().to(device), torch.randn(1, TOKENS, 2 * HIDDEN, device=device)
    layer = _graphed(block, extra, backend)
    x = torch.randn(1, TOKENS, HIDDEN, device=device, requires_grad=True)
    first = replay(layer, x)
    replay(layer, x).sum().backward()
    with pytest.raises(RuntimeError, match="forward again before the backward"):
        first.sum().backward()


def check_segments_replay_in_order_with_eager_parts_between(backend, device):
    """A step cut in two graphs (as the graphed decoder cuts at each attention): the eager part between them runs at
    each replay with the Python values of that replay, the graphs read the static input as it is now."""
    torch.manual_seed(0)
    w = torch.randn(HIDDEN, HIDDEN, device=device)
    x = torch.randn(4, HIDDEN, device=device)
    segments = Segments(backend)
    with torch.no_grad():
        backend.warm_up(lambda: torch.tanh(x @ w) + x, x.device)
        segments.begin()
        y = torch.tanh(x @ w)
        segments.end()
        between = torch.empty_like(y)  # written by the eager part, read by the second graph
        segments.begin()
        out = between * 2 + x
        segments.end()
    assert len(segments.graphs) == 2
    for scale in (1.0, -3.0, 0.5):
        x.copy_(torch.randn(4, HIDDEN, device=device))
        segments.graphs[0].replay()
        between.copy_(y[:, :1].expand_as(y) * scale)  # the eager part: its Python value changes per replay
        segments.graphs[1].replay()
        want = torch.tanh(x @ w)[:, :1].expand_as(y) * scale * 2 + x
        torch.testing.assert_close(out, want)


CHECKS = [check_replays_recompute_from_the_static_input_and_the_parameters_as_they_are_now,
          check_python_runs_only_at_capture, check_a_host_read_of_a_device_value_fails_the_capture,
          check_a_parameter_held_by_reference_fails_the_capture, check_a_second_forward_before_the_backward_is_refused,
          check_segments_replay_in_order_with_eager_parts_between]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__[6:])
def test_on_the_tape(check):
    check(TapeBackend(), "cpu")


def test_an_aborted_segment_leaves_capture_and_no_graphs():
    segments = Segments(TapeBackend())
    segments.begin()
    with pytest.raises(RuntimeError, match="open already"):
        segments.begin()
    segments.abort()
    assert segments.graphs == [] and segments._open is None
    segments.begin()  # a new capture can start
    segments.end()
    assert len(segments.graphs) == 1
