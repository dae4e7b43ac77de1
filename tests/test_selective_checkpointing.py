"""``selective_checkpointing``: the last layers that fit are not recomputed, and training is bitwise the same (CPU).

Parity is exact (``torch.equal``): an un-checkpointed layer keeps the tensors its forward saved, and the recompute of
a checkpointed one reproduces the same values with the same kernels in fp32 on a CPU, so losses and every LoRA
gradient of every step are bit for bit those of plain checkpointing. Recomputes are counted with a forward pre-hook
on each layer's ``self_attn`` (hooks on the layer itself sit outside the checkpoint and never see the recompute): a
checkpointed layer runs it twice per step, a kept one once. On a CPU there are no memory counters: ``True`` keeps every
layer, and tests that need a budget fake ``layer_budget.memory_readings``, sized from what the runner measured
(``runner.costs``: each layer's bytes at the longest micro-batch).
"""

from __future__ import annotations

import logging

import pytest
import torch
from parity import VOCAB, add_lora, assert_same_run, fast_sft, run_steps, tiny_lm, train

from nbkit import FastSFTConfig
from nbkit.demo.data import make_dataset
from nbkit.speedups import LAYERS as RUNNER
from nbkit.speedups import build, layer_budget, max_micro_batch_tokens
from nbkit.speedups.layer_budget import MARGIN, SHARE
from nbkit.speedups.layer_plan import CHECKPOINTED, KEPT, MLP_RECOMPUTED, OFFLOADED
from nbkit.speedups.layer_runner import LayerRunner, run_as_is
from nbkit.speedups.offload import OffloadedCheckpointing
from nbkit.speedups.selective_checkpointing import SelectiveCheckpointing

C, M, K, OFF = CHECKPOINTED, MLP_RECOMPUTED, KEPT, OFFLOADED
LAYERS = 4  # tiny_model's
STEPS = 3  # step 1 measures; steps 2 and 3 run with the plan
LIMIT = 1 << 40


def count_attention_calls(model: torch.nn.Module, part: str = "self_attn") -> list[int]:
    """Per decoder layer, how many times its attention (or another ``part``) ran, forward and recompute alike."""
    counts = [0] * LAYERS
    for i, layer in enumerate(layers_of(model)):
        layer.get_submodule(part).register_forward_pre_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(base.model.layers)


def whole(costs, *layers: int) -> int:
    """Bytes keeping ``layers`` whole costs beyond their checkpointed inputs."""
    return sum(costs[i].kept - costs[i].input for i in layers)


def looks(runner_of, *wants, held: int = 0):
    """Fake readings whose n-th look (first, second) spends ``wants[n](runner.costs)`` bytes (2 more: rounding),
    with ``held`` bytes allocated throughout (between micro-batches). ``.at``: the training forward of each look."""
    at: list[int] = []

    def readings(device):
        runner = runner_of()
        if runner is None or not runner.costs:  # before the first look: the mode's check, step 1's start
            return LIMIT, held, held
        want = wants[min(len(at), len(wants) - 1)](runner.costs) + 2
        at.append(runner.forwards)
        return LIMIT, int(LIMIT * (1 - MARGIN) - want / SHARE), held

    readings.at = at
    return readings


# ---------------------------------------------------------------------------------------------------------------
# FastSFT: parity, recomputes, nbkit_attached


def _train(tmp_path, family: str, selective_mode, checkpointing: bool = True, **switches):
    """STEPS SGD steps of FastSFT (LoRA r4 on every linear layer): the run, and each layer's attention calls."""
    settings = dict(max_steps=STEPS, learning_rate=1e-2, shuffle_dataset=False, gradient_checkpointing=checkpointing,
                    gradient_checkpointing_kwargs={"use_reentrant": False}, optim="sgd",
                    selective_checkpointing=selective_mode)
    trainer = fast_sft(tmp_path / f"{family}-{selective_mode}-{checkpointing}-{len(switches)}", family=family,
                       dataset=make_dataset("messages", n=96), **(settings | switches))
    calls = count_attention_calls(trainer.model)
    run = train(trainer, grads=True)
    assert len(run.losses) == STEPS and len(run.grads) == STEPS
    return run, calls


