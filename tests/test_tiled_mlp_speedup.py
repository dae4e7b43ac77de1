"""``tiled_mlp``: FastSFT with the MLPs tiled trains exactly as without (CPU, fp32).

Compared: the logged losses and the LoRA weights after 2 SGD steps (LoRA B starts at 0, so after the steps it is the
gradients), with and without gradient checkpointing, tiles of 8 tokens on 96-token packed rows (so every MLP call is
tiled, the last tile short). Tolerance 1e-5 relative: the same products, summed over tiles in another order. The
tiled path must have run (its autograd function is counted), or the comparison would prove nothing.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from parity import Tol, assert_same_series, assert_same_tensors, fast_sft, train

from nbkit import FastSFTConfig
from nbkit.demo.data import make_dataset
from nbkit.demo.models import tiny_model
from nbkit.ops import tiled_mlp as tiled_op
from nbkit.settings import SettingError

SAME = Tol(rtol=1e-5)  # losses
SAME_WEIGHTS = Tol(scaled=1e-5)


def _train(tmp_path, family: str, tiled, checkpointing: bool, tokens=None):
    trainer = fast_sft(
        tmp_path / f"{family}-{tiled}-{checkpointing}", family=family, max_steps=2, learning_rate=1e-2,
        shuffle_dataset=False, gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, optim="sgd", tiled_mlp=tiled,
        tiled_mlp_tokens=tokens, dataset=make_dataset("messages", n=96))
    return train(trainer)


@pytest.mark.parametrize("family, checkpointing", [("llama", True), ("llama", False), ("gemma3", True)])
def test_tiled_mlp_trains_as_the_plain_mlp(tmp_path, one_thread, monkeypatch, family, checkpointing):
    calls = []
    apply = tiled_op._TiledMLP.apply

    def counted(*a):
        calls.append(a[1].shape)
        return apply(*a)

    monkeypatch.setattr(tiled_op._TiledMLP, "apply", counted)
    plain = _train(tmp_path, family, False, checkpointing)
    assert not calls
    tiled = _train(tmp_path, family, True, checkpointing, tokens=8)
    assert calls and all(shape[-2] > 8 for shape in calls), calls
    assert "tiled_mlp" in tiled.trainer.nbkit_attached
    assert_same_series(tiled.losses, plain.losses, SAME)
    assert len(plain.losses) == 2
    moved = [n for n, w in plain.weights.items() if "mlp" in n and "lora_B" in n and w.abs().max() > 0]
    assert moved, "the MLP adapters did not train"
    assert_same_tensors(tiled.weights, plain.weights, SAME_WEIGHTS)


def test_moe_blocks_are_left_alone():
    from nbkit.speedups.tiled_mlp import TiledMLP

    model = tiny_model("qwen3_moe", 97)
    speedup = TiledMLP(tile_tokens=8)
    assert not speedup.attach(model)  # every layer's MLP is a sparse MoE block
    speedup.detach()


def test_the_switch_takes_true_false_or_auto_and_a_tile_length():
    assert FastSFTConfig(output_dir="x", report_to=[]).tiled_mlp == "auto"
    for value in (True, False, "auto"):
        assert FastSFTConfig(output_dir="x", tiled_mlp=value, report_to=[]).tiled_mlp == value
    for value in (0, "always", 4096):
        with pytest.raises(SettingError, match="tiled_mlp"):
            FastSFTConfig(output_dir="x", tiled_mlp=value, report_to=[])
    assert FastSFTConfig(output_dir="x", tiled_mlp_tokens=4096, report_to=[]).tiled_mlp_tokens == 4096
    for value in (0, -1, 2.5, True):
        with pytest.raises(SettingError, match="tiled_mlp_tokens"):
            FastSFTConfig(output_dir="x", tiled_mlp_tokens=value, report_to=[])


def _fake_gpu(monkeypatch, limit: int, in_use: Callable[[], int]) -> None:
    """The budget's CUDA readings faked: ``limit`` bytes this process may use, ``in_use()`` held by tensors."""
    from nbkit.speedups import layer_budget

    monkeypatch.setattr(layer_budget, "gpu_limit", lambda device: limit)
    monkeypatch.setattr(layer_budget, "gpu_in_use", lambda device: in_use())


