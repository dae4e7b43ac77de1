"""The layer plan's planner (``layer_plan.spend``, ``describe``) and the budget's looks (``layer_budget.Budget``),
pure: hand-made costs and fake memory readings, no model.

``spend`` upgrades contiguous runs from the last layer, each paid by the difference between the new state's bytes
and the present state's: layers kept whole first, then (from where that stopped) kept with the MLP recomputed where
that saves bytes, then weights dequantized, then offloaded inputs back on the GPU; a later look goes on from the
plans the first made. The budget spends ``SHARE`` of what is left under the limit less ``MARGIN``.
"""

from __future__ import annotations

import pytest
import torch

from nbkit.speedups import layer_budget
from nbkit.speedups.layer_budget import MARGIN, SHARE, Budget
from nbkit.speedups.layer_plan import (
    CHECKPOINTED,
    KEPT,
    MLP_RECOMPUTED,
    OFFLOADED,
    Allowed,
    LayerCost,
    LayerPlan,
    describe,
    spend,
)

C, M, K, OFF = CHECKPOINTED, MLP_RECOMPUTED, KEPT, OFFLOADED
# a layer keeps 100 bytes whole, 40 with the MLP recomputed, 10 checkpointed (its input); 30 of weights dequantized
COST = LayerCost(kept=100, mlp_recomputed=40, input=10, weights=30)


def plans_of(*activations: str, dequantized: tuple[int, ...] = ()) -> list[LayerPlan]:
    return [LayerPlan(a, dequantized=i in dequantized) for i, a in enumerate(activations)]


def states(plans: list[LayerPlan]) -> list[str]:
    return [p.activations for p in plans]


def dequantized(plans: list[LayerPlan]) -> list[int]:
    return [i for i, p in enumerate(plans) if p.dequantized]


# ---------------------------------------------------------------------------------------------------------------
# spend


def test_layers_are_kept_whole_from_the_last_layer_each_paid_by_the_difference():
    costs = [COST] * 4
    for budget, kept in ((0, 0), (89, 0), (90, 1), (179, 1), (180, 2), (360, 4)):
        plans, spent = spend(plans_of(C, C, C, C), costs, budget, Allowed(split=False, dequantize=False))
        assert states(plans) == [C] * (4 - kept) + [K] * kept, budget
        assert spent == 90 * kept  # 100 kept less the 10 its input held already


def test_a_run_stops_at_the_first_layer_that_does_not_fit():
    """Contiguous from the last layer: a cheaper layer before one that does not fit is not taken."""
    costs = [LayerCost(20, 20, 10), LayerCost(20, 20, 10), LayerCost(500, 500, 10), LayerCost(20, 20, 10)]
    plans, spent = spend(plans_of(C, C, C, C), costs, 100, Allowed(dequantize=False))
    assert states(plans) == [C, C, C, K] and spent == 10


def test_then_the_mlp_recomputed_from_where_the_kept_run_stopped():
    costs = [COST] * 4
    plans, spent = spend(plans_of(C, C, C, C), costs, 90 + 30 + 30 + 29, Allowed(dequantize=False))
    assert states(plans) == [C, M, M, K] and spent == 90 + 2 * 30


def test_the_mlp_only_recompute_is_chosen_only_where_it_saves_bytes():
    """A tiled MLP keeps only its input: recomputing it saves nothing, so no layer is planned that way."""
    costs = [LayerCost(kept=100, mlp_recomputed=100, input=10)] * 4
    plans, _ = spend(plans_of(C, C, C, C), costs, 150, Allowed(dequantize=False))
    assert states(plans) == [C, C, C, K]
    plans, _ = spend(plans_of(C, C, C, C), [LayerCost(100, 120, 10)] * 4, 150, Allowed(dequantize=False))
    assert states(plans) == [C, C, C, K]


def test_weights_come_after_activations_from_the_last_layer():
    costs = [COST] * 4
    # every layer kept whole (360) and two layers' weights (60): the last two
    plans, spent = spend(plans_of(C, C, C, C), costs, 360 + 60 + 29)
    assert states(plans) == [K] * 4 and dequantized(plans) == [2, 3] and spent == 420
    # room for weights alone is spent on activations first
    plans, spent = spend(plans_of(C, C, C, C), costs, 120)
    assert states(plans) == [C, C, M, K] and dequantized(plans) == [] and spent == 120
    # a layer without 4-bit weights is passed over, not a stop
    mixed = [COST, COST, LayerCost(100, 40, 10, 0), COST]
    plans, _ = spend(plans_of(K, K, K, K), mixed, 60)
    assert dequantized(plans) == [1, 3]


