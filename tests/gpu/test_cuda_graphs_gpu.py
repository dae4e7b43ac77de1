"""``cuda_graphs`` on a CUDA GPU in bf16, every other switch at its default: real captures and replays train as the
eager layers do.

Tolerance: the LoRA gradients of every step within max(2 x the eager run's own run-to-run difference, 2e-2)
relative, losses within 1e-2 relative. A padded bucket changes the GEMMs' row counts (other bf16 roundings in the
reductions over tokens); the padding itself adds exactly zero (checked on CPU, ``tests/test_cuda_graphs.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import pytest
import torch
from grad_steps import StepGrads, max_relative

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4)
STEPS = 4


def _train(tmp_path, tag: str, build, graphs, checkpointing: bool = True, **kw):
    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    model, peft_config = build(tok)
    args = FastSFTConfig(output_dir=str(tmp_path / tag), max_steps=STEPS, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, packing=True, max_length=512, bf16=True, learning_rate=1e-2,
                         optim="sgd", logging_steps=1, report_to=[], save_strategy="no", seed=0,
                         shuffle_dataset=False, gradient_checkpointing=checkpointing,
                         gradient_checkpointing_kwargs={"use_reentrant": False}, live_dashboard=False,
                         cuda_graphs=graphs, **kw)
    grads = StepGrads()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=300), processing_class=tok,
                      peft_config=peft_config, callbacks=[grads])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # the layer runner's plan and its modes' counters (the graphs': captured, replays, eager, capture_s)
    return losses, grads.steps, trainer.nbkit_layer_stats, trainer.nbkit_attached


def _bf16(tok):
    from peft import LoraConfig

    from nbkit.demo.models import tiny_model

    model = tiny_model("qwen3", len(tok), dtype=torch.bfloat16, pad_token_id=tok.pad_token_id, seed=0, **SHAPE)
    return model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)


def _four_bit(folder):
    def build(tok):
        from nbkit.demo.models import tiny_model
        from nbkit.loading import load_model

        if not (folder / "config.json").exists():
            tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, seed=0, **SHAPE).save_pretrained(folder)
            tok.save_pretrained(folder)
        torch.manual_seed(0)
        model, _ = load_model(str(folder), load_in_4bit=True, dtype=torch.bfloat16, lora_r=8)
        return model, None

    return build


def _check(eager, again, graphed, checkpointing: bool) -> None:
    noise = max(max_relative(a, b) for a, b in zip(again[1], eager[1]))
    err = max(max_relative(a, b) for a, b in zip(graphed[1], eager[1]))
    stats = graphed[2]
    print(f"losses {eager[0]} vs {graphed[0]}; LoRA gradients: eager vs eager {noise:.2e}, graphs vs eager "
          f"{err:.2e}; {stats}; attached {graphed[3]}")
    assert graphed[0] == pytest.approx(eager[0], rel=1e-2)
    assert err <= max(2 * noise, 2e-2)
    assert stats["replays"] > 0 and stats["captured"] > 0 and stats["capture_s"] > 0
    # the runner hands the graphs only the layers its plan graphs: a checkpointed one runs as checkpointed
    assert stats["eager"] == {}, stats
    if not checkpointing:  # every layer kept, as the user asked: all graphed
        assert stats["plan"].startswith("4 layers: 4 kept (4 graphed)"), stats["plan"]
    assert "cuda_graphs" in graphed[3] and "cuda_graphs" not in eager[3]


@pytest.mark.parametrize("checkpointing", [True, False])
def test_graphs_train_as_the_eager_layers_in_bf16(tmp_path, checkpointing):
    eager = _train(tmp_path, "eager", _bf16, False, checkpointing)
    again = _train(tmp_path, "again", _bf16, False, checkpointing)
    graphed = _train(tmp_path, "graphs", _bf16, "auto", checkpointing)
    _check(eager, again, graphed, checkpointing)


def test_graphs_train_as_the_eager_layers_on_a_4bit_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    build = _four_bit(tmp_path / "base")
    eager = _train(tmp_path, "eager", build, False)
    again = _train(tmp_path, "again", build, False)
    graphed = _train(tmp_path, "graphs", build, "auto")
    _check(eager, again, graphed, True)


@pytest.mark.parametrize("base,offload", [("bf16", False), ("4bit", False), ("bf16", True)])
def test_checkpointed_layers_replay_as_graphs_and_train_as_the_eager_ones(tmp_path, base, offload):
    """``cuda_graphs_checkpointed=True``, ``selective_checkpointing=False``: every layer stays checkpointed (its input
    offloaded with ``offload``), and from the first look on each replays its forward, recompute and backward as
    graphs (``ops.recompute_graphs``); the same tolerances as kept layers'."""
    if base == "4bit":
        pytest.importorskip("bitsandbytes")
    build = _bf16 if base == "bf16" else _four_bit(tmp_path / "base")
    kw = dict(selective_checkpointing=False, offload_checkpointing=offload)
    eager = _train(tmp_path, "eager", build, False, **kw)
    again = _train(tmp_path, "again", build, False, **kw)
    graphed = _train(tmp_path, "graphs", build, "auto", cuda_graphs_checkpointed=True, **kw)
    _check(eager, again, graphed, True)
    stats = graphed[2]
    state = "offloaded" if offload else "checkpointed"
    assert stats["plan"].startswith(f"4 layers: 4 {state} (4 graphed)"), stats["plan"]
    assert stats["checkpointed_replays"] == stats["replays"] > 0, stats
    if offload:
        assert stats["offload_packs"] > 0 and "offload_checkpointing" in graphed[3], stats


