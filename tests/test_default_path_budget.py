"""FastSFT's default path under the memory budget of a smaller GPU, on a CPU: decoder layers kept and graphed, kept
with the MLP recomputed, checkpointed with their inputs offloaded, micro-batches of varying length; trained as plain
TRL trains.

Why: on a CPU nothing reads memory, so in the other CPU tests the layer plan keeps every layer and the paths a T4 or
an L4 takes never run together: layers still checkpointed after step 1 (their inputs in the offload's host pool,
whose idle slots then differ in size as rows vary) beside layers kept whole, kept with the MLP recomputed, and
graphed. Here they are forced, each mode as its default builds it on a GPU unless said:

- ``selective_checkpointing=True`` with the budget's two looks replaced (``Budget.first_look`` / ``second_look``),
  each with what the checkpointed layers' graphs will hold on top (the plan holds that back): the first holds the
  last layer kept whole and the one before it with the MLP recomputed; the second, after the
  first optimizer step, that layer kept whole and the one before it with the MLP recomputed; layer 0 stays
  checkpointed and offloaded throughout (the room left is half its input).
- ``offload_checkpointing=True``: 'auto' engages on CUDA only; on a CPU the same pack / unpack / prefetch code runs
  with host buffers. Step 1 packs all four layers, then two, then one: idle host slots of several sizes.
- ``cuda_graphs``: built as on a GPU ('auto') but on ``layer_graphs.TapeBackend`` (Python frozen at capture, as on a
  GPU), through ``LAYER_MODES``.
- ``cuda_graphs_checkpointed``: its default (True) replays the checkpointed layers as graphs too: the default path
  is ``test_checkpointed_layers_replay_as_graphs_and_train_as_plain_trl[True]``; the first test sets it False, so
  that the checkpointed layers' eager path (their activations recomputed by torch's checkpoint) is covered as well.
- ``tiled_mlp=True`` with tiles of 256 tokens: what 'auto' does where the MLP would crowd the card (step 1's rows
  are shorter than a tile: its MLPs run whole and are measured).
- ``cached_packing`` (its padding-free rows, the 'sdpa' kernel on a CPU), ``fused_lora``, ``sync_free_metrics``: their
  defaults. Not here: ``dequant_cache`` (a 4-bit base: tests/test_dequant_cache.py), ``fused_kernels`` (Liger needs a
  GPU), ``expandable_segments`` (CUDA's allocator).

Rows: ``packing=False`` (the default: each micro-batch is its two rows packed padding-free into one), pre-tokenized
rows whose micro-batches vary from 60 to 470 tokens, read in order: graph buckets 256, 384 and 512 in turn, and host
slots regrown and reused between steps. (``packing=True`` fills its rows almost to ``max_length``: its micro-batches
vary far less.) Before the host pool took its idle slots by identity, this run raised in a later micro-batch
(``list.remove`` comparing host slots of two sizes by value).

Compared with TRL's ``SFTTrainer`` on the same model, LoRA adapters (B drawn, so that every LoRA gradient counts),
rows and order, gradient checkpointing on, 4 SGD steps of 2 micro-batches. Tolerances (fp32): losses 2e-6 relative,
every gradient of every optimizer step within 2e-5 of its tensor's largest entry. Both paths compute in fp32; what
differs is the order of sums: the graphs' buckets pad the GEMMs' row counts, the tiles split the MLP's, padding-free
rows against TRL's padded batch. Offloading itself restores the same bytes (bitwise: tests/test_offload.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from parity import Tol, add_lora, assert_same_run, fast_sft, tiny_lm, train

from nbkit.ops.layer_graphs import GraphedLayer, TapeBackend
from nbkit.ops.offload_lanes import _HostPool
from nbkit.ops.recompute_graphs import RecomputedLayer
from nbkit.speedups import LAYER_MODES, SPEEDUPS, SpeedupSpec
from nbkit.speedups.cuda_graphs import CudaGraphs
from nbkit.speedups.layer_budget import Budget, Look
from nbkit.speedups.layer_plan import CHECKPOINTED, KEPT, MLP_RECOMPUTED, OFFLOADED

LAYERS = 4  # tiny_model's
BATCH, ACCUMULATION, STEPS = 2, 2, 4
MAX_LENGTH = 256
# tokens of each row, read in order, two to a micro-batch: micro-batches of 150, 470, 60, 300, 200, 450, 340, 130
ROWS = [90, 60, 230, 240, 20, 40, 180, 120, 110, 90, 250, 200, 200, 140, 70, 60]
TOLERANCE = dict(losses=Tol(rtol=2e-6), grads=Tol(scaled=2e-5))
LIMIT = 1 << 30


def rows(vocab: int):
    """``ROWS`` of random token ids (every token trained: no completion mask)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in ROWS]
    return Dataset.from_dict({"input_ids": ids})


