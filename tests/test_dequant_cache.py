"""``dequant_cache``: fused LoRA layers read a kept dequantized copy of their 4-bit base, bit for bit the same (CPU).

bitsandbytes quantizes and dequantizes NF4 on a CPU, so the whole path runs here: the parity is exact (the kept
tensor is the dequantization's result), the copy is what the layers read (no dequantization while it is kept), the
layer plan decides it at the first layer call of the second training forward, "auto" keeps the weights of the last
layers that fit in the budget given by fake memory readings (after the activations), and a FastSFT run with it
trains as one without.
"""

from __future__ import annotations

import logging

import pytest
import torch
from parity import assert_same_run, assert_same_tensors, fast_sft, tiny_lm, train
from torch import nn

from nbkit.memory import fmt_bytes
from nbkit.speedups import layer_budget
from nbkit.speedups.dequant_cache import DEQUANTIZED, DequantCache, kept_bytes
from nbkit.speedups.fused_lora import FusedLoRA
from nbkit.speedups.layer_budget import MARGIN, SHARE
from nbkit.speedups.layer_plan import KEPT
from nbkit.speedups.layer_runner import LayerRunner
from nbkit.speedups.nf4_weights import kept_weight, weight_of
from nbkit.speedups.selective_checkpointing import SelectiveCheckpointing

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYERS = tiny_lm("qwen3").config.num_hidden_layers


def four_bit(model: nn.Module) -> nn.Module:
    """Every projection of ``model`` as an NF4 ``Linear4bit`` (fp32 compute, quantized on the CPU by ``.to``)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in PROJECTIONS and type(child) is nn.Linear:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True)
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                             compress_statistics=True, module=q)
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(module, child_name, q.to("cpu"))
    return model


def _lora_model(seed: int = 0) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = four_bit(tiny_lm("qwen3", seed=seed))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS), lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)  # PEFT starts B at zero; non-zero makes the base's input gradient count
    return model.train()  # the layer plan runs in training forwards


def _all_bytes(model: nn.Module, itemsize: int) -> int:
    """What every 4-bit base of ``model`` takes dequantized, ``itemsize`` bytes an element."""
    return sum(p.quant_state.shape.numel() * itemsize for n, p in model.named_parameters()
               if "base_layer" in n and hasattr(p, "quant_state"))


def _kept_layers(model: nn.Module) -> list[int]:
    """The decoder layers whose 4-bit bases hold a kept copy (all of a layer's or none)."""
    layers = model.base_model.model.model.layers
    held = [[DEQUANTIZED in vars(m) for m in layer.modules() if isinstance(m, bnb.nn.Linear4bit)] for layer in layers]
    assert all(len(set(h)) == 1 for h in held), held
    return [i for i, h in enumerate(held) if h[0]]


def _step(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), **grads}


def _counted_dequantize(monkeypatch) -> list[int]:
    """A counter of the dequantizations fused layers ask for (their weight wanted with no kept copy to read)."""
    calls = [0]
    real = weight_of

    def counted(base, dtype):
        calls[0] += kept_weight(base, dtype) is None
        return real(base, dtype)

    monkeypatch.setattr("nbkit.speedups.fused_lora.weight_of", counted)
    return calls


def test_kept_weights_give_the_same_outputs_and_gradients_bit_for_bit(one_thread, monkeypatch):
    model = _lora_model()
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    fused = FusedLoRA()
    assert fused.attach(model) and fused.fused_layers == LAYERS * len(PROJECTIONS)
    calls = _counted_dequantize(monkeypatch)
    try:
        cache = DequantCache(mode=True, dtype=torch.float32)
        assert cache.attach(model)
        plain = _step(model, ids)  # step 1: dequantized at each call
        per_step = calls[0]
        # every base in the forward, and in backward each whose input needs a gradient (not the first q, k, v)
        assert per_step == 2 * fused.fused_layers - 3
        assert not cache.engaged and cache.kept_bytes == 0 and kept_bytes(model) == 0  # decided at the 2nd forward
        calls[0] = 0
        cached = _step(model, ids)
        assert cache.engaged and cache.kept_bytes == kept_bytes(model) == _all_bytes(model, 4)
        assert calls[0] == 0, "a fused layer dequantized although its weight is kept"
        assert_same_tensors(cached, plain)  # bitwise
        runner = cache.runner
        assert all(p.dequantized for p in runner.plans) and runner.line == f"{LAYERS} layers: {LAYERS} kept; weights dequantized"
        _step(model, ids)
        assert cache.kept_bytes == _all_bytes(model, 4)  # decided once
        cache.detach()
        assert not any(DEQUANTIZED in vars(m) for m in model.modules())
        again = _step(model, ids)
        assert calls[0] == per_step  # dequantizing again once the copies are dropped
        assert_same_tensors(again, plain)
    finally:
        fused.detach()


