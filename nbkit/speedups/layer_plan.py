"""The plan of each decoder layer, and the one planner that decides it from a byte budget. Pure: no torch, no I/O.

Why: what a decoder layer does with its activations and its frozen weights is one decision per layer, spent from
one memory budget. Keeping a layer's activations saves its whole forward recompute; keeping only the attention's
(the MLP recomputed) saves most of it for less memory; a dequantized weight saves its dequantization twice a step;
a checkpointed input kept on the GPU instead of in host memory saves two copies over the bus. The planner spends a
budget on them in that order of worth.

``LayerPlan``: per layer,
- ``activations``: ``KEPT`` (nothing recomputed), ``MLP_RECOMPUTED`` (attention's activations kept, the MLP's
  recomputed in backward), ``CHECKPOINTED`` (only the layer's input kept, the layer recomputed), ``OFFLOADED``
  (checkpointed, its input in host memory);
- ``graphed``: a kept layer replays its forward and backward as CUDA graphs; a checkpointed one (offloaded or not)
  its forward, its recompute and its backward;
- ``dequantized``: its frozen 4-bit weights kept dequantized for the run.

``LayerCost``: bytes of one layer at the longest micro-batch, measured at step 1: what it keeps in each state, and
its 4-bit weights dequantized.

``spend(plans, costs, budget, allowed)``: upgrades, each paid by the difference between the new state's bytes and
the present state's, in this order, each a contiguous run from the last layer (backward frees the last layers
first, and every layer's activations are the same size):
1. layers kept whole, from the last layer back, while they fit;
2. then, from where that stopped, layers with the MLP recomputed;
3. then weights dequantized, from the last layer back;
4. then offloaded layers' inputs back on the GPU.
A look later (the second) calls it again with the plans it made and what is left: it goes on where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

KEPT = "kept"
MLP_RECOMPUTED = "MLP recomputed"
CHECKPOINTED = "checkpointed"
OFFLOADED = "offloaded"
UNSIZED = 1 << 62  # the cost of keeping a layer nothing measured: more than any budget


@dataclass(frozen=True)
class LayerPlan:
    activations: str = CHECKPOINTED
    graphed: bool = False
    dequantized: bool = False


@dataclass(frozen=True)
class LayerCost:
    """Bytes at the longest micro-batch: kept whole, with the MLP recomputed, checkpointed (its input); and its
    4-bit weights dequantized (0: none)."""

    kept: int
    mlp_recomputed: int
    input: int
    weights: int = 0

    def of(self, activations: str) -> int:
        return {KEPT: self.kept, MLP_RECOMPUTED: self.mlp_recomputed, CHECKPOINTED: self.input,
                OFFLOADED: 0}[activations]


@dataclass(frozen=True)
class Allowed:
    """What the user's switches allow: keep (``selective_checkpointing``), split (the MLP recomputed alone),
    dequantize (``dequant_cache``), onload (an offloaded input back on the GPU)."""

    keep: bool = True
    split: bool = True
    dequantize: bool = True
    onload: bool = True


def spend(plans: Sequence[LayerPlan], costs: Sequence[LayerCost], budget: int,
          allowed: Allowed = Allowed()) -> tuple[list[LayerPlan], int]:
    """The plans after spending at most ``budget`` bytes on upgrades (see the module docstring); and the bytes
    spent. ``graphed`` is left as it is (the caller sets it from what can be graphed)."""
    plans = list(plans)
    left = budget

    def upgrade(i: int, new: LayerPlan, cost: int) -> bool:
        nonlocal left
        if cost > left:
            return False
        plans[i], left = new, left - max(0, cost)
        return True

    def activations_run(target: str, ok: bool) -> None:
        if not ok:
            return
        for i in reversed(range(len(plans))):
            now = plans[i].activations
            if now == KEPT or (target == MLP_RECOMPUTED and now == MLP_RECOMPUTED):
                continue
            if target == MLP_RECOMPUTED and costs[i].mlp_recomputed >= costs[i].kept:
                return  # recomputing the MLP would save nothing (a tiled MLP keeps only its input)
            cost = costs[i].of(target) - costs[i].of(now)
            if not upgrade(i, replace(plans[i], activations=target), cost):
                return

    activations_run(KEPT, allowed.keep)
    activations_run(MLP_RECOMPUTED, allowed.keep and allowed.split)
    if allowed.dequantize:
        for i in reversed(range(len(plans))):
            if plans[i].dequantized or not costs[i].weights:
                continue
            if not upgrade(i, replace(plans[i], dequantized=True), costs[i].weights):
                break
    if allowed.onload:
        for i in reversed(range(len(plans))):
            if plans[i].activations != OFFLOADED:
                continue
            if not upgrade(i, replace(plans[i], activations=CHECKPOINTED), costs[i].input):
                break
    return plans, budget - left


def describe(plans: Sequence[LayerPlan], weights_4bit: bool) -> str:
    """The plan in one line: ``"28 layers: 20 kept (8 graphed), 6 checkpointed (6 graphed), 2 offloaded; weights
    4-bit"``."""
    count = {a: sum(p.activations == a for p in plans) for a in (KEPT, MLP_RECOMPUTED, CHECKPOINTED, OFFLOADED)}
    graphed = sum(p.graphed and p.activations == KEPT for p in plans)
    graphed_as = {a: sum(p.graphed and p.activations == a for p in plans) for a in (CHECKPOINTED, OFFLOADED)}
    parts = []
    if count[KEPT]:
        parts.append(f"{count[KEPT]} kept" + (f" ({graphed} graphed)" if graphed else ""))
    if count[MLP_RECOMPUTED]:
        parts.append(f"{count[MLP_RECOMPUTED]} with the MLP recomputed")
    parts += [f"{count[a]} {a}" + (f" ({graphed_as[a]} graphed)" if graphed_as[a] else "")
              for a in (CHECKPOINTED, OFFLOADED) if count[a]]
    line = f"{len(plans)} layers: {', '.join(parts)}"
    if weights_4bit:
        dequantized = sum(p.dequantized for p in plans)
        line += ("; weights 4-bit" if not dequantized else "; weights dequantized" if dequantized == len(plans)
                 else f"; weights dequantized in {dequantized}, 4-bit in {len(plans) - dequantized}")
    return line