def test_offloaded_inputs_come_back_last():
    """An offloaded layer keeps nothing on the GPU: keeping it whole costs all it keeps, and what is left after
    the activations and the weights brings offloaded inputs back, from the last layer."""
    costs = [LayerCost(100, 80, 10)] * 3 + [LayerCost(100, 80, 10, weights=5)]
    plans, spent = spend(plans_of(OFF, OFF, OFF, OFF), costs, 100 + 80 + 5 + 10 + 4, Allowed())
    assert states(plans) == [OFF, C, M, K] and dequantized(plans) == [3] and spent == 195
    plans, _ = spend(plans_of(OFF, OFF, OFF, OFF), costs, 25, Allowed(keep=False, dequantize=False))
    assert states(plans) == [OFF, OFF, C, C]


def test_what_the_switches_do_not_allow_is_never_chosen():
    costs = [COST] * 2
    plans, spent = spend(plans_of(C, C), costs, 10**6, Allowed(keep=False, dequantize=False))
    assert states(plans) == [C, C] and spent == 0
    plans, _ = spend(plans_of(C, C), costs, 10**6, Allowed(dequantize=False))
    assert states(plans) == [K, K] and dequantized(plans) == []
    plans, _ = spend(plans_of(OFF, OFF), costs, 10**6, Allowed(keep=False))
    assert states(plans) == [C, C] and dequantized(plans) == [0, 1]


def test_the_second_look_goes_on_from_the_first():
    """The first look keeps the last layer and recomputes the MLP of the one before; the second, with more, pays
    only the difference: that layer kept whole (60), the next whole (90), the next with the MLP recomputed (30)."""
    costs = [COST] * 4
    first, spent = spend(plans_of(C, C, C, C), costs, 130, Allowed(dequantize=False))
    assert states(first) == [C, C, M, K] and spent == 120
    second, spent = spend(first, costs, 60 + 90 + 30, Allowed(dequantize=False))
    assert states(second) == [M, K, K, K] and spent == 180
    third, spent = spend(second, costs, 0, Allowed(dequantize=False))
    assert third == second and spent == 0


def test_graphed_is_left_to_the_caller():
    plans = [LayerPlan(C), LayerPlan(K, graphed=True)]
    out, _ = spend(plans, [COST] * 2, 10**6, Allowed(dequantize=False))
    assert out == [LayerPlan(K), LayerPlan(K, graphed=True)]


def test_describe_says_the_plan_in_one_line():
    plans = [LayerPlan(OFF), LayerPlan(C), LayerPlan(M), LayerPlan(K), LayerPlan(K, graphed=True)]
    assert describe(plans, False) == "5 layers: 2 kept (1 graphed), 1 with the MLP recomputed, 1 checkpointed, 1 offloaded"
    assert describe([LayerPlan(C)] * 3, False) == "3 layers: 3 checkpointed"
    assert describe([LayerPlan(K)] * 2, True) == "2 layers: 2 kept; weights 4-bit"
    assert describe([LayerPlan(K, dequantized=True)] * 2, True) == "2 layers: 2 kept; weights dequantized"
    assert describe([LayerPlan(K), LayerPlan(C, dequantized=True)], True) == \
        "2 layers: 1 kept, 1 checkpointed; weights dequantized in 1, 4-bit in 1"
    assert "\n" not in describe(plans, True)


# ---------------------------------------------------------------------------------------------------------------
# the budget's looks

LIMIT = 1 << 30
CPU = torch.device("cpu")


def fake(values: list) -> Budget:
    """A budget whose readings are ``values``' entries in turn (the last one repeated)."""
    calls = iter(values)
    last = [values[-1]]

    def readings(device):
        last[0] = next(calls, last[0])
        return last[0]

    return Budget(CPU, readings)


def test_no_readings_no_look():
    budget = Budget(CPU, lambda device: None)
    assert not budget.measured
    assert budget.first_look() is None and budget.second_look(2.0) is None and budget.graphs_room(1) is None


