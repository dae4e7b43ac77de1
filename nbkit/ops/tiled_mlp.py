"""A token-wise MLP run over tiles of the sequence, recomputed per tile in backward, so that its widest activations
(tokens x intermediate) exist for one tile at a time.

Why: a gated MLP ``down(act(gate(x)) * up(x))`` keeps three (tokens x intermediate) tensors for its backward. At
Llama-3.1-8B's shape (intermediate 14336) and 128K tokens that is over 10 GiB in bf16 for one layer, even under
gradient checkpointing, where the layer being recomputed holds them. Here forward runs ``mlp_forward`` tile by tile
without a graph and saves only ``x``; backward recomputes each tile with grad enabled, differentiates it against
its slice of the incoming gradient, and sums the parameters' gradients over tiles (in fp32 for bf16/fp16
parameters, cast back once).

Contract:

* ``mlp_forward`` is pointwise over tokens: output row ``t`` depends on input row ``t`` only (any module's forward,
  LoRA-wrapped layers included). Tiles are slices of dim -2, so ``x`` is (..., T, H): (B, T, H) tiles over T,
  (N, H) over N. A forward that mixes tokens gives wrong results, silently.
* ``params`` are the tensors ``mlp_forward`` reads whose gradients are wanted (the trainable ones suffice); their
  gradients are returned through autograd (they accumulate into ``.grad`` as any op's do), and a parameter left out
  gets none. Gradients for ``x`` are computed when ``x`` requires them.
* Randomness (dropout): with ``preserve_rng_state`` (the default) the CPU RNG and that of ``x``'s device are saved
  before each tile and restored for its recompute, as ``torch.utils.checkpoint`` does, so recompute draws the same
  masks as forward (not the masks one untiled call would draw). Autocast is recorded in forward and restored for
  the recompute. Works inside non-reentrant checkpointing (the checkpoint recomputes the tiled forward once more).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch


def tile_bounds(tokens: int, tiles: Optional[int] = None, tile_tokens: Optional[int] = None,
                hidden: int = 1) -> list[tuple[int, int]]:
    """(start, end) of each tile: ``tiles`` near-equal tiles, or tiles of ``tile_tokens`` (the last one shorter);
    neither given: tiles of ``hidden`` tokens, so a tile's (tokens x intermediate) activation is one weight's size."""
    if tiles is not None and tile_tokens is not None:
        raise ValueError("tiled_mlp: give tiles or tile_tokens, not both")
    if tiles is not None:
        if tiles < 1:
            raise ValueError(f"tiled_mlp: tiles must be at least 1, not {tiles}")
        tiles = min(tiles, max(tokens, 1))
        edges = [tokens * i // tiles for i in range(tiles + 1)]
        return list(zip(edges[:-1], edges[1:]))
    size = hidden if tile_tokens is None else tile_tokens
    if size < 1:
        raise ValueError(f"tiled_mlp: tile_tokens must be at least 1, not {size}")
    return [(s, min(s + size, tokens)) for s in range(0, tokens, size)] or [(0, 0)]


def _device_module(device: torch.device):
    """``torch.cuda`` and the like, for the device's RNG; None for the CPU or a device without one."""
    module = None if device.type == "cpu" else getattr(torch, device.type, None)
    return module if hasattr(module, "get_rng_state") else None


def _rng_state(device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    module = _device_module(device)
    return torch.get_rng_state(), None if module is None else module.get_rng_state(device)


@contextlib.contextmanager
def _restored_rng(state: tuple[torch.Tensor, Optional[torch.Tensor]], device: torch.device):
    """Runs the body from ``state`` and leaves the RNG as it found it (the recompute must not shift later draws)."""
    module = _device_module(device)
    before = _rng_state(device)
    torch.set_rng_state(state[0])
    if module is not None:
        module.set_rng_state(state[1], device)
    try:
        yield
    finally:
        torch.set_rng_state(before[0])
        if module is not None:
            module.set_rng_state(before[1], device)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mlp_forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                bounds: list[tuple[int, int]], preserve_rng_state: bool, *params: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.rng = []
        out = None
        with torch.no_grad():
            for start, end in bounds:
                if preserve_rng_state:
                    ctx.rng.append(_rng_state(x.device))
                y = mlp_forward(x.narrow(-2, start, end - start))
                if out is None:
                    out = y.new_empty(*x.shape[:-2], x.shape[-2], y.shape[-1])
                out.narrow(-2, start, end - start).copy_(y)
                del y
        ctx.save_for_backward(x)
        ctx.mlp_forward, ctx.bounds, ctx.params = mlp_forward, bounds, params  # params: inputs, never outputs
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[1]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        params = [ctx.params[i] for i in wanted]
        grad_x = torch.zeros_like(x) if need_x else None
        sums: list[Optional[torch.Tensor]] = [None] * len(params)
        enabled, dtype = ctx.autocast
        for k, (start, end) in enumerate(ctx.bounds):
            x_tile = x.narrow(-2, start, end - start).detach().requires_grad_(need_x)
            rng = _restored_rng(ctx.rng[k], x.device) if ctx.rng else contextlib.nullcontext()
            with rng, torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
                y = ctx.mlp_forward(x_tile)
            if not y.requires_grad:  # nothing wanted depends on this tile
                continue
            inputs = ([x_tile] if need_x else []) + params
            grads = torch.autograd.grad(y, inputs, grad_out.narrow(-2, start, end - start), allow_unused=True)
            del y
            if need_x:
                if grads[0] is not None:
                    grad_x.narrow(-2, start, end - start).copy_(grads[0])
                grads = grads[1:]
            for i, g in enumerate(grads):
                if g is None:
                    continue
                if sums[i] is None:
                    sums[i] = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
                else:
                    sums[i] += g
        grad_params: list[Optional[torch.Tensor]] = [None] * len(ctx.needs_input_grad[4:])
        for i, total in zip(wanted, sums):
            grad_params[i] = None if total is None else total.to(ctx.params[i].dtype)
        return (None, grad_x, None, None, *grad_params)


def tiled_mlp(mlp_forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
              tiles: Optional[int] = None, tile_tokens: Optional[int] = None,
              preserve_rng_state: bool = True) -> torch.Tensor:
    """``mlp_forward(x)`` computed over tiles of dim -2 (``tiles`` of them, or ``tile_tokens`` long; default: tiles
    of ``x.shape[-1]`` tokens), recomputed tile by tile in backward; ``params`` get their gradients summed over tiles."""
    bounds = tile_bounds(x.shape[-2], tiles, tile_tokens, hidden=x.shape[-1])
    return _TiledMLP.apply(mlp_forward, x, bounds, preserve_rng_state, *params)