def _looks(monkeypatch, seen: dict[str, Any]) -> None:
    """The budget's two looks, sized from the runner's measured costs (see the module docstring)."""

    def held_back() -> int:  # what the checkpointed layers' graphs will hold: the plan leaves it free
        runner = seen["runner"]
        reserve = runner.graphs.recompute_reserve(runner)
        seen.setdefault("reserves", []).append(reserve)
        return reserve

    def first(budget: Budget) -> Look:
        c = seen["runner"].costs
        seen["looks"].append("first")
        return Look(c[3].kept + c[2].mlp_recomputed + c[1].input // 2 + held_back(), "test")

    def second(budget: Budget, scale: float) -> Look:
        c = seen["runner"].costs
        seen["looks"].append("second")
        return Look(c[2].kept - c[2].mlp_recomputed + c[1].mlp_recomputed + c[0].input // 2 + held_back(), "test")

    monkeypatch.setattr(Budget, "first_look", first)
    monkeypatch.setattr(Budget, "second_look", second)


def _recorded(spec: SpeedupSpec, seen: dict[str, Any]) -> SpeedupSpec:
    """The layer runner's row, the runner kept in ``seen`` and read before it detaches."""

    def build(args, packed, dataset=None, allows=None):
        runner = spec.build(args, packed, dataset, allows)
        if runner is not None and spec.name == "decoder_layers":
            seen["runner"], detach = runner, runner.detach

            def read_then_detach() -> None:
                if runner.layers:
                    seen["plans"] = [p.activations for p in runner.plans]
                    seen["kept"], seen["added"], seen["line"] = runner.kept, runner.added, runner.line
                    graphs = runner.graphs
                    seen["buckets"] = sorted({v.bucket for (_, v), e in graphs._graphs.items()
                                              if isinstance(e, GraphedLayer)})
                    seen["recomputed"] = sorted({(i, v.bucket) for (i, v), e in graphs._graphs.items()
                                                 if isinstance(e, RecomputedLayer)})
                detach()

            runner.detach = read_then_detach
        return runner

    return SpeedupSpec(spec.name, spec.stage, build, spec.switched)


def _run(tmp_path, monkeypatch, fast: bool, pool_calls: list, offload: bool = True,
         **switches: Any) -> tuple[Any, dict[str, Any]]:
    """One run: FastSFT with the forced default path (``fast``; ``offload``: offload_checkpointing=True, else off;
    ``switches``: more of FastSFT's), else TRL's SFTTrainer; the run and what the layer runner did (read before the
    trainer detaches it)."""
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tokenizer = load_demo_tokenizer()
    model = add_lora(tiny_lm("qwen3", tokenizer=tokenizer, seed=0), random_b=0.02)
    settings: dict[str, Any] = dict(
        max_steps=STEPS, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION, packing=False,
        max_length=MAX_LENGTH, learning_rate=1e-2, optim="sgd", shuffle_dataset=False,
        train_sampling_strategy="sequential", gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False})
    seen: dict[str, Any] = {"looks": []}
    if not fast:
        from trl import SFTTrainer

        trainer = fast_sft(tmp_path / "plain", model=model, lora=None, tokenizer=tokenizer,
                           dataset=rows(len(tokenizer)), trainer_cls=SFTTrainer, **settings)
        return train(trainer, grads=True), seen

    def graphs(args, packed, dataset=None):
        checkpointed = bool(getattr(args, "cuda_graphs_checkpointed", False))
        return CudaGraphs(mode="auto", backend=TapeBackend(), checkpointed=checkpointed) if packed else None

    monkeypatch.setattr("nbkit.speedups.LAYER_MODES", tuple(
        (name, role, graphs if name == "cuda_graphs" else make) for name, role, make in LAYER_MODES))
    monkeypatch.setattr("nbkit.speedups.SPEEDUPS", tuple(_recorded(spec, seen) for spec in SPEEDUPS))
    _looks(monkeypatch, seen)
    acquire = _HostPool.acquire

    def spied(pool: _HostPool, nbytes: int):
        before = list(pool.free)
        slot = acquire(pool, nbytes)
        taken = [i for i, s in enumerate(before) if not any(s is t for t in pool.free)]
        pool_calls.append((nbytes, [s.numel() for s in before], taken))
        return slot

    monkeypatch.setattr(_HostPool, "acquire", spied)
    trainer = fast_sft(tmp_path / "fast", model=model, lora=None, tokenizer=tokenizer, dataset=rows(len(tokenizer)),
                       selective_checkpointing=True, offload_checkpointing=offload, tiled_mlp=True, tiled_mlp_tokens=256,
                       **switches, **settings)
    return train(trainer, grads=True), seen


def test_the_path_under_a_budget_with_eager_checkpointed_layers_trains_as_plain_trl(tmp_path, one_thread, monkeypatch,
                                                                                     caplog):
    """The default path but for ``cuda_graphs_checkpointed=False``: the checkpointed layers run eagerly."""
    pool_calls: list = []
    plain, _ = _run(tmp_path, monkeypatch, False, pool_calls)
    with caplog.at_level(logging.INFO, logger="nbkit"):
        fast, seen = _run(tmp_path, monkeypatch, True, pool_calls, cuda_graphs_checkpointed=False)
    assert_same_run(fast, plain, **TOLERANCE)
    assert len(fast.grads) == STEPS and all(any("lora_B" in n for n in step) for step in plain.grads)

    # the plan: the last layer kept at the first look, the one before it with the MLP recomputed; the second look
    # keeps that one whole and recomputes the MLP of the one before; layer 0 checkpointed and offloaded throughout
    assert seen["looks"] == ["first", "second"]
    assert seen["plans"] == [OFFLOADED, MLP_RECOMPUTED, KEPT, KEPT] and seen["kept"] == 3 and seen["added"] == 1
    assert seen["line"] == f"{LAYERS} layers: 2 kept (2 graphed), 1 with the MLP recomputed, 1 offloaded"
    assert f"{LAYERS} layers: 1 kept (1 graphed), 1 with the MLP recomputed, 2 offloaded" in caplog.text
    assert fast.trainer.nbkit_layer_stats["plan"] == seen["line"]
    attached = fast.trainer.nbkit_attached
    assert any(name.startswith("cached_packing") for name in attached), attached
    for name in ("fused_lora", "tiled_mlp", "offload_checkpointing", "selective_checkpointing", "cuda_graphs"):
        assert name in attached, attached
    # the kept layers replayed as graphs, in three buckets; the others ran eagerly, layer 0's input offloaded
    graphs = seen["runner"].graphs
    assert graphs.replays > 0 and set(graphs.eager) <= {"checkpointed layer"} and seen["buckets"] == [256, 384, 512]
    assert graphs.checkpointed_replays == 0 and seen["recomputed"] == [] and seen["reserves"] == [0, 0]
    micro_batches = STEPS * ACCUMULATION  # the first packs every layer, the second two, then one
    assert seen["runner"].offload.stats.packs == LAYERS + 2 + (micro_batches - 2)
    # what raised before the pool took slots by identity: idle slots of several sizes, one taken from behind another
    hidden = fast.trainer.model.config.hidden_size
    assert [nbytes // (4 * hidden) for nbytes, _, _ in pool_calls] == [150] * 4 + [470] * 2 + [60, 300, 200, 450, 340, 130]
    assert any(len(set(sizes)) > 1 and taken and taken[0] > 0 for _, sizes, taken in pool_calls), pool_calls


@pytest.mark.parametrize("offload", [False, True])
def test_checkpointed_layers_replay_as_graphs_and_train_as_plain_trl(tmp_path, one_thread, monkeypatch, caplog,
                                                                     offload):
    """``cuda_graphs_checkpointed=True`` (the default; with ``offload`` this is the whole default path): the layers
    the plan leaves checkpointed (their inputs offloaded with ``offload``: the graphs save the input, the offload's
    pack hook packs it) replay their forward, recompute and backward as graphs (``ops.recompute_graphs``) from the
    first look on: layer 0 throughout, layer 1 until the second look recomputes only its MLP (its graphs then
    unused, the others' replayed in their order). Each look holds back what those graphs will hold: the first their
    pool, buffers and gradients, the second what is left."""
    plain, _ = _run(tmp_path, monkeypatch, False, [])
    with caplog.at_level(logging.INFO, logger="nbkit"):
        fast, seen = _run(tmp_path, monkeypatch, True, [], offload=offload)  # the default: graphed
    assert_same_run(fast, plain, **TOLERANCE)
    state = OFFLOADED if offload else CHECKPOINTED
    assert seen["plans"] == [state, MLP_RECOMPUTED, KEPT, KEPT]
    assert seen["line"] == f"{LAYERS} layers: 2 kept (2 graphed), 1 with the MLP recomputed, 1 {state} (1 graphed)"
    assert f"{LAYERS} layers: 1 kept (1 graphed), 1 with the MLP recomputed, 2 {state} (2 graphed)" in caplog.text
    graphs = seen["runner"].graphs
    micro_batches = STEPS * ACCUMULATION  # the first measures the checkpointed layers eagerly
    assert graphs.checkpointed_replays >= micro_batches - 1, graphs.counters()
    assert set(graphs.eager) <= {"checkpointed layer"}, graphs.eager
    assert {i for i, _ in seen["recomputed"]} == {0, 1} and {b for _, b in seen["recomputed"]} == {256, 384, 512}
    assert seen["reserves"][0] > seen["reserves"][1] >= 0 and "held back for the checkpointed layers' graphs" in caplog.text
    if offload:  # every offloaded call packed its input, graphed or not
        assert seen["runner"].offload.stats.packs == LAYERS + 2 + (micro_batches - 2)