def assert_same_training(plain, fast) -> None:
    """Losses and every gradient of every step bitwise equal (see the module docstring), LoRA B's among them."""
    assert_same_run(fast, plain)
    assert all(any("lora_B" in n for n in step) for step in plain.grads)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_same_losses_and_lora_gradients_with_no_recompute(tmp_path, one_thread, family, caplog):
    plain, plain_calls = _train(tmp_path, family, False)
    assert plain_calls == [2 * STEPS] * LAYERS  # plain checkpointing: forward and recompute, every step
    with caplog.at_level(logging.INFO, logger="nbkit"):
        fast, calls = _train(tmp_path, family, True)
    assert_same_training(plain, fast)
    assert calls == [2 + (STEPS - 1)] * LAYERS  # step 1 recomputes; after it, no layer does (CPU: all of them)
    assert "selective_checkpointing" in fast.trainer.nbkit_attached
    assert caplog.text.count(f"{LAYERS} layers: {LAYERS} kept (") == 1  # the plan, said once
    assert fast.trainer.nbkit_layer_stats["plan"] == f"{LAYERS} layers: {LAYERS} kept"
    assert all(layer.gradient_checkpointing is True for layer in layers_of(fast.trainer.model))  # detached


def test_with_the_other_switches(tmp_path, one_thread):
    """fused_lora and cached_packing are on in every FastSFT run here; offload and tiled MLPs join in this one."""
    others = dict(offload_checkpointing=True, tiled_mlp=True, tiled_mlp_tokens=8)
    plain, _ = _train(tmp_path, "llama", False, **others)
    fast, calls = _train(tmp_path, "llama", True, **others)
    assert_same_training(plain, fast)
    assert calls == [2 + (STEPS - 1)] * LAYERS
    for name in ("fused_lora", "offload_checkpointing", "tiled_mlp", "selective_checkpointing"):
        assert name in fast.trainer.nbkit_attached, fast.trainer.nbkit_attached


def test_a_tight_budget_leaves_every_layer_checkpointed(tmp_path, one_thread, monkeypatch, caplog):
    monkeypatch.setattr(layer_budget, "memory_readings", lambda device: (1 << 30, (1 << 30) - (1 << 20), 0))
    with caplog.at_level(logging.INFO, logger="nbkit"):
        run, calls = _train(tmp_path, "qwen3", True)
    assert calls == [2 * STEPS] * LAYERS
    assert "selective_checkpointing" not in run.trainer.nbkit_attached
    assert f"{LAYERS} layers: {LAYERS} checkpointed (0 MiB to spend" in caplog.text


def test_auto_is_not_built_for_a_cpu_run(tmp_path, one_thread):
    from nbkit import speedups

    def keep(**kw):
        args = FastSFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[],
                             gradient_checkpointing=True, offload_checkpointing=False, **kw)
        runner = next(s for s in speedups.build("model", args, True) if s.name == speedups.LAYERS)
        return runner.keep

    assert keep() is None and isinstance(keep(selective_checkpointing=True), SelectiveCheckpointing)
    run, calls = _train(tmp_path, "qwen3", "auto")
    assert calls == [2 * STEPS] * LAYERS and "selective_checkpointing" not in run.trainer.nbkit_attached


def test_without_gradient_checkpointing_it_does_nothing(tmp_path, one_thread):
    run, calls = _train(tmp_path, "qwen3", True, checkpointing=False)
    assert calls == [STEPS] * LAYERS and "selective_checkpointing" not in run.trainer.nbkit_attached
    model = tiny_lm("qwen3").train()
    layers = layers_of(model)
    assert SelectiveCheckpointing(mode=True, max_tokens=64).attach(model) is False
    assert not any("forward" in vars(m) for layer in layers for m in (layer, layer.mlp))  # nothing left wrapped


# ---------------------------------------------------------------------------------------------------------------
# the speedup on its own: which layers, the budget, detach