def _lora_model() -> torch.nn.Module:
    """A tiny bf16 Qwen3 on the GPU with LoRA r8 on every linear layer (B not zero, so the adapters matter)."""
    from peft import LoraConfig, get_peft_model

    from nbkit.demo.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3", 512, dtype=torch.bfloat16, seed=0, **SHAPE).cuda()
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0)).train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02)
    return model


def _rows_trained(model: torch.nn.Module, rows: list[list[int]], graphs: Any, seed_of: Callable[[int], int],
                  together: Union[int, Sequence[int]] = 1) -> list:
    """Forward and backward of each packed row (documents of ``lengths``) with varlen attention and fused LoRA, and
    ``graphs`` (a ``CudaGraphs``, handed the packed attention whose runs it reads) when given: each step's loss and
    LoRA gradients. A step is ``together`` rows (or the next of ``together``'s sizes): their forwards, then one
    backward of their summed losses."""
    from nbkit.ops.packed_boundaries import metadata_from_lengths
    from nbkit.speedups.fused_lora import FusedLoRA
    from nbkit.speedups.packed_attention import PackedAttention

    packed = PackedAttention(kernel="varlen")
    if graphs is not None:
        graphs.packed = packed
    speedups = [packed, FusedLoRA()] + ([graphs] if graphs is not None else [])
    for s in speedups:
        assert s.attach(model)
    sizes = [together] * -(-len(rows) // together) if isinstance(together, int) else list(together)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    out = []
    try:
        for start, size in zip(starts, sizes):
            model.zero_grad(set_to_none=True)
            loss = 0
            for i in range(start, min(start + size, len(rows))):
                meta = metadata_from_lengths(rows[i])
                batch = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in meta.items()}
                ids = torch.randint(0, 512, (1, sum(rows[i])), device="cuda",
                                    generator=torch.Generator("cuda").manual_seed(seed_of(i)))
                loss = loss + model(input_ids=ids, labels=ids, use_cache=False, **batch).loss
            loss.backward()
            out.append((loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                      if p.grad is not None}))
    finally:
        for s in reversed(speedups):
            s.detach()
    return out