def test_a_changed_kept_copy_changes_the_step(one_thread):
    """Negative control: the layers do read the kept tensor (a perturbed copy changes loss and gradients)."""
    model = _lora_model()
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    fused, cache = FusedLoRA(), DequantCache(mode=True, dtype=torch.float32)
    assert fused.attach(model) and cache.attach(model)
    try:
        _step(model, ids)
        plain = _step(model, ids)  # the second forward: the copies kept at its first layer call
        assert cache.engaged
        base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        vars(base)[DEQUANTIZED].mul_(1.01)
        assert not torch.equal(_step(model, ids)["loss"], plain["loss"])
    finally:
        cache.detach()
        fused.detach()


def test_a_copy_in_another_dtype_is_not_used(one_thread, monkeypatch):
    """A copy kept in bf16 is not handed to an fp32 step: the layer dequantizes as before (same numbers)."""
    model = _lora_model()
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    fused, cache = FusedLoRA(), DequantCache(mode=True, dtype=torch.bfloat16)
    assert fused.attach(model) and cache.attach(model)
    calls = _counted_dequantize(monkeypatch)
    try:
        plain = _step(model, ids)
        per_step, calls[0] = calls[0], 0
        assert_same_tensors(_step(model, ids), plain)
        assert cache.engaged  # kept in bf16, not read
        assert calls[0] == per_step > 0
    finally:
        cache.detach()
        fused.detach()


def _readings(runner_of, want):
    """Fake readings whose first look spends ``want(runner.costs)`` bytes (2 more: rounding)."""
    limit = 1 << 40

    def readings(device):
        runner = runner_of()
        if runner is None or not runner.costs:  # the mode's check, step 1's start
            return limit, 0, 0
        return limit, int(limit * (1 - MARGIN) - (want(runner.costs) + 2) / SHARE), 0

    return readings


@pytest.mark.parametrize("layers", [LAYERS, 2, 0])
def test_auto_keeps_the_weights_of_the_last_layers_that_fit(layers, one_thread, monkeypatch, caplog):
    """'auto' with the budget of ``layers`` layers' weights: those of the last ``layers`` layers are kept, from the
    second forward on, said in the plan's line; the same outputs either way."""
    model = _lora_model()
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    fused, cache = FusedLoRA(), DequantCache(mode="auto", dtype=torch.bfloat16)
    monkeypatch.setattr(layer_budget, "memory_readings", _readings(
        lambda: cache.runner, lambda costs: sum(c.weights for c in costs[LAYERS - layers:])))
    assert fused.attach(model) and cache.attach(model)
    try:
        with caplog.at_level(logging.INFO, logger="nbkit"):
            _step(model, ids)
            assert kept_bytes(model) == 0
            _step(model, ids)
        assert _kept_layers(model) == list(range(LAYERS - layers, LAYERS))
        assert cache.engaged is bool(layers) and cache.kept_bytes == kept_bytes(model) == layers * _all_bytes(model, 2) // LAYERS
        weights = {LAYERS: "weights dequantized", 0: "weights 4-bit"}.get(
            layers, f"weights dequantized in {layers}, 4-bit in {LAYERS - layers}")
        assert caplog.text.count(f"{LAYERS} layers: {LAYERS} kept; {weights} (") == 1
    finally:
        cache.detach()
        fused.detach()
    assert kept_bytes(model) == 0


def test_the_second_look_keeps_the_weights_the_first_left(one_thread, monkeypatch):
    """The first look has room for the last layer's weights; after the first optimizer step that ran with the plan
    (``runner.optimizer_stepped()``, as the trainer calls it), the second has room for the others' as well."""
    model = _lora_model()
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    fused, cache = FusedLoRA(), DequantCache(mode="auto", dtype=torch.bfloat16)
    wants = iter([lambda costs: costs[-1].weights, lambda costs: sum(c.weights for c in costs[:-1])])
    want = [None]

    def readings(device):
        runner = cache.runner
        if runner is None or not runner.costs:
            return 1 << 40, 0, 0
        return _readings(lambda: runner, want[0])(device)

    monkeypatch.setattr(layer_budget, "memory_readings", readings)
    assert fused.attach(model) and cache.attach(model)
    try:
        want[0] = next(wants)
        _step(model, ids)
        _step(model, ids)
        assert _kept_layers(model) == [LAYERS - 1]
        cache.runner.optimizer_stepped()
        want[0] = next(wants)
        _step(model, ids)
        assert _kept_layers(model) == list(range(LAYERS)) and cache.kept_bytes == _all_bytes(model, 2)
        assert cache.runner.line == f"{LAYERS} layers: {LAYERS} kept; weights dequantized"
    finally:
        cache.detach()
        fused.detach()


