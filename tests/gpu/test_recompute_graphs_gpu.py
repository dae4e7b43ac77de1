"""``nbkit.ops.recompute_graphs`` on real CUDA graphs: the CPU checks (tests/test_recompute_graphs.py) with the same
assertions, and what the point of one pool is: capturing a stack of checkpointed layers reserves about one layer's
activations (and each layer's parameter gradients), where kept layers' graphs reserve one per layer. fp32, TF32 off
(torch's default): eager and replay to torch's default fp32 tolerances."""

from __future__ import annotations

import pytest
import torch

from tests.test_recompute_graphs import CHECKS, Block, capture_stack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def capture_kept(blocks: list, extra: torch.Tensor, backend) -> list:
    """The blocks' kept graphs at ``extra``'s tokens in one new pool, in the order they replay in (every forward,
    then every backward in reverse), as ``cuda_graphs`` captures a bucket."""
    from nbkit.ops.layer_graphs import GraphedLayer

    hidden, tokens = blocks[0].up.in_features, extra.shape[1]
    grad_out = torch.zeros(1, tokens, hidden, device=extra.device)
    pool = backend.pool()
    layers = [GraphedLayer(b, b.forward, grad_out, True, lambda: {"extra": extra}, grad_out, backend, pool)
              for b in blocks]
    for layer in layers:
        layer.capture_forward()
    for layer in reversed(layers):
        layer.capture_backward()
    return layers


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__[6:])
def test_on_cuda_graphs(check):
    from nbkit.ops.layer_graphs import CudaGraphBackend

    check(CudaGraphBackend(), "cuda")


def test_the_pool_holds_about_one_layers_activations():
    from nbkit.ops.layer_graphs import CudaGraphBackend

    hidden, tokens, count = 1024, 4096, 8
    backend = CudaGraphBackend()
    torch.manual_seed(0)
    extra = torch.randn(1, tokens, 2 * hidden, device="cuda")

    def reserved_by(capture) -> int:
        blocks = [Block(hidden).cuda() for _ in range(count)]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what earlier tests left cached would be given back below, as if freed here
        before = torch.cuda.memory_reserved()
        graphs = capture(blocks)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' cached blocks: what is left is the pools and the live buffers
        grown = torch.cuda.memory_reserved() - before
        del graphs, blocks
        torch.cuda.empty_cache()
        return grown

    kept_bytes = reserved_by(lambda blocks: capture_kept(blocks, extra, backend))
    recomputed_bytes = reserved_by(lambda blocks: capture_stack(blocks, extra, backend))
    activations = 3 * tokens * 2 * hidden * 4  # a block keeps up(x), silu(.), and their product's input: ~3 of 2H
    print(f"reserved: kept {kept_bytes / 2**20:.0f} MiB, recomputed {recomputed_bytes / 2**20:.0f} MiB, "
          f"one block's activations ~{activations / 2**20:.0f} MiB, {count} blocks")
    assert kept_bytes > (count - 1) * activations
    assert recomputed_bytes < kept_bytes / 2


def test_the_peak_a_capture_sets_is_its_pools_not_the_steps():
    """What ``Budget.capturing`` rests on: a capture's allocations in its pool count in the device's peak (by about
    the stack's activations, all alive at once), and the pool stays reserved. The budget's step peak leaves them out,
    until the step's own allocations rise above the capture's peak."""
    from nbkit.ops.layer_graphs import CudaGraphBackend
    from nbkit.speedups.layer_budget import Budget

    hidden, tokens, count = 1024, 4096, 8
    backend = CudaGraphBackend()
    torch.manual_seed(0)
    extra = torch.randn(1, tokens, 2 * hidden, device="cuda")
    blocks = [Block(hidden).cuda() for _ in range(count)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    budget = Budget(torch.device("cuda", torch.cuda.current_device()))
    before = torch.cuda.max_memory_allocated()
    with budget.capturing():
        layers = capture_kept(blocks, extra, backend)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    activations = 3 * tokens * 2 * hidden * 4  # a block keeps ~3 tensors of 2H a token
    print(f"peak {before / 2**20:.0f} -> {peak / 2**20:.0f} MiB in the capture; one block's activations "
          f"~{activations / 2**20:.0f} MiB, {count} blocks")
    assert peak - before > (count - 1) * activations
    assert budget.step_peak(peak) == before
    rise = torch.empty(peak - torch.cuda.memory_allocated() + (64 << 20), dtype=torch.uint8, device="cuda")
    above = torch.cuda.max_memory_allocated()
    assert above > peak and budget.step_peak(above) == above
    del rise, layers
