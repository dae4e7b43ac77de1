"""``nbkit.ops.recompute_graphs``: checkpointed layers as graphs, on the tape backend (CPU), against torch's
non-reentrant checkpoint of the eager modules.

A stack of residual blocks, captured as ``cuda_graphs`` captures a bucket's checkpointed layers: every forward
(without grad) in layer order, then each recompute and its backward in reverse; two buckets' stacks in one pool,
rows of either in turn, shorter than the static buffers, an in-place optimizer step between steps, a per-call input
written into its static buffer. The replays
must give checkpoint's outputs and gradients, keep nothing for backward but each layer's input (what a
``saved_tensors_hooks`` pack hook sees, as under checkpoint), and read the shared buffers one layer at a time.
``tests/gpu/test_recompute_graphs_gpu.py`` runs the same checks on real CUDA graphs, and what the pool holds.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from nbkit.ops.layer_graphs import TapeBackend, trainable_parameters
from nbkit.ops.recompute_graphs import RecomputedLayer, Shared, replay_checkpointed

HIDDEN, TOKENS, LAYERS = 8, 12, 4


class Block(torch.nn.Module):
    """A residual MLP whose forward also reads ``extra``, a per-call input handed in through kwargs."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(x)) * extra)


def capture_stack(blocks: list[Block], extra: torch.Tensor, backend, pool=None, grads=None) -> list[RecomputedLayer]:
    """The blocks' graphs at ``extra``'s tokens in ``pool`` (default a new one), in the order they replay in (as
    ``cuda_graphs`` captures a bucket); ``grads``: each block's parameter-gradient buffers (default the pool's)."""
    device, hidden, tokens = extra.device, blocks[0].up.in_features, extra.shape[1]
    shared = Shared.make((1, tokens, hidden), torch.float32, device, x_grad=True)
    grad_out = torch.zeros(1, tokens, hidden, device=device)
    pool = backend.pool() if pool is None else pool
    layers = [RecomputedLayer(b, b.forward, shared, lambda: {"extra": extra}, grad_out, backend, pool, f"block {i}",
                              grads_into=grads[i] if grads is not None else None)
              for i, b in enumerate(blocks)]
    for layer in layers:
        layer.capture_forward()
    for layer in reversed(layers):
        layer.capture_recompute()
    return layers


def _stack(device: str, seed: int = 0, hidden: int = HIDDEN) -> list[Block]:
    torch.manual_seed(seed)
    return [Block(hidden).to(device) for _ in range(LAYERS)]


def check_buckets_sharing_one_pool_train_as_checkpointed_blocks(backend, device):
    """Two buckets' stacks in one pool, their rows alternating (the second bucket's captured after the first's), each
    block's parameter gradients in buffers both buckets' graphs share: outputs and gradients as checkpoint's, step
    after step."""
    blocks = _stack(device)
    pool = backend.pool()
    grads = [[torch.zeros_like(p) for p in trainable_parameters(b)] for b in blocks]
    extras = {n: torch.randn(1, n, 2 * HIDDEN, device=device) for n in (TOKENS, 2 * TOKENS)}
    stacks = {n: capture_stack(blocks, extra, backend, pool, grads) for n, extra in extras.items()}
    for step, tokens in enumerate((TOKENS, 2 * TOKENS - 3, TOKENS - 5, TOKENS + 1, 3)):
        bucket = TOKENS if tokens <= TOKENS else 2 * TOKENS
        extra, layers = extras[bucket], stacks[bucket]
        extra.copy_(torch.randn_like(extra))  # a per-call input written into its static buffer
        x = torch.randn(1, tokens, HIDDEN, device=device)
        weight = torch.randn(1, tokens, HIDDEN, device=device)
        pad = (0, 0, 0, bucket - tokens)
        # checkpoint over the padded row: the padding's gradient is zero, as in a bucket
        xe = torch.nn.functional.pad(x, pad).requires_grad_(True)
        h = xe
        for b in blocks:
            h = checkpoint(b, h, extra, use_reentrant=False)
        (h * torch.nn.functional.pad(weight, pad)).sum().backward()
        want = {"x": xe.grad[:, :tokens], **{f"{i}.{n}": p.grad.clone() for i, b in enumerate(blocks)
                                             for n, p in b.named_parameters()}}
        want_out = h.detach()[:, :tokens]
        for b in blocks:
            b.zero_grad(set_to_none=True)

        xr = x.clone().requires_grad_(True)
        h = xr
        for layer in layers:
            h = replay_checkpointed(layer, h)
        (h * weight).sum().backward()
        torch.testing.assert_close(h.detach(), want_out)
        torch.testing.assert_close(xr.grad, want["x"])
        for i, b in enumerate(blocks):
            for n, p in b.named_parameters():
                torch.testing.assert_close(p.grad, want[f"{i}.{n}"], msg=f"step {step}, block {i}, {n}")
        with torch.no_grad():  # an optimizer step, in place
            for b in blocks:
                for p in b.parameters():
                    p.add_(0.1 * torch.randn_like(p))
                    p.grad = None


def check_only_each_layers_input_is_saved(backend, device):
    """What backward keeps is each layer's input, through the saved-tensor hooks (the offload's pack hook sees it
    as under checkpoint), and nothing else."""
    blocks = _stack(device, seed=1)
    extra = torch.randn(1, TOKENS, 2 * HIDDEN, device=device)
    layers = capture_stack(blocks, extra, backend)
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    x = torch.randn(1, TOKENS - 2, HIDDEN, device=device, requires_grad=True)
    inputs, h = [], x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in layers:
            inputs.append(h)
            h = replay_checkpointed(layer, h)
    assert len(packed) == LAYERS and all(p is i for p, i in zip(packed, inputs))
    h.sum().backward()
    assert x.grad is not None and all(p.grad is not None for b in blocks for p in b.parameters())


CHECKS = [check_buckets_sharing_one_pool_train_as_checkpointed_blocks, check_only_each_layers_input_is_saved]


def test_buckets_sharing_one_pool_train_as_checkpointed_blocks_on_the_tape():
    check_buckets_sharing_one_pool_train_as_checkpointed_blocks(TapeBackend(), "cpu")


def test_only_each_layers_input_is_saved_on_the_tape():
    check_only_each_layers_input_is_saved(TapeBackend(), "cpu")