def _model(reentrant: bool = False, lora: bool = True) -> torch.nn.Module:
    model = tiny_lm("qwen3")
    if lora:
        model = add_lora(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()


def _steps(model: torch.nn.Module, steps: int = STEPS):
    """``steps`` forward and backward passes of the same 64 tokens, by hand (no optimizer step)."""
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
    return run_steps(model, [dict(input_ids=ids, labels=ids)] * steps)


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_last_layers_that_fit_are_the_ones_kept(one_thread, monkeypatch, reentrant):
    """Room for two layers kept whole (not for a third's attention): the last two, from step 2 on."""
    plain = _steps(_model(reentrant))
    model = _model(reentrant)
    calls = count_attention_calls(model)
    speedup = SelectiveCheckpointing(mode=True, max_tokens=64)
    monkeypatch.setattr(layer_budget, "memory_readings", looks(lambda: speedup.runner, lambda c: whole(c, 2, 3)))
    assert speedup.attach(model)
    # the runner's now: the flags stay on, as under SFTTrainer; the function transformers calls runs the layer as is
    assert [layer.gradient_checkpointing for layer in layers_of(model)] == [True] * LAYERS
    assert [layer._gradient_checkpointing_func for layer in layers_of(model)] == [run_as_is] * LAYERS
    assert_same_run(_steps(model), plain)
    runner = speedup.runner
    assert speedup.kept == 2 and speedup.engaged and runner.kept == 2
    assert [p.activations for p in runner.plans] == [C, C, K, K]
    assert calls == [2 * STEPS, 2 * STEPS, 2 + (STEPS - 1), 2 + (STEPS - 1)]
    assert len(runner.costs) == LAYERS and all(c.kept > c.mlp_recomputed > c.input > 0 for c in runner.costs)
    speedup.detach()
    assert [layer.gradient_checkpointing for layer in layers_of(model)] == [True] * LAYERS


def test_where_a_whole_layer_does_not_fit_its_mlp_is_recomputed(one_thread, monkeypatch):
    """Room for the last layer whole and the attention of the one before: that layer's attention runs once a step,
    its MLP twice; the same losses and gradients. ``split=False`` never chooses it."""
    plain = _steps(_model())
    for split, plans in ((True, [C, C, M, K]), (False, [C, C, C, K])):
        model = _model()
        attention, mlp = count_attention_calls(model), count_attention_calls(model, "mlp.down_proj")
        speedup = SelectiveCheckpointing(mode=True, max_tokens=64, split=split)
        monkeypatch.setattr(layer_budget, "memory_readings", looks(
            lambda speedup=speedup: speedup.runner, lambda c: whole(c, 3) + c[2].mlp_recomputed - c[2].input))
        assert speedup.attach(model)
        assert_same_run(_steps(model), plain)
        assert [p.activations for p in speedup.runner.plans] == plans and speedup.kept == 4 - plans.count(C)
        once, twice = 2 + (STEPS - 1), 2 * STEPS
        assert attention == [twice, twice, once if split else twice, once]
        assert mlp == [twice, twice, twice, once]
        speedup.detach()


def test_detach_puts_every_flag_and_function_back_and_is_safe_twice(one_thread):
    from test_speedup_contract import differences, snapshot

    model = _model()
    layers = layers_of(model)
    functions = [layer._gradient_checkpointing_func for layer in layers]
    before = snapshot(model)
    speedup = SelectiveCheckpointing(mode=True, max_tokens=64)
    assert speedup.attach(model)
    _steps(model, 2)
    assert [layer.gradient_checkpointing for layer in layers] == [True] * LAYERS
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # is_gradient_checkpointing
    assert any("_gradient_checkpointing_func" in d for d in differences(before, snapshot(model)))
    speedup.detach()
    assert differences(before, snapshot(model)) == []
    assert [layer.gradient_checkpointing for layer in layers] == [True] * LAYERS
    assert [layer._gradient_checkpointing_func for layer in layers] == functions
    assert [layer._gradient_checkpointing_func for layer in layers] == functions  # called, never replaced
    speedup.detach()
    assert differences(before, snapshot(model)) == [] and speedup.kept is None


def test_the_measure_is_what_the_layer_keeps_and_scales_with_tokens(one_thread):
    """The bytes measured in the recompute equal what the same layer saves when it is not checkpointed (summed here
    with a plain saved_tensors_hooks around the un-checkpointed model, distinct storages, parameters left out), and
    double with the tokens within a few percent (the attention's T x T weights, saved by the CPU's SDPA, grow faster).
    """
    ids = {n: torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(0)) for n in (64, 128)}

    def unchecked(tokens: int) -> list[int]:
        model = _model(lora=False)
        model.gradient_checkpointing_disable()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        per_layer: list[dict[int, int]] = []

        def pack(t):
            s = t.untyped_storage()
            if per_layer and s.data_ptr() not in params:
                per_layer[-1][s.data_ptr()] = s.nbytes()
            return t

        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *a: per_layer.append({}))
            layer.register_forward_hook(lambda *a: per_layer.append({}))  # what follows is not the layer's
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids[tokens], labels=ids[tokens]).loss.backward()
        return [sum(d.values()) for d in per_layer[0::2]]

    def measured(tokens: int) -> list[int]:
        model = _model(lora=False)
        speedup = SelectiveCheckpointing(mode=True, max_tokens=tokens)
        assert speedup.attach(model)
        model(input_ids=ids[tokens], labels=ids[tokens]).loss.backward()
        layers = speedup.runner.layers
        assert all(layer.measured and layer.tokens == tokens and 0 < layer.mlp_saved < layer.saved for layer in layers)
        return [layer.saved for layer in layers]

    assert measured(64) == unchecked(64) and min(measured(64)) > 0
    assert all(1.9 <= b / a <= 2.3 for a, b in zip(measured(64), measured(128)))