def test_the_first_look_spends_a_share_of_what_step_1_left():
    budget = fake([(LIMIT, 0, 100), (LIMIT, 300 << 20, 100 + (50 << 20))])
    budget.start()
    look = budget.first_look()
    assert look.spend == int(SHARE * (LIMIT * (1 - MARGIN) - (300 << 20) - (50 << 20)))  # the peak, what grew
    assert "to spend" in look.why and "\n" not in look.why
    budget.start()  # once: the growth still counts from the first
    assert fake([(LIMIT, LIMIT, 0)]).first_look().spend == 0  # never negative


def test_the_run_s_peak_starts_at_its_first_step(monkeypatch):
    """A peak an earlier notebook cell left (here at the limit) is not the run's: ``start`` starts the device's peak
    over, once, and the first look spends from the run's own."""
    state = {"peak": LIMIT}
    restarted = []

    def restart(device):
        restarted.append(device)
        state["peak"] = 100

    monkeypatch.setattr(layer_budget, "restart_peak", restart)
    budget = Budget(CPU, lambda device: (LIMIT, state["peak"], 100))
    assert budget.first_look().spend == 0  # what the stale peak would leave
    budget.start()
    budget.start()
    assert restarted == [CPU]
    assert budget.first_look().spend == int(SHARE * (LIMIT * (1 - MARGIN) - 100))


def test_restarting_the_peak_off_cuda_does_nothing():
    from nbkit.memory import restart_peak

    restart_peak(CPU)
    restart_peak("cpu")


def test_the_second_look_scales_the_peak_above_what_is_held_and_counts_reserved(monkeypatch):
    held, peak = LIMIT // 4, LIMIT // 2
    budget = fake([(LIMIT, peak, held)])
    assert budget.second_look(1.0).spend == int(SHARE * (LIMIT * (1 - MARGIN) - peak))
    assert budget.second_look(0.5).spend == budget.second_look(1.0).spend  # never scaled down
    assert budget.second_look(1.5).spend == int(SHARE * (LIMIT * (1 - MARGIN) - held - 1.5 * (peak - held)))
    assert budget.second_look(4.0).spend == 0
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: int(LIMIT * 0.8))
    assert budget.second_look(1.0).spend == int(SHARE * (LIMIT * (1 - MARGIN) - LIMIT * 0.8))


def test_the_second_look_says_which_figure_its_peak_came_from(monkeypatch):
    """The plan's line names the three figures the second look takes the most of, so a log tells which one set the
    spend: the step's own peak scaled, the device's peak, or reserved memory."""
    gib = 1 << 30
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: 9 * gib)
    why = fake([(16 * gib, 8 * gib, 4 * gib)]).second_look(1.5).why
    assert "the 10.00 GiB the plan's peak comes to" in why  # 4 + 1.5 * (8 - 4)
    assert "own 8.00 GiB peak scaled x1.50 above the 4.00 GiB held (10.00 GiB)" in why
    assert "device's 8.00 GiB peak, 9.00 GiB reserved" in why