def test_with_room_an_eager_call_of_a_graphed_layer_keeps_its_activations():
    """Real graphs and the real memory test: on the H200 a row above ``max_tokens`` after a captured bucket keeps
    its activations beside the pools (no recompute); losses and gradients as the eager layers'."""
    from nbkit.speedups.cuda_graphs import CudaGraphs

    model = _lora_model()
    rows = [[400, 600], [3000, 1000], [400, 600]]  # bucket 1024, above 2048, 1024
    eager = _rows_trained(model, rows, None, seed_of=lambda i: i)
    graphs = CudaGraphs(mode=True, max_tokens=2048)
    graphed = _rows_trained(model, rows, graphs, seed_of=lambda i: i)
    layers = 4
    assert graphs.captured == layers and graphs.replays == 2 * layers and graphs.capture_s > 0
    assert graphs.recomputed == 0 and graphs.eager == {"more than 2048 tokens": layers}
    for (le, ge), (lg, gg) in zip(eager, graphed):
        assert lg == pytest.approx(le, rel=5e-3)
        assert max_relative(gg, ge) < 3e-2


def test_a_replayed_layer_matches_its_eager_forward_and_backward_bucket_by_bucket():
    """One decoder layer, rows of 300, 1000 and 2048 tokens (buckets 384, 1024, 2048), the same row twice (a replay
    of a captured graph, not a first capture): outputs and gradients against the eager layer, to bf16 rounding."""
    from nbkit.speedups.cuda_graphs import CudaGraphs

    model = _lora_model()
    rows = [[100, 200], [1000], [512, 512, 1024], [100, 200]]
    eager = _rows_trained(model, rows, None, seed_of=lambda i: i % 3)
    graphs = CudaGraphs(mode=True)
    graphed = _rows_trained(model, rows, graphs, seed_of=lambda i: i % 3)
    assert graphs.eager == {} and graphs.replays == 4 * len(rows) and graphs.captured == 4 * 3
    assert graphs.counters()["captures"] == 3 and graphs.capture_s > 0  # one capture call per bucket
    for (le, ge), (lg, gg) in zip(eager, graphed):
        assert lg == pytest.approx(le, rel=5e-3)
        assert max_relative(gg, ge) < 3e-2


def test_near_the_limit_a_row_replays_a_larger_bucket_and_an_eager_call_recomputes(monkeypatch):
    """Real graphs: a row whose own bucket is refused for memory replays the captured larger bucket (no new capture),
    and a row above ``max_tokens``, with no room for its activations beside the pools, runs the graphed layers
    checkpointed; losses and gradients as the eager layers'."""
    from nbkit.speedups.cuda_graphs import CudaGraphs
    from nbkit.speedups.graph_memory import GraphMemory

    model = _lora_model()
    rows = [[400, 600], [100, 200], [3000, 1000], [400, 600]]  # buckets 1024, 384 (refused), above 2048, 1024
    monkeypatch.setattr(GraphMemory, "problem", lambda self, device, bucket, layers=1, **kw:
                        "no memory" if (bucket < 1024 and layers > 1) or bucket > 2048 else None)
    eager = _rows_trained(model, rows, None, seed_of=lambda i: i)
    graphs = CudaGraphs(mode=True, max_tokens=2048)
    graphed = _rows_trained(model, rows, graphs, seed_of=lambda i: i)
    layers = 4
    assert graphs.captured == layers and graphs.reused == 1 and graphs.replays == 3 * layers
    assert graphs.recomputed == layers and graphs.eager == {"more than 2048 tokens": layers}
    for (le, ge), (lg, gg) in zip(eager, graphed):
        assert lg == pytest.approx(le, rel=5e-3)
        assert max_relative(gg, ge) < 3e-2