def test_the_longest_micro_batch_is_bounded_by_the_config(tmp_path, caplog):
    args = FastSFTConfig(output_dir=str(tmp_path), bf16=False, per_device_train_batch_size=3, max_length=1000,
                         report_to=[])
    assert max_micro_batch_tokens(args) == 3000
    args.pad_to_multiple_of = 64
    assert max_micro_batch_tokens(args) == 3 * 1024
    args.max_length = None
    assert max_micro_batch_tokens(args) is None
    speedup = SelectiveCheckpointing(mode=True, max_tokens=None)
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.selective_checkpointing"):
        assert speedup.attach(_model()) is False
        assert speedup.attach(_model()) is False
    assert caplog.text.count("longest micro-batch is unknown") == 1


def test_padding_free_rows_without_max_length_are_bounded_by_the_dataset(tmp_path, one_thread, caplog):
    """The notebook recipe (padding-free, unpacked, max_length=None as TRL requires there): the longest micro-batch
    is the batch size x the longest tokenized example, so the speedup engages, with the same training."""
    recipe = dict(packing=False, padding_free=True, max_length=None)
    plain, _ = _train(tmp_path, "qwen3", False, **recipe)
    with caplog.at_level(logging.INFO, logger="nbkit"):
        fast, calls = _train(tmp_path, "qwen3", True, **recipe)
    assert "longest micro-batch is unknown" not in caplog.text
    assert_same_training(plain, fast)
    assert calls == [2 + (STEPS - 1)] * LAYERS
    longest = max(len(ids) for ids in fast.trainer.train_dataset["input_ids"])
    assert f"longest micro-batch of {2 * longest} tokens" in caplog.text


def test_the_dataset_bound_reads_the_longest_example(tmp_path):
    from datasets import Dataset

    from nbkit.speedups import dataset_micro_batch_tokens, longest_example_tokens

    rows = Dataset.from_dict({"input_ids": [[1] * 5, [1] * 130, [1] * 7]})
    args = FastSFTConfig(output_dir=str(tmp_path), bf16=False, per_device_train_batch_size=2, report_to=[])
    assert longest_example_tokens(rows) == 130
    assert longest_example_tokens(rows.select([0, 2])) == 130  # the whole table: an upper bound
    assert dataset_micro_batch_tokens(args, rows) == 260
    args.pad_to_multiple_of = 64
    assert dataset_micro_batch_tokens(args, rows) == 2 * 192
    assert dataset_micro_batch_tokens(args, Dataset.from_dict({"text": ["a"]})) is None
    assert dataset_micro_batch_tokens(args, rows.to_iterable_dataset()) is None


def test_the_switch_takes_true_false_or_auto(tmp_path):
    from nbkit.settings import SettingError

    assert FastSFTConfig(output_dir=str(tmp_path), bf16=False, report_to=[]).selective_checkpointing == "auto"
    for value in (True, False, "auto"):
        config = FastSFTConfig(output_dir=str(tmp_path), bf16=False, report_to=[], selective_checkpointing=value)
        assert config.selective_checkpointing == value
    with pytest.raises(SettingError, match="selective_checkpointing"):
        FastSFTConfig(output_dir=str(tmp_path), bf16=False, report_to=[], selective_checkpointing="always")
    with pytest.raises(SettingError, match="selective_checkpointing"):
        SelectiveCheckpointing(mode="on")


