"""``sync_free_metrics`` on a CUDA GPU: the host syncs of one training micro-step's ``compute_loss`` (forward and
loss, speedups attached as in ``train()``), counted with ``torch.cuda.set_sync_debug_mode("warn")`` (one warning per
sync): TRL's own path reads its metrics on the host (several syncs); the sync-free path leaves only what the model's
forward does itself (TRL's fused LM head selects the labelled positions with a boolean mask and scatters them back:
not nbkit's to remove here). Also the logged values of a short bf16 run with the switch on and off agree (2e-2: kernels)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _trainer(tmp_path, sync_free):
    from peft import LoraConfig

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tok), dtype=torch.bfloat16, pad_token_id=tok.pad_token_id, seed=0)
    args = FastSFTConfig(output_dir=str(tmp_path / str(sync_free)), max_steps=3, per_device_train_batch_size=2,
                         packing=True, max_length=512, bf16=True, logging_steps=1, report_to=[], save_strategy="no",
                         seed=0, live_dashboard=False, sync_free_metrics=sync_free, shuffle_dataset=False)
    torch.manual_seed(0)
    return FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=200), processing_class=tok,
                   peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


def _syncs(trainer) -> list[str]:
    batch = next(iter(trainer.get_train_dataloader()))
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    trainer.model.train()
    with trainer.nbkit_speedups():
        trainer.compute_loss(trainer.model, dict(batch))  # warm-up (kernel probes, first launches)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = trainer.compute_loss(trainer.model, dict(batch))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        loss.backward()
    return [str(w.message)[:120] for w in caught if "synchroniz" in str(w.message).lower()]


def test_the_metrics_add_no_host_sync(tmp_path):
    plain, fast = _syncs(_trainer(tmp_path, False)), _syncs(_trainer(tmp_path, True))
    print(f"host syncs in compute_loss: TRL's {len(plain)}, sync-free {len(fast)}")
    assert len(plain) >= len(fast) + 3, (plain, fast)  # the metric reads are gone; what is left is the forward's


def test_logged_values_agree(tmp_path):
    logs = {}
    for sync_free in (False, True):
        trainer = _trainer(tmp_path, sync_free)
        trainer.train()
        logs[sync_free] = [h for h in trainer.state.log_history if "loss" in h]
    for a, b in zip(logs[False], logs[True]):
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
            assert b[key] == pytest.approx(a[key], rel=2e-2), (key, a[key], b[key])
