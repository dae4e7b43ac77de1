"""FastSFT's default path under the memory budget of a smaller GPU, on a CPU: some decoder layers checkpointed and
offloaded, the others kept and replayed as graphs, micro-batches of varying length; trained as plain TRL trains.

Why: on a CPU nothing reads memory, so in the other CPU tests selective checkpointing un-checkpoints every layer and
the paths a T4 or an L4 takes never run together: layers still checkpointed after step 1 (their inputs in the
offload's host pool, whose idle slots then differ in size as rows vary) beside layers kept and graphed. Here they
are forced, each speedup as its default builds it on a GPU unless said:

- ``selective_checkpointing=True`` with fake memory readings (``selective.memory_readings``): the first look's
  budget holds 1.5 layers at the longest micro-batch (the last layer kept), the second look's, after the first
  optimizer step, 1.5 more (the last two kept); layers 0 and 1 stay checkpointed throughout.
- ``offload_checkpointing=True``: 'auto' engages on CUDA only; on a CPU the same pack / unpack / prefetch code runs
  with host buffers. Step 1 packs all four layers, then three, then two: idle host slots of several sizes.
- ``cuda_graphs``: built as on a GPU ('auto') but on ``layer_graphs.TapeBackend`` (Python frozen at capture, as on a
  GPU), through the ``SPEEDUPS`` table.
- ``tiled_mlp=True`` with tiles of 64 tokens: what 'auto' does where the MLP would crowd the card.
- ``cached_packing`` (its padding-free rows, the 'sdpa' kernel on a CPU), ``fused_lora``, ``sync_free_metrics``: their
  defaults. Not here: ``dequant_cache`` (a 4-bit base: tests/test_dequant_cache.py), ``fused_kernels`` (Liger needs a
  GPU), ``expandable_segments`` (CUDA's allocator).

Rows: ``packing=False`` (the default: each micro-batch is its two rows packed padding-free into one), pre-tokenized
rows whose micro-batches vary from 60 to 470 tokens, read in order: graph buckets 256, 384 and 512 in turn, and host
slots regrown and reused between steps. (``packing=True`` fills its rows almost to ``max_length``: its micro-batches
vary far less.) Before the host pool took its idle slots by identity, this run raised in the fifth micro-batch
(``list.remove`` comparing host slots of two sizes by value).

Compared with TRL's ``SFTTrainer`` on the same model, LoRA adapters (B drawn, so that every LoRA gradient counts),
rows and order, gradient checkpointing on, 4 SGD steps of 2 micro-batches. Tolerances (fp32): losses 2e-6 relative,
every gradient of every optimizer step within 2e-5 of its tensor's largest entry. Both paths compute in fp32; what
differs is the order of sums: the graphs' buckets pad the GEMMs' row counts, the tiles split the MLP's, padding-free
rows against TRL's padded batch. Measured (one thread): losses up to 1.4e-7, gradients up to 2.1e-6; the bounds
are about ten times that. Offloading itself restores the same bytes (bitwise: tests/test_offload.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from parity import Tol, add_lora, assert_same_run, fast_sft, tiny_lm, train

from nbkit.ops.layer_graphs import GraphedLayer, TapeBackend
from nbkit.ops.offload_lanes import _HostPool
from nbkit.speedups import SPEEDUPS, SpeedupSpec
from nbkit.speedups import selective_checkpointing as selective
from nbkit.speedups.cuda_graphs import CudaGraphs
from nbkit.speedups.selective_checkpointing import MARGIN, SHARE

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


def budgeted(speedup: selective.SelectiveCheckpointing, looks: list[int]):
    """Fake readings whose budget holds 1.5 layers at each look (the peak of the second scaled back as the look
    scales it up, to the longest micro-batch the config allows); ``looks`` collects ``kept`` at each reading."""

    def readings(device: Any) -> tuple[int, int, int]:
        looks.append(speedup.kept)
        size = max(speedup._need) if speedup._need else \
            max(speedup._saved[i] / speedup._tokens[i] for i in speedup._saved) * speedup.max_tokens
        room = 1.5 * size / SHARE
        scale = max(1.0, speedup._max_tokens_planned / speedup._longest) if speedup._need and speedup._longest else 1
        return LIMIT, int((LIMIT * (1 - MARGIN) - room) / scale), 0

    return readings


def _read_then(detach, speedup, seen: dict[str, Any]):
    """``detach``, after reading into ``seen`` what it resets: the layers ``selective_checkpointing`` left
    checkpointed, the buckets ``cuda_graphs`` captured."""

    def read_then_detach() -> None:
        if isinstance(speedup, CudaGraphs):
            seen["buckets"] = sorted({v.bucket for (_, v), e in speedup._graphs.items() if isinstance(e, GraphedLayer)})
        else:
            seen["kept"], seen["added"] = speedup.kept, speedup.added
            seen["checkpointed"] = [layer.gradient_checkpointing for layer in speedup._layers]
        detach()

    return read_then_detach


def _run(tmp_path, monkeypatch, fast: bool, pool_calls: list) -> tuple[Any, dict[str, Any]]:
    """One run: FastSFT with the forced default path (``fast``), else TRL's SFTTrainer; the run and what the speedups
    did (read before the trainer detaches them)."""
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

    def recorded(spec: SpeedupSpec) -> SpeedupSpec:
        def build(args, packed, dataset=None):
            if spec.name == "cuda_graphs":
                built = CudaGraphs(mode="auto", backend=TapeBackend()) if packed else None
            else:
                built = spec.build(args, packed, dataset)
            if built is not None:
                seen[spec.name] = built
                if spec.name == "selective_checkpointing":
                    monkeypatch.setattr(selective, "memory_readings", budgeted(built, seen["looks"]))
                if spec.name in ("selective_checkpointing", "cuda_graphs"):
                    built.detach = _read_then(built.detach, built, seen)
            return built

        return SpeedupSpec(spec.name, spec.stage, build, spec.switched)

    monkeypatch.setattr("nbkit.speedups.SPEEDUPS", tuple(recorded(spec) for spec in SPEEDUPS))
    acquire = _HostPool.acquire

    def spied(pool: _HostPool, nbytes: int):
        before = list(pool.free)
        slot = acquire(pool, nbytes)
        taken = [i for i, s in enumerate(before) if not any(s is t for t in pool.free)]
        pool_calls.append((nbytes, [s.numel() for s in before], taken))
        return slot

    monkeypatch.setattr(_HostPool, "acquire", spied)
    trainer = fast_sft(tmp_path / "fast", model=model, lora=None, tokenizer=tokenizer, dataset=rows(len(tokenizer)),
                       selective_checkpointing=True, offload_checkpointing=True, tiled_mlp=True, tiled_mlp_tokens=64,
                       **settings)
    return train(trainer, grads=True), seen


def test_the_default_path_under_a_budget_trains_as_plain_trl(tmp_path, one_thread, monkeypatch, caplog):
    pool_calls: list = []
    plain, _ = _run(tmp_path, monkeypatch, False, pool_calls)
    with caplog.at_level(logging.INFO, logger="nbkit"):
        fast, seen = _run(tmp_path, monkeypatch, True, pool_calls)
    assert_same_run(fast, plain, **TOLERANCE)
    assert len(fast.grads) == STEPS and all(any("lora_B" in n for n in step) for step in plain.grads)

    # the budget: one layer kept at the first look, one more at the second, the first two checkpointed throughout
    assert seen["kept"] == 2 and seen["added"] == 1 and seen["checkpointed"] == [True, True, False, False]
    assert seen["looks"] == [0, 1]
    assert f"1 of {LAYERS} layers un-checkpointed" in caplog.text
    assert f"second look, with the plan's peak measured: 1 more of {LAYERS} layers un-checkpointed, 2 in all" \
        in caplog.text
    attached = fast.trainer.nbkit_attached
    assert any(name.startswith("cached_packing") for name in attached), attached
    for name in ("fused_lora", "tiled_mlp", "offload_checkpointing", "selective_checkpointing", "cuda_graphs"):
        assert name in attached, attached
    # the kept layers replayed as graphs, in three buckets; the checkpointed ones ran eagerly, their inputs offloaded
    graphs = seen["cuda_graphs"]
    assert graphs.replays > 0 and set(graphs.eager) == {"checkpointed layer"} and seen["buckets"] == [256, 384, 512]
    micro_batches = STEPS * ACCUMULATION  # the first packs every layer, the second all but the kept one, then two
    assert seen["offload_checkpointing"].stats.packs == LAYERS + (LAYERS - 1) + (LAYERS - 2) * (micro_batches - 2)
    # what raised before the pool took slots by identity: idle slots of several sizes, one taken from behind another
    hidden = fast.trainer.model.config.hidden_size
    assert [nbytes // (4 * hidden) for nbytes, _, _ in pool_calls] == \
        [150] * 4 + [470] * 3 + [n for n in (60, 300, 200, 450, 340, 130) for _ in range(2)]
    assert any(len(set(sizes)) > 1 and taken and taken[0] > 0 for _, sizes, taken in pool_calls), pool_calls
