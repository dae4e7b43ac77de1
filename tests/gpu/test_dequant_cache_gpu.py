"""``dequant_cache`` on a CUDA GPU: a QLoRA FastSFT run with its defaults keeps the dequantized weights ("auto" on a
GPU with room), dequantizes only in its first micro-batch (the layer plan keeps the copies at the first layer call of
the second), and trains bit for bit as the run that dequantizes every call (the kept tensor is the dequantization's
result; the CUDA graphs captured after the decision read it).

Tolerance: none; losses and every step's LoRA gradients equal.
"""

from __future__ import annotations

import pytest
import torch
from grad_steps import StepGrads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4)
STEPS = 4


def _train(tmp_path, tag: str, cache, monkeypatch, **kw):
    import nbkit.speedups.fused_lora as fused_lora
    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.loading import load_model
    from nbkit.speedups.nf4_weights import kept_weight

    tok = load_demo_tokenizer()
    folder = tmp_path / "base"
    if not (folder / "config.json").exists():
        tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, seed=0, **SHAPE).save_pretrained(folder)
        tok.save_pretrained(folder)
    torch.manual_seed(0)
    model, _ = load_model(str(folder), load_in_4bit=True, dtype=torch.bfloat16, lora_r=8)
    args = FastSFTConfig(output_dir=str(tmp_path / tag), max_steps=STEPS, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, packing=True, max_length=512, bf16=True, learning_rate=1e-2,
                         optim="sgd", logging_steps=1, report_to=[], save_strategy="no", seed=0,
                         shuffle_dataset=False, live_dashboard=False, dequant_cache=cache, **kw)
    grads = StepGrads()
    torch.manual_seed(0)
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=300), processing_class=tok,
                      callbacks=[grads])
    calls: list[int] = []  # the micro-batch of each dequantization a fused layer asked for (no kept copy to read)
    micro_batches = [0]
    trainer.model.register_forward_pre_hook(
        lambda module, args: micro_batches.__setitem__(0, micro_batches[0] + module.training))
    real = fused_lora.weight_of

    def counted(base, dtype):
        if kept_weight(base, dtype) is None:
            calls.append(micro_batches[0])
        return real(base, dtype)

    monkeypatch.setattr(fused_lora, "weight_of", counted)
    trainer.train()
    monkeypatch.setattr(fused_lora, "weight_of", real)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, grads.steps, calls, trainer.nbkit_attached


def test_kept_weights_train_bit_for_bit_as_dequantizing_each_call(tmp_path, monkeypatch):
    plain = _train(tmp_path, "plain", False, monkeypatch)
    kept = _train(tmp_path, "kept", "auto", monkeypatch)
    print(f"attached {kept[3]}; dequantizations per micro-batch: plain {sorted(set(plain[2]))}, kept "
          f"{sorted(set(kept[2]))}; losses {plain[0]} vs {kept[0]}")
    assert "dequant_cache" in kept[3] and "dequant_cache" not in plain[3]
    assert "cuda_graphs" in kept[3]  # the graphs were captured after the decision, reading the kept copies
    assert set(kept[2]) == {1}, "a fused layer dequantized after the copies were kept"
    assert max(plain[2]) >= 2  # the plain run dequantizes after step 1 too (eagerly, or inside the graphs it captures)
    assert kept[0] == plain[0]
    assert len(kept[1]) == len(plain[1]) == STEPS
    for a, b in zip(kept[1], plain[1]):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_a_peak_an_earlier_cell_left_does_not_starve_the_plan(tmp_path, monkeypatch):
    """A cell before ``train()`` that peaked near the GPU's limit (most of its free memory in one tensor, freed again:
    a larger run, a step that ran out of memory) leaves the plan as without it: the budget reads this run's peak."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    big = torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.empty_cache()
    assert torch.cuda.max_memory_allocated() > 0.8 * free  # the stale peak the run starts beside
    kept = _train(tmp_path, "after_a_peak", "auto", monkeypatch)
    assert "dequant_cache" in kept[3], kept[3]
    assert set(kept[2]) == {1}
    assert torch.cuda.max_memory_allocated() < 0.5 * free  # the peak is the run's