def test_auto_engages_beside_offload(one_thread, monkeypatch):
    """One runner with both modes: step 1 offloads every layer's input; with room, 'auto' keeps every layer (kept
    layers bypass the offload), with none every layer stays checkpointed and offloaded; the same losses and gradients
    either way, and detaching leaves transformers' own flags and functions."""
    plain = _steps(_model())
    for room, kept in ((LIMIT, LAYERS), (0, 0)):
        model = _model()
        found = [layer._gradient_checkpointing_func for layer in layers_of(model)]
        offload = OffloadedCheckpointing(mode=True)
        speedup = SelectiveCheckpointing(mode="auto", max_tokens=64)
        runner = LayerRunner(keep=speedup, offload=offload, readings=lambda device, room=room: (room, 0, 0))
        assert runner.attach(model) and runner.begin_training(model)
        assert runner.keep is speedup and runner.offload is offload
        assert_same_run(_steps(model), plain)
        assert speedup.kept == kept and speedup.engaged is bool(kept)
        assert [p.activations for p in runner.plans] == [OFF] * (LAYERS - kept) + [K] * kept
        # step 1 offloads every layer's input; after it, only the layers still checkpointed
        assert offload.stats.packs == LAYERS + (STEPS - 1) * (LAYERS - kept)
        runner.detach()
        assert [layer._gradient_checkpointing_func for layer in layers_of(model)] == found
        assert [layer.gradient_checkpointing for layer in layers_of(model)] == [True] * LAYERS


def test_eager_attention_is_sized_as_tokens_squared(one_thread, monkeypatch, caplog):
    """Layers measured at 64 tokens and sized for 64 x 1000: 1000 x what they saved with SDPA, 1000**2 x with eager
    attention (its probabilities are tokens x tokens); said with the plan."""
    monkeypatch.setattr(layer_budget, "memory_readings", lambda device: (0, 0, 0))  # nothing to spend
    sized = {}
    for attn in ("sdpa", "eager"):
        model = _model()
        model.get_base_model().config._attn_implementation = attn
        speedup = SelectiveCheckpointing(mode="auto", max_tokens=64 * 1000)
        assert speedup.attach(model)
        with caplog.at_level(logging.INFO, logger="nbkit"):
            _steps(model, 2)
        runner = speedup.runner
        assert runner.max_tokens == 64 * 1000 and speedup.kept == 0
        sized[attn] = [c.kept / layer.saved for c, layer in zip(runner.costs, runner.layers)]
        speedup.detach()
    assert sized["sdpa"] == pytest.approx([1000] * LAYERS, rel=1e-6)
    assert sized["eager"] == pytest.approx([1000**2] * LAYERS, rel=1e-6)
    assert caplog.text.count("(eager attention: as tokens squared)") == 1


# ---------------------------------------------------------------------------------------------------------------
# the second look: the plan's measured peak


def _looked_run(model, runner, steps: int, accumulation: int = 1):
    """``steps`` micro-batches by hand, ``runner.optimizer_stepped()`` after every ``accumulation``-th as the
    trainer's ``on_optimizer_step`` calls it, the gradients recorded after each (no optimizer: the weights stay, so
    every micro-batch must give the same loss)."""
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
    done = [0]

    def backward(loss):
        loss.backward()
        done[0] += 1
        if done[0] % accumulation == 0:
            runner.optimizer_stepped()

    return run_steps(model, [dict(input_ids=ids, labels=ids)] * steps, backward=backward)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_the_second_look_keeps_more_layers_where_the_plan_left_room(one_thread, monkeypatch, accumulation):
    """The plan keeps 1 layer; after the first optimizer step that ran with it, the measured peak leaves room for 2
    more, paid as the difference from their present state: 3 kept from then on, the losses and gradients bitwise
    those of plain checkpointing, and the looks come exactly when the contract says (at micro-batch 2, and at the
    first after the optimizer step that followed it)."""
    plain = _steps(_model(), 8)
    model = _model()
    calls = count_attention_calls(model)
    speedup = SelectiveCheckpointing(mode=True, max_tokens=64, accumulation=accumulation)
    readings = looks(lambda: speedup.runner, lambda c: whole(c, 3), lambda c: whole(c, 1, 2))
    monkeypatch.setattr(layer_budget, "memory_readings", readings)
    assert speedup.attach(model)
    runner = speedup.runner
    assert_same_run(_looked_run(model, runner, 8, accumulation), plain)
    looked_at = 3 if accumulation == 1 else accumulation + 1  # the first micro-batch of the second optimizer step
    assert readings.at == [2, looked_at]
    assert speedup.kept == 3 and speedup.added == 2 and runner.kept_by_first == 1
    assert [p.activations for p in runner.plans] == [C, K, K, K]
    # layer 0 recomputes every micro-batch; layers 1-2 until the second look; layer 3 from micro-batch 2 on
    assert calls == [16, 8 + looked_at - 1, 8 + looked_at - 1, 9]
    speedup.detach()
    assert [layer.gradient_checkpointing for layer in layers_of(model)] == [True] * LAYERS


