"""Reliability on a CUDA GPU: a real out-of-memory error caught at the step, and fp16's non-finite skip.

- OOM: a 4-layer model of hidden size 2048 (bf16, full fine-tuning, no checkpointing) is given 64 rows of 16,384
  tokens in one step, about 1M tokens whose activations need several hundred GB: far beyond any single GPU. FastSFT
  must raise ``TrainingOutOfMemoryError`` (a ``torch.OutOfMemoryError``) naming step 1, the memory figures and the
  settings to change; the memory of the failed step must be given back (allocated memory back within 1 GiB of what
  it was before ``train()``); and the first suggestion taken further (one row per micro-batch) must then train.
- fp16 + ``on_nonfinite_loss="skip"``: a NaN injected in one document makes one step's loss NaN; the GradScaler
  must skip that step (LoRA weights bit-identical across it, the loss scale halved) and training must go on. This
  path (the GradScaler's own skip) has no CPU equivalent.

Run: ``python -m pytest -q tests/gpu/test_oom_gpu.py`` (about 30 s on an H200).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GIB = 2**30


def _config(tmp_path, **kw):
    from nbkit import FastSFTConfig

    base = dict(output_dir=str(tmp_path), max_steps=1, learning_rate=1e-4, logging_steps=1, report_to=[],
                save_strategy="no", disable_tqdm=True, live_dashboard=False, dataloader_num_workers=0,
                gradient_checkpointing=False, seed=0)
    return FastSFTConfig(**{**base, **kw})


def test_real_oom_is_explained_freed_and_the_suggestion_fits(tmp_path):
    from datasets import Dataset

    from nbkit import FastSFT
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.reliability.oom import TrainingOutOfMemoryError

    tokenizer = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tokenizer), dtype=torch.bfloat16, hidden_size=2048, intermediate_size=8192,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       pad_token_id=tokenizer.pad_token_id).cuda()
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, len(tokenizer), (64, 16384), generator=g).tolist()
    dataset = Dataset.from_dict({"input_ids": rows})
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    trainer = FastSFT(model=model, args=_config(tmp_path, per_device_train_batch_size=64, max_length=None,
                                                bf16=True), train_dataset=dataset, processing_class=tokenizer)
    with pytest.raises(TrainingOutOfMemoryError) as caught:
        trainer.train()
    message = str(caught.value)
    print(message)
    assert isinstance(caught.value, torch.OutOfMemoryError)
    assert message.startswith("Step 1 ran out of memory.")
    for word in ("allocated", "reserved", "total", "peak", "cuda:"):
        assert word in message
    assert "per_device_train_batch_size=32 with gradient_accumulation_steps=2" in message
    assert "gradient_checkpointing=True" in message
    after = torch.cuda.memory_allocated()
    assert after - before < GIB, f"{(after - before) / GIB:.2f} GiB still held after the OOM"

    del trainer
    trainer = FastSFT(model=model, args=_config(tmp_path, per_device_train_batch_size=1,
                                                gradient_accumulation_steps=2, max_length=None, bf16=True),
                      train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    assert trainer.state.global_step == 1
    assert torch.cuda.max_memory_allocated() <= torch.cuda.get_device_properties(0).total_memory


def test_fp16_nonfinite_step_is_skipped_by_the_grad_scaler(tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    from nbkit import FastSFT
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tokenizer = load_demo_tokenizer()
    rows = make_dataset("messages", n=48).to_list()
    rows[30]["messages"][0]["content"] += f" {tokenizer.pad_token}"  # the marker whose embedding turns NaN
    marker = tokenizer.pad_token_id
    model = tiny_model("qwen3", len(tokenizer), pad_token_id=marker, eos_token_id=tokenizer.eos_token_id).cuda()
    model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: output.masked_fill((inputs[0] == marker)[..., None], float("nan")))
    trainer = FastSFT(model=model, args=_config(tmp_path, max_steps=4, per_device_train_batch_size=2, max_length=64,
                                                packing=True, assistant_only_loss=True, fp16=True,
                                                on_nonfinite_loss="skip", learning_rate=3e-3),
                      train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                      peft_config=LoraConfig(r=4, target_modules="all-linear"))
    [batch] = [i for i, b in enumerate(trainer.get_train_dataloader()) if (b["input_ids"] == marker).any()]

    def weights():
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    snapshots, scales = {0: weights()}, {0: trainer.accelerator.scaler.get_scale()}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots[state.global_step] = weights()
            scales[state.global_step] = trainer.accelerator.scaler.get_scale()

    trainer.add_callback(Snapshot())
    trainer.train()
    assert trainer.accelerator.scaler is not None and trainer.state.global_step == 4
    [event] = trainer.nbkit_skipped
    assert event.step == batch + 1
    for s in range(1, 5):
        same = all(torch.equal(snapshots[s][n], snapshots[s - 1][n]) for n in snapshots[s])
        scaler_skipped = scales[s] < scales[s - 1]  # the scaler also skips fp16 overflows of its own
        if s == event.step:
            assert same and scaler_skipped, s
        elif not scaler_skipped:
            assert not same, s
    assert all(torch.isfinite(t).all() for t in snapshots[4].values())
