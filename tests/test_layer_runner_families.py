"""The layer runner's plan on each kind of decoder layer, trained as plain TRL trains: the last layer kept and
graphed, the one before it kept with its MLP recomputed, the first two checkpointed with their inputs offloaded.

Why: tests/test_default_path_budget.py forces that plan on Qwen3 only. The runner's wrappers meet each family's own
layer and MLP: Llama's plain ones, Gemma 3's sliding and full layers (other position embeddings per layer type),
Qwen3-MoE's sparse block under the MLP-only recompute (its router runs twice), gpt-oss's experts and attention
sinks. A wrapper that lost a keyword argument, a router output or a layer type's rope would show here as a loss or
gradient apart from ``SFTTrainer``'s.

How: ``tiny_model`` of the family with LoRA (B drawn, so every LoRA gradient counts), gradient checkpointing on,
``selective_checkpointing=True``, ``offload_checkpointing=True`` (its CPU path: host buffers, the same pack /
unpack / prefetch code), ``cuda_graphs`` on ``layer_graphs.TapeBackend`` (MoE families are not graphed: said, and
checked), 3 SGD steps of 2 micro-batches, against ``SFTTrainer`` on the same model, adapters and rows. The budget's
first look is replaced to buy exactly that plan from the runner's own measured costs; the second look buys nothing.
Tolerances (fp32): losses 1e-5 relative, gradients 1e-4 of each tensor's largest entry; the sums differ in order
(padding-free rows, the graphs' buckets, MoE routing sorted by expert).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from parity import Tol, add_lora, assert_same_run, fast_sft, tiny_lm, train

from nbkit.demo.models import MOE_FAMILIES
from nbkit.ops.layer_graphs import TapeBackend
from nbkit.speedups import LAYER_MODES, SPEEDUPS, SpeedupSpec
from nbkit.speedups.cuda_graphs import CudaGraphs
from nbkit.speedups.layer_budget import Budget, Look
from nbkit.speedups.layer_plan import KEPT, MLP_RECOMPUTED, OFFLOADED

FAMILIES = ("llama", "gemma3", "qwen3_moe", "gpt_oss")
TOLERANCE = dict(losses=Tol(rtol=1e-5), grads=Tol(scaled=1e-4))


def _rows(vocab: int):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    lengths = [40, 70, 90, 30, 60, 80, 50, 100, 20, 75, 65, 45]
    return Dataset.from_dict({"input_ids": [torch.randint(3, vocab, (n,), generator=generator).tolist()
                                            for n in lengths]})


def _run(tmp_path, monkeypatch, family: str, fast: bool) -> tuple[Any, dict[str, Any]]:
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tokenizer = load_demo_tokenizer()
    overrides = {"router_aux_loss_coef": 0.0} if family in MOE_FAMILIES else {}
    model = add_lora(tiny_lm(family, tokenizer=tokenizer, seed=0, **overrides), random_b=0.02)
    settings: dict[str, Any] = dict(
        max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2, packing=False, max_length=128,
        learning_rate=1e-2, optim="sgd", shuffle_dataset=False, train_sampling_strategy="sequential",
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    seen: dict[str, Any] = {}
    if not fast:
        from trl import SFTTrainer

        trainer = fast_sft(tmp_path / "plain", model=model, lora=None, tokenizer=tokenizer,
                           dataset=_rows(len(tokenizer)), trainer_cls=SFTTrainer, **settings)
        return train(trainer, grads=True), seen

    def graphs(args, packed, dataset=None):
        return CudaGraphs(mode=True, backend=TapeBackend()) if packed else None

    def recorded(spec: SpeedupSpec) -> SpeedupSpec:
        def build(args, packed, dataset=None, allows=None):
            runner = spec.build(args, packed, dataset, allows)
            if runner is not None and spec.name == "decoder_layers":
                seen["runner"], detach = runner, runner.detach

                def read_then_detach() -> None:
                    seen["plans"] = [p.activations for p in runner.plans]
                    seen["graphs"] = runner.graphs.counters() if runner.graphs is not None else None
                    detach()

                runner.detach = read_then_detach
            return runner

        return SpeedupSpec(spec.name, spec.stage, build, spec.switched)

    def first(budget: Budget) -> Look:
        c = seen["runner"].costs
        return Look(c[3].kept + c[2].mlp_recomputed + c[1].input // 2, "test")

    monkeypatch.setattr("nbkit.speedups.LAYER_MODES", tuple(
        (name, role, graphs if name == "cuda_graphs" else make) for name, role, make in LAYER_MODES))
    monkeypatch.setattr("nbkit.speedups.SPEEDUPS", tuple(recorded(spec) for spec in SPEEDUPS))
    monkeypatch.setattr(Budget, "first_look", first)
    monkeypatch.setattr(Budget, "second_look", lambda budget, scale: Look(0, "test"))
    trainer = fast_sft(tmp_path / "fast", model=model, lora=None, tokenizer=tokenizer, dataset=_rows(len(tokenizer)),
                       selective_checkpointing=True, offload_checkpointing=True, **settings)
    return train(trainer, grads=True), seen


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_trains_each_family_as_plain_trl(tmp_path, one_thread, monkeypatch, family):
    plain, _ = _run(tmp_path, monkeypatch, family, False)
    fast, seen = _run(tmp_path, monkeypatch, family, True)
    assert_same_run(fast, plain, **TOLERANCE)
    assert seen["plans"] == [OFFLOADED, OFFLOADED, MLP_RECOMPUTED, KEPT], seen["plans"]
    runner = seen["runner"]
    assert runner.offload is not None and runner.offload.stats.packs > 0
    if family in MOE_FAMILIES:  # the experts' shapes depend on the routing: never graphed
        assert seen["graphs"] is None
    else:
        assert seen["graphs"]["replays"] > 0 and seen["graphs"]["eager"] == {}, seen["graphs"]