@pytest.mark.parametrize("max_tokens, added", [(64, 2), (256, 0)])
def test_the_second_look_scales_the_peak_to_the_longest_micro_batch(one_thread, monkeypatch, max_tokens, added):
    """Step 1 saw 64 tokens; the config allows ``max_tokens``. At 256 the peak's part above what is held between
    micro-batches counts 4 times, so room that holds 2 more layers at 64 holds none."""
    model = _model()
    speedup = SelectiveCheckpointing(mode=True, max_tokens=max_tokens)
    monkeypatch.setattr(layer_budget, "memory_readings", looks(
        lambda: speedup.runner, lambda c: whole(c, 3), lambda c: whole(c, 1, 2), held=LIMIT // 4))
    assert speedup.attach(model)
    _looked_run(model, speedup.runner, 4)
    assert speedup.added == added and speedup.kept == 1 + added


def test_the_second_look_counts_reserved_memory_where_it_is_more(one_thread, monkeypatch):
    """CUDA graphs' pools are reserved, not allocated: reserved memory above the peak leaves no room."""
    model = _model()
    speedup = SelectiveCheckpointing(mode=True, max_tokens=64)
    monkeypatch.setattr(layer_budget, "memory_readings", looks(
        lambda: speedup.runner, lambda c: whole(c, 3), lambda c: whole(c, 1, 2)))
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: int(LIMIT * (1 - MARGIN)))
    assert speedup.attach(model)
    _looked_run(model, speedup.runner, 4)
    assert speedup.added == 0 and speedup.kept == 1


def test_no_second_look_without_the_trainers_call_or_when_every_layer_is_kept(one_thread, monkeypatch):
    model = _model()
    speedup = SelectiveCheckpointing(mode=True, max_tokens=64)
    readings = looks(lambda: speedup.runner, lambda c: whole(c, 3), lambda c: whole(c, 1, 2))
    monkeypatch.setattr(layer_budget, "memory_readings", readings)
    assert speedup.attach(model)
    _steps(model, 4)  # a hand-written loop without runner.optimizer_stepped(): the first look only
    assert speedup.kept == 1 and speedup.added is None and readings.at == [2]
    speedup.detach()
    speedup = SelectiveCheckpointing(mode=True, max_tokens=64)
    readings = looks(lambda: speedup.runner, lambda c: whole(c, 0, 1, 2, 3))
    monkeypatch.setattr(layer_budget, "memory_readings", readings)
    assert speedup.attach(model)
    _looked_run(model, speedup.runner, 4)
    assert speedup.kept == LAYERS and speedup.added is None and readings.at == [2]  # nothing left to look for


def test_the_trainer_passes_its_accumulation(tmp_path):
    args = FastSFTConfig(output_dir=str(tmp_path), bf16=False, report_to=[], gradient_checkpointing=True,
                         gradient_accumulation_steps=3, selective_checkpointing=True, max_length=128)
    runners = [s for s in build("model", args, packed_batches=True) if s.name == RUNNER]
    assert len(runners) == 1 and isinstance(runners[0].keep, SelectiveCheckpointing)
    keep = runners[0].keep
    assert keep.accumulation == 3 and keep.max_tokens == 128 * args.per_device_train_batch_size