def test_auto_tiles_only_calls_that_would_crowd_the_gpu(monkeypatch):
    """'auto''s rule is the run's budget's (``Budget.crowded``): the untiled MLP's working set beside what is in use
    must stay under 90% of the limit; a call needing less than 1/16 of the limit is never looked at."""
    from nbkit.speedups.layer_budget import Budget
    from nbkit.speedups.tiled_mlp import WORKING_SET

    gib = 1 << 30
    reads, state = [], {}

    def in_use():
        reads.append(state["in_use"])
        return state["in_use"]

    def crowded(tokens: int, limit: int, used: int, extra: int = 0) -> bool:
        _fake_gpu(monkeypatch, limit, in_use)
        state["in_use"] = used
        need = WORKING_SET * tokens * 14336 * 2
        return Budget(torch.device("cuda", 0)).crowded(need, extra)

    # Llama-3.1-8B's MLP (14,336 wide, bf16): 32K tokens need ~5.3 GiB, 16K ~2.6, 128K ~21
    assert not crowded(16384, 80 * gib, 70 * gib)  # under 1/16 of 80 GiB: not looked at
    assert reads == []
    assert not crowded(32768, 16 * gib, 8 * gib)  # 8 + 5.3 GiB fit in 90% of 16
    assert crowded(32768, 16 * gib, 10 * gib)  # 10 + 5.3 do not
    assert not crowded(32768, 16 * gib, 8 * gib, extra=gib // 2)  # 8.5 + 5.3 still fit
    assert crowded(32768, 16 * gib, 8 * gib, extra=3 * gib // 2)  # what backward adds beside the MLP: 9.5 + 5.3 do not
    assert not crowded(131072, 80 * gib, 50 * gib)
    assert crowded(131072, 80 * gib, 55 * gib)
    assert reads == [8 * gib, 10 * gib, 8 * gib, 8 * gib, 50 * gib, 55 * gib]
    assert not Budget(torch.device("cpu")).crowded(1 << 40)  # off CUDA: never
    assert reads == [8 * gib, 10 * gib, 8 * gib, 8 * gib, 50 * gib, 55 * gib]


def test_auto_leaves_cpu_runs_plain(tmp_path, one_thread, monkeypatch):
    calls = []
    apply = tiled_op._TiledMLP.apply
    monkeypatch.setattr(tiled_op._TiledMLP, "apply", lambda *a: calls.append(1) or apply(*a))
    trainer = _train(tmp_path, "llama", "auto", True).trainer
    assert "tiled_mlp" not in trainer.nbkit_attached and not calls


def _auto_on_a_fake_gpu(monkeypatch) -> None:
    """'auto' takes part (a CUDA limit for ``prepare``), and the budget judges each call as on a CUDA GPU (the model
    stays on the CPU: ``Budget.crowded`` is handed a CUDA device, its readings faked by the caller)."""
    from nbkit.speedups import tiled_mlp as tiled_speedup
    from nbkit.speedups.layer_budget import Budget

    crowded = Budget.crowded
    monkeypatch.setattr(tiled_speedup, "gpu_limit", lambda device: 1 << 30)
    monkeypatch.setattr(Budget, "crowded", lambda self, need, extra=0: crowded(Budget(torch.device("cuda", 0)), need,
                                                                               extra))


def test_auto_short_of_memory_tiles_and_trains_as_the_plain_mlp(tmp_path, one_thread, monkeypatch):
    """A GPU faked on the CPU: 1 MiB this process may use, half of it in use. Every MLP call longer than a tile
    is tiled (tiles of hidden_size tokens: 96-token rows of batch 2 are 192 tokens, hidden 64)."""
    calls = []
    apply = tiled_op._TiledMLP.apply
    monkeypatch.setattr(tiled_op._TiledMLP, "apply", lambda *a: calls.append(a[1].shape) or apply(*a))
    plain = _train(tmp_path, "llama", False, True)
    _auto_on_a_fake_gpu(monkeypatch)
    _fake_gpu(monkeypatch, 1 << 20, lambda: 1 << 19)
    auto = _train(tmp_path, "llama", "auto", True)
    assert calls and "tiled_mlp" in auto.trainer.nbkit_attached
    assert_same_series(auto.losses, plain.losses, SAME)
    assert_same_tensors(auto.weights, plain.weights, SAME_WEIGHTS)


def test_auto_with_room_leaves_the_mlp_plain(tmp_path, one_thread, monkeypatch):
    """The same fake GPU with room: 1 GiB, nothing in use. No call crowds it, none is tiled."""
    calls = []
    apply = tiled_op._TiledMLP.apply
    monkeypatch.setattr(tiled_op._TiledMLP, "apply", lambda *a: calls.append(1) or apply(*a))
    _auto_on_a_fake_gpu(monkeypatch)
    _fake_gpu(monkeypatch, 1 << 30, lambda: 0)
    _train(tmp_path, "llama", "auto", True)
    assert not calls


def test_auto_decides_once_per_shape_so_the_recompute_saves_what_the_forward_saved(tmp_path, one_thread,
                                                                                  monkeypatch):
    """Memory in use grows from the forward to the backward's recompute; had the recompute decided anew (tiled
    there, plain in the forward), non-reentrant checkpointing would find other saved tensors and raise."""
    from nbkit.speedups import tiled_mlp as tiled_speedup
    from nbkit.speedups.layer_budget import Budget

    calls, asked = [], []
    apply = tiled_op._TiledMLP.apply
    monkeypatch.setattr(tiled_op._TiledMLP, "apply", lambda *a: calls.append(1) or apply(*a))
    monkeypatch.setattr(tiled_speedup, "gpu_limit", lambda device: 1 << 30)

    def crowded_after_two(self, need, extra=0):  # the first two judgements (the layers' forwards) see room, the rest not
        asked.append(1)
        return len(asked) > 2

    monkeypatch.setattr(Budget, "crowded", crowded_after_two)
    plain = _train(tmp_path, "llama", False, True)
    auto = _train(tmp_path, "llama", "auto", True)
    # one decision per layer and input shape (2 layers; the 2 steps' packed rows may differ in length), never one per
    # call (2 steps x 2 layers x forward and recompute): the recompute repeats the forward's choice
    assert len(asked) in (2, 4)
    assert_same_series(auto.losses, plain.losses, SAME)
    assert_same_tensors(auto.weights, plain.weights, SAME_WEIGHTS)
