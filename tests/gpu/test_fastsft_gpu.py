"""FastSFT vs SFTTrainer on a CUDA GPU in bf16, every switch at its default: the same losses.

Tolerance: per-step losses within 2e-2 relative (bf16 autocast; different kernels sum in different orders) and
the first step's loss (before any update) within 5e-3.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_fastsft_matches_sfttrainer_in_bf16(tmp_path, family):
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    data = make_dataset("messages", n=400, split="train", seed=0)
    extra = {"moe_intermediate_size": 128} if family == "qwen3_moe" else {}

    def run(trainer_cls, config_cls, **kw):
        model = tiny_model(family, len(tok), dtype=torch.bfloat16, pad_token_id=tok.pad_token_id, **SHAPE, **extra)
        args = config_cls(output_dir=str(tmp_path / trainer_cls.__name__), max_steps=4, per_device_train_batch_size=8,
                          packing=True, max_length=512, bf16=True, learning_rate=1e-3, logging_steps=1,
                          report_to=[], save_strategy="no", seed=0, assistant_only_loss=True, **kw)
        trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tok,
                              peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        trainer.train()
        return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    _, plain = run(SFTTrainer, SFTConfig)
    fast, ours = run(FastSFT, FastSFTConfig, live_dashboard=False)
    print(family, fast.nbkit_attached, plain, ours)
    assert any(s.startswith("cached_packing(varlen") or s.startswith("cached_packing(flash") for s in fast.nbkit_attached)
    if family == "qwen3_moe":
        assert any("moe" in s for s in fast.nbkit_attached), fast.nbkit_attached
    assert abs(ours[0] - plain[0]) <= 5e-3 * abs(plain[0])
    for a, b in zip(plain, ours):
        assert abs(a - b) <= 2e-2 * abs(a)