def _graph_pool_bytes() -> int:
    """What the allocator holds for CUDA graph pools (every segment outside the default pool)."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


def test_every_bucket_shares_one_kept_pool_and_trains_as_the_eager_layers():
    """Real graphs of three buckets in the run's one kept pool: a smaller bucket's capture, after the largest one's,
    takes what that one's activations left free between replays, so the pools hold about one bucket's activations,
    not the sum; and replaying the buckets in turn, each writing over what another's backward read, trains as the
    eager layers do."""
    from nbkit.speedups.cuda_graphs import CudaGraphs

    model = _lora_model()
    rows = [[1024, 1024], [100, 200], [600, 400], [100, 200], [1024, 1024], [600, 400]]  # 2048, 384, 1024, ...
    eager = _rows_trained(model, rows, None, seed_of=lambda i: i)
    graphs = CudaGraphs(mode=True)
    sizes = []
    original = CudaGraphs._capture_from

    def measured(self, *args, **kwargs):
        original(self, *args, **kwargs)
        sizes.append(_graph_pool_bytes())

    CudaGraphs._capture_from = measured
    try:
        graphed = _rows_trained(model, rows, graphs, seed_of=lambda i: i)
    finally:
        CudaGraphs._capture_from = original
    layers = 4
    print(f"graph pools after each capture: {[round(s / 2**20, 1) for s in sizes]} MiB")
    assert graphs.eager == {} and graphs.replays == layers * len(rows) and graphs.captured == layers * 3
    assert len(sizes) == 3 and sizes[0] > 0 and sizes[-1] < 1.3 * sizes[0], sizes
    for (le, ge), (lg, gg) in zip(eager, graphed):
        assert lg == pytest.approx(le, rel=5e-3)
        assert max_relative(gg, ge) < 3e-2


def test_a_forward_of_another_bucket_before_the_backward_runs_eagerly_and_trains_as_the_eager_layers():
    """Two forwards before their backwards, of two buckets whose graphs share the kept pool: the second forward's
    layers run eagerly (a replay would write over the first forward's activations); losses and gradients as the
    eager layers'."""
    from nbkit.speedups.cuda_graphs import OTHER_TURN, CudaGraphs

    model = _lora_model()
    rows = [[600, 400], [100, 200], [100, 200], [600, 400], [600, 400], [100, 200]]  # buckets 1024 and 384, in pairs
    eager = _rows_trained(model, rows, None, seed_of=lambda i: i, together=2)
    graphs = CudaGraphs(mode=True)
    graphed = _rows_trained(model, rows, graphs, seed_of=lambda i: i, together=2)
    layers = 4
    assert graphs.eager == {OTHER_TURN.text: 3 * layers} and graphs.replays == 3 * layers, graphs.counters()
    for (le, ge), (lg, gg) in zip(eager, graphed):
        assert lg == pytest.approx(le, rel=5e-3)
        assert max_relative(gg, ge) < 3e-2


def test_two_forwards_of_one_bucket_before_their_backwards_train_checkpointed_graphs_as_the_eager_layers():
    """Checkpointed layers as graphs (``cuda_graphs_checkpointed``), two forwards of one bucket before their
    backward: each backward restores its forward's metadata and copies the shared gradient buffers while the other
    is due; losses and gradients as the eager layers' (checkpointing changes no number)."""
    from nbkit.speedups.cuda_graphs import CudaGraphs

    model = _lora_model()
    rows = [[600, 400], [300, 500, 100]] * 3  # one bucket (1024), other documents in each row of a pair
    steps = [1, 1, 2, 2]  # single rows first: the first step measures the layers eagerly, the second captures
    eager = _rows_trained(model, rows, None, seed_of=lambda i: i, together=steps)  # no checkpointing: the same numbers
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    graphs = CudaGraphs(mode=True, checkpointed=True)
    graphed = _rows_trained(model, rows, graphs, seed_of=lambda i: i, together=steps)
    layers = 4
    assert graphs.checkpointed_replays >= (2 + 2) * layers, graphs.counters()  # both pairs replayed
    for (le, ge), (lg, gg) in zip(eager, graphed):
        assert lg == pytest.approx(le, rel=5e-3)
        assert max_relative(gg, ge) < 3e-2
