"""``dequant_cache``: fused LoRA layers read a kept dequantized copy of their 4-bit base, bit for bit the same (CPU).

bitsandbytes quantizes and dequantizes NF4 on a CPU, so the whole path runs here: the parity is exact (the kept
tensor is the dequantization's result), the copy is what the layers read (no dequantization while it is kept), the
"auto" decision follows the memory readings it is given, and a FastSFT run with it trains as one without.
"""

from __future__ import annotations

import logging

import pytest
import torch
from parity import assert_same_run, assert_same_tensors, fast_sft, tiny_lm, train
from torch import nn

from nbkit.memory import MemoryReadings
from nbkit.speedups import dequant_cache as cache_mod
from nbkit.speedups.dequant_cache import DEQUANTIZED, DequantCache
from nbkit.speedups.fused_lora import FusedLoRA

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
    return model


def _step(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), **grads}


def _counted_dequantize(monkeypatch) -> list[int]:
    calls = [0]
    real = cache_mod.dequantize

    def counted(base, dtype):
        calls[0] += 1
        return real(base, dtype)

    monkeypatch.setattr("nbkit.speedups.fused_lora.dequantize", counted)
    return calls


def test_kept_weights_give_the_same_outputs_and_gradients_bit_for_bit(one_thread, monkeypatch):
    model = _lora_model()
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    fused = FusedLoRA()
    assert fused.attach(model) and fused.fused_layers == LAYERS * len(PROJECTIONS)
    calls = _counted_dequantize(monkeypatch)
    try:
        plain = _step(model, ids)
        per_step = calls[0]
        # every base in the forward, and in backward each whose input needs a gradient (not the first q, k, v)
        assert per_step == 2 * fused.fused_layers - 3
        cache = DequantCache(mode=True, dtype=torch.float32)
        assert cache.attach(model)
        assert cache.before_micro_batch(1) == 0 and not cache.engaged  # decides before the second micro-batch
        kept = cache.before_micro_batch(2)
        assert cache.engaged and kept == sum(p.quant_state.shape.numel() * 4 for n, p in model.named_parameters()
                                             if "base_layer" in n and hasattr(p, "quant_state"))
        calls[0] = 0
        cached = _step(model, ids)
        assert calls[0] == 0, "a fused layer dequantized although its weight is kept"
        assert_same_tensors(cached, plain)  # bitwise
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
        cache.before_micro_batch(2)
        plain = _step(model, ids)
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
        cache.before_micro_batch(2)
        assert_same_tensors(_step(model, ids), plain)
        assert calls[0] == per_step > 0
    finally:
        cache.detach()
        fused.detach()


@pytest.mark.parametrize("left_gib, reserved_gib, keeps", [(100.0, 0.0, True), (100.0, 99.0, False),
                                                           (1.0, 0.0, False)])
def test_auto_keeps_all_or_none_by_the_memory_left(left_gib, reserved_gib, keeps, one_thread, monkeypatch, caplog):
    """'auto': all copies when they fit in SHARE of what is left after the margin, the peak, the growth and the
    bytes planned before it (``reserved``); else none, said with the numbers."""
    gib = 2**30
    model = _lora_model()
    need = sum(p.quant_state.shape.numel() * 2 for n, p in model.named_parameters()
               if "base_layer" in n and hasattr(p, "quant_state"))
    # the memory left scaled so that the copies' size decides: left_gib "GiB" here is left_gib * need / 10 bytes
    scale = need / 10 / gib
    limit = int(200 * gib * scale)
    peak = int(limit * (1 - cache_mod.MARGIN)) - int(left_gib * gib * scale)
    monkeypatch.setattr(cache_mod, "memory_readings", lambda device: MemoryReadings(limit, peak, 0))
    monkeypatch.setattr(cache_mod, "gpu_in_use", lambda device: 0)
    cache = DequantCache(mode="auto", dtype=torch.bfloat16)
    assert cache.attach(model)
    with caplog.at_level(logging.INFO, logger="nbkit.speedups.dequant_cache"):
        kept = cache.before_micro_batch(2, reserved=int(reserved_gib * gib * scale))
    try:
        assert cache.engaged is keeps and (kept == need) is keeps
        assert any(n for n in (DEQUANTIZED in vars(m) for m in model.modules())) is keeps
        assert ("not kept" in caplog.text) is not keeps
        assert cache.before_micro_batch(3) == kept  # decided once
    finally:
        cache.detach()


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