def test_weights_are_planned_after_the_activations(one_thread, monkeypatch):
    """One budget for both: room for every layer's activations and one layer's weights keeps every layer's
    activations and the last layer's weights; the same training as plain checkpointing dequantizing at each call."""
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))

    def run(keep: bool):
        model = _lora_model()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        fused = FusedLoRA()
        assert fused.attach(model)
        if not keep:
            return [_step(model, ids) for _ in range(3)], None, fused
        runner = LayerRunner(keep=SelectiveCheckpointing(mode="auto", max_tokens=16),
                             dequant=DequantCache(mode="auto", dtype=torch.float32),
                             readings=_readings(lambda: runner, lambda costs: sum(
                                 c.kept - c.input for c in costs) + costs[-1].weights))
        assert runner.attach(model) and runner.begin_training(model)
        return [_step(model, ids) for _ in range(3)], runner, fused

    plain, _, fused = run(False)
    fused.detach()
    kept, runner, fused = run(True)
    try:
        for a, b in zip(kept, plain):
            assert_same_tensors(a, b)
        assert [p.activations for p in runner.plans] == [KEPT] * LAYERS
        assert [p.dequantized for p in runner.plans] == [False] * (LAYERS - 1) + [True]
        assert runner.line == f"{LAYERS} layers: {LAYERS} kept; weights dequantized in 1, 4-bit in {LAYERS - 1}"
    finally:
        runner.detach()
        fused.detach()


def test_the_oom_tips_count_the_kept_copies(one_thread):
    """While copies are kept, the first fit suggestion is to turn them off, with their bytes; none after detach."""
    from types import SimpleNamespace

    from nbkit.reliability.oom import fit_suggestions

    args = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_length=4096,
                           packing=True, gradient_checkpointing=True, offload_checkpointing="auto")
    model = _lora_model()
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    fused, cache = FusedLoRA(), DequantCache(mode=True, dtype=torch.bfloat16)
    assert fused.attach(model) and cache.attach(model)
    try:
        assert not any("dequant_cache" in t for t in fit_suggestions(args, model))
        _step(model, ids)
        _step(model, ids)
        tips = fit_suggestions(args, model)
        assert cache.kept_bytes == _all_bytes(model, 2) > 0
        assert tips[0] == f"dequant_cache=False (gives back the {fmt_bytes(cache.kept_bytes)} of 4-bit weights it " \
                          "keeps dequantized)", tips
    finally:
        cache.detach()
        fused.detach()
    assert not any("dequant_cache" in t for t in fit_suggestions(args, model))


def test_auto_stays_off_without_cuda_memory_readings(one_thread):
    assert DequantCache(mode="auto").attach(_lora_model()) is False
    assert DequantCache(mode=False).attach(_lora_model()) is False
    assert DequantCache(mode=True).attach(tiny_lm("qwen3")) is False  # no 4-bit base: nothing to keep


def test_fastsft_trains_the_same_with_the_kept_copies(tmp_path, one_thread):
    """A whole FastSFT run (4-bit bases, fp32 compute, 3 steps) with ``dequant_cache=True``: the same losses and
    LoRA weights bit for bit as with it off; listed as attached; nothing left on the model after train()."""

    from nbkit.demo.tokenizer import load_demo_tokenizer

    tokenizer = load_demo_tokenizer()

    def run(on: bool):
        model = four_bit(tiny_lm("qwen3", tokenizer=tokenizer, seed=0))
        trainer = fast_sft(tmp_path / str(on), model=model, tokenizer=tokenizer, dequant_cache=on, max_steps=3)
        return train(trainer, grads=True)

    with_copies, without = run(True), run(False)
    assert "dequant_cache" in with_copies.trainer.nbkit_attached
    assert "dequant_cache" not in without.trainer.nbkit_attached
    assert_same_run(with_copies, without)
    assert not any(DEQUANTIZED in vars(m) for m in with_copies.trainer.model.modules())