def test_graph_pools_keep_the_step_s_headroom(monkeypatch):
    budget = fake([(LIMIT, LIMIT // 2, LIMIT // 4)])
    assert budget.graphs_room(LIMIT // 8) is None
    assert "no memory for more graphs" in budget.graphs_room(LIMIT // 2 + 1)
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: LIMIT // 2)
    assert budget.graphs_room(LIMIT // 8) is None and budget.graphs_room(LIMIT // 4 + 1) is not None
    # a pool that stands in for the step's own allocations (recompute graphs) counts from what tensors hold: the
    # allocator's cached blocks are in its way only, and given back first
    assert budget.graphs_room(LIMIT // 4 + 1, stands_in=True) is None and budget.cache_in_the_way(LIMIT // 4 + 1)
    assert not budget.cache_in_the_way(LIMIT // 8)  # fits beside the cache
    assert budget.graphs_room(LIMIT // 2 + 1, stands_in=True) is not None  # the step's peak stays free all the same
    assert not budget.cache_in_the_way(LIMIT // 2 + 1)


def test_with_the_pools_known_the_allocators_cache_is_not_counted_twice(monkeypatch):
    """The step's peak above what tensors hold is served from the allocator's cached blocks, which reserved memory
    counts already. Given what the graph pools reserve, the budget holds what tensors hold plus the pools (never
    more than all reserved) and keeps the step's headroom free beyond that."""
    budget = fake([(LIMIT, LIMIT // 2, LIMIT // 4)])  # the step needs a quarter more at its peak
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: 3 * LIMIT // 4)  # a quarter cached, a quarter pools
    assert budget.graphs_room(LIMIT // 8) is not None  # all reserved counted: 1 - 3/4 - 1/8 < 1/4
    assert budget.graphs_room(LIMIT // 8, pools=LIMIT // 4) is None  # 1 - (1/4 + 1/4) - 1/8 >= 1/4
    assert budget.graphs_room(LIMIT // 4 + 1, pools=LIMIT // 4) is not None  # the headroom still stays free
    assert budget.graphs_room(LIMIT // 8, pools=LIMIT) is not None  # held: at most all reserved
    # a capture cannot take the cache's blocks (none are given back while it is under way): in its way, they go first
    assert budget.cache_in_the_way(LIMIT // 8, pools=LIMIT // 4)
    assert not budget.cache_in_the_way(LIMIT // 4 + 1, pools=LIMIT // 4)  # does not fit either way


def test_the_second_look_scales_the_step_s_own_peak_not_a_capture_s(monkeypatch):
    """The second look scales the plan's peak above what is held to the longest micro-batch. A peak a graph capture
    set is its pool's activations at the largest bucket, reserved for good: it counts as it is, unscaled, and only
    the step's own peak is scaled; once the step's own peak rises above the capture's, it is scaled again."""
    gib = 2**30
    state = {"peak": 4 * gib}
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: 11 * gib)  # 3 held by tensors, 8 by the pool
    budget = Budget(CPU, lambda device: (15 * gib, state["peak"], 3 * gib))
    room = 15 * gib * (1 - MARGIN)
    assert budget.second_look(1.5).spend == int(SHARE * (room - 11 * gib))  # reserved: more than 3 + 1.5 x 1
    with budget.capturing():
        state["peak"] = 11 * gib
    assert budget.second_look(1.5).spend == int(SHARE * (room - 11 * gib))  # not 3 + 1.5 x 8 = 15: nothing
    state["peak"] = 12 * gib  # the step's own, above the capture's
    assert budget.second_look(1.1).spend == int(SHARE * (room - 3 * gib - int(1.1 * 9 * gib)))


def test_a_peak_a_capture_set_is_its_pools_not_the_step_s(monkeypatch):
    """A graph capture allocates its pool's activations, and the device's peak rises with them; the pool stays
    reserved and counts there. The step's headroom is its own peak above what it holds: the peak read outside the
    captures, until the peak rises above the last capture's again."""
    gib = 2**30
    state = {"peak": 4 * gib}
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: 11 * gib)  # 3 held by tensors, 8 by the pool
    budget = Budget(CPU, lambda device: (15 * gib, state["peak"], 3 * gib))
    assert budget.step_peak(state["peak"]) == 4 * gib
    with budget.capturing():
        state["peak"] = 11 * gib  # the pool's activations, all alive at once during the capture
    assert budget.step_peak(11 * gib) == 4 * gib
    # a smaller bucket into the same pool takes nothing beside it: 15 - 11 - 0 >= max(1.5, 4 - 3)
    assert budget.graphs_room(0, pools=8 * gib) is None
    assert "1.5 GiB stay free" in budget.graphs_room(3 * gib, pools=8 * gib)  # 15 - 11 - 3 < 1.5
    state["peak"] = 12 * gib  # the step itself rose above the capture's peak: 12 - 3 stays free
    assert budget.step_peak(12 * gib) == 12 * gib
    assert "9.0 GiB stay free" in budget.graphs_room(0, pools=8 * gib)
    with budget.capturing():  # the rise outside the captures is remembered past the next one
        state["peak"] = 13 * gib
    assert budget.step_peak(13 * gib) == 12 * gib
    no_readings = Budget(CPU, lambda device: None)
    with no_readings.capturing():
        pass
    assert no_readings.step_peak(5) == 5


def test_off_cuda_nothing_is_crowded():
    assert fake([(LIMIT, 0, 0)]).crowded(LIMIT * 10) is False


@pytest.mark.parametrize("share", [SHARE])
def test_the_share_keeps_a_quarter_back(share):
    assert share == 0.75 and 0 < MARGIN < 1 - share
