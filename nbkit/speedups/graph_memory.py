"""What the CUDA graphs of decoder layers hold of the GPU's memory, and whether more of them fit now.

Why apart from the graphs: a graph's pool keeps its memory for good, so every capture asks first, and the answer
comes from three things only: what one layer's graphs were measured to keep, what the run's kept pool already
holds (a smaller bucket fits in the blocks a larger one frees), and the run's budget (``layer_budget.Budget``). The
graphs (``cuda_graphs``) decide what to capture; this says what it costs.

Contract: ``measured`` is told what each capture kept (CUDA only: the CPU tape allocates nothing, and tests set
``layer_bytes`` themselves); before the first measurement nothing is sized and nothing refused. ``problem`` returns
None when the graphs asked for fit, else why not in words. State belongs to one run: ``cuda_graphs`` makes a new one
when it attaches to a runner.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .layer_plan import UNSIZED


class GraphMemory:
    """The graphs' memory in one run: ``runner`` is the layer runner whose budget decides (None: nothing refused).

    ``layer_bytes`` at ``layer_bucket`` tokens: what one kept layer's graphs keep, the largest per token measured.
    ``kept_activations``: what the kept pool's captures hold, the most of one capture; ``kept_tokens``: the largest
    bucket captured into it. ``pools_reserved``: what every pool reserves (read after each capture, CUDA).
    ``recompute_tokens``: the largest bucket captured in the recompute pool."""

    def __init__(self, runner: Any = None) -> None:
        self.runner = runner
        self.layer_bytes: Optional[int] = None
        self.layer_bucket = 1
        self.kept_activations = 0
        self.kept_tokens = 0
        self.pools_reserved = 0
        self.recompute_tokens = 0

    @property
    def budget(self) -> Any:
        """The run's budget (``layer_budget.Budget``), or None: nothing is refused."""
        return self.runner.budget if self.runner is not None else None

    def measured(self, kept: int, bucket: int) -> None:
        """What one layer's graphs keep at ``bucket`` tokens: the largest per token seen sizes later captures."""
        if self.layer_bytes is None or kept / bucket > self.layer_bytes / self.layer_bucket:
            self.layer_bytes, self.layer_bucket = kept, bucket

    def layer_cost(self, bucket: int) -> Optional[int]:
        """One kept layer's graphs at ``bucket`` tokens, as measured (the largest per token seen); None before."""
        return None if self.layer_bytes is None else self.layer_bytes * bucket // self.layer_bucket

    def pooled(self, layers: int, bucket: int) -> None:
        """A capture put ``layers`` kept layers' graphs at ``bucket`` tokens into the run's kept pool."""
        self.kept_activations = max(self.kept_activations, layers * (self.layer_cost(bucket) or 0))
        self.kept_tokens = max(self.kept_tokens, bucket)

    def need(self, bucket: int, layers: int = 1, taken: Optional[int] = None) -> Optional[int]:
        """What ``layers`` more layers' kept graphs at ``bucket`` tokens take of their pool: all of it in a pool of
        their own, or in the kept pool at a bucket larger than any captured there (the allocator cannot put a larger
        tensor in smaller freed blocks); in the kept pool at a bucket it has held (after ``taken`` layers of their
        capture), only what exceeds what the pool's earlier captures freed (their activations: their outputs and
        input gradients are copied into buffers outside it, ``cuda_graphs``' shared buffers)."""
        one = self.layer_cost(bucket)
        if one is None or taken is None or bucket > self.kept_tokens:
            return None if one is None else layers * one
        beyond = lambda n: max(0, n * one - self.kept_activations)  # noqa: E731
        return beyond(taken + layers) - beyond(taken)

    def recompute_need(self, tokens: int) -> Optional[int]:
        """One layer's activations at ``tokens``: the plan's measured cost of keeping a layer (at its longest
        micro-batch), else what the graphs measured."""
        runner = self.runner
        sized = [c.kept for c in getattr(runner, "costs", ()) if c.kept < UNSIZED]
        if sized and getattr(runner, "max_tokens", 0):
            return max(0, max(sized) * tokens // runner.max_tokens)
        return self.need(tokens)

    def problem(self, device: torch.device, bucket: int, layers: int = 1, stands_in: bool = False,
                taken: Optional[int] = None, grads: int = 0) -> Optional[str]:
        """Why ``layers`` more layers' graphs at ``bucket`` tokens do not fit now, or None (the run's budget decides:
        ``Budget.graphs_room``; ``stands_in``: recompute graphs, one layer's activations at ``bucket`` tokens;
        ``taken``: kept graphs in the run's kept pool, after ``taken`` layers of the same capture; ``grads``: the
        parameter-gradient buffers they make). Nothing to size by before the first layer's graphs were measured, or
        the plan measured its layers."""
        if self.budget is None:
            return None
        need = self.recompute_need(bucket) if stands_in else self.need(bucket, layers, taken)
        need = None if need is None else need + (0 if stands_in else grads)
        pools = None if stands_in else self.pools_reserved
        return None if need is None else self.budget.graphs_room(need, stands_in=stands_in, pools=pools)

    def give_back_cache(self, device: torch.device, need: Optional[int], stands_in: bool = False) -> None:
        """Before graphs of ``need`` bytes that fit only without the allocator's cached blocks: give those back.
        Recompute graphs (``stands_in``): their pool stands in for what the eager recompute took from them. Kept
        graphs beside the pools (``pools_reserved``): the budget let them count on the cache, which their capture
        cannot take from (``Budget.cache_in_the_way``)."""
        pools = None if stands_in else self.pools_reserved
        if device.type == "cuda" and self.budget is not None and need is not None and \
                self.budget.cache_in_the_way(need, pools=pools):
            torch.cuda.empty_cache()
