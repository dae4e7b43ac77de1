"""``sync_free_metrics`` and the deferred non-finite check on a CUDA GPU, host syncs counted with
``torch.cuda.set_sync_debug_mode("warn")`` (one warning per sync).

- One micro-step's ``compute_loss`` (forward and loss, speedups attached as in ``train()``): TRL's own path reads its
  metrics on the host and selects the labelled positions with a boolean mask (several syncs); the sync-free path,
  with the positions listed by the collator (``labelled_head``), reads nothing.
- Whole training micro-steps inside ``train()`` (forward, backward, the non-finite flags), after the CUDA graphs are
  captured: none reads anything on the host; with ``sync_free_metrics`` off (the control) they do.
- The logged values of a short bf16 run with the switch on and off agree (2e-2: kernels)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _trainer(tmp_path, sync_free, **settings):
    from peft import LoraConfig

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tok), dtype=torch.bfloat16, pad_token_id=tok.pad_token_id, seed=0)
    fields = dict(max_steps=3, per_device_train_batch_size=2, packing=True, max_length=512, bf16=True, logging_steps=1,
                  report_to=[], save_strategy="no", seed=0, live_dashboard=False, sync_free_metrics=sync_free,
                  shuffle_dataset=False)
    args = FastSFTConfig(output_dir=str(tmp_path / str(sync_free)), **(fields | settings))
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


def test_the_forward_reads_nothing_on_the_host(tmp_path):
    plain, fast = _syncs(_trainer(tmp_path, False)), _syncs(_trainer(tmp_path, True))
    print(f"host syncs in compute_loss: TRL's {len(plain)}, sync-free {len(fast)}")
    assert len(plain) >= 4, plain  # the control: the metric reads and the mask's selection are seen
    assert fast == [], fast


def _training_step_syncs(trainer, steps: int) -> list[list[str]]:
    """The sync warnings of each training micro-step of ``trainer.train()`` (the trainer's whole ``training_step``)."""
    seen: list[list[str]] = []
    step = trainer.training_step

    def counted(*args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return step(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                seen.append([str(w.message)[:120] for w in caught if "synchroniz" in str(w.message).lower()])

    trainer.training_step = counted
    trainer.train()
    assert len(seen) == steps
    return seen


def test_training_steps_read_nothing_on_the_host(tmp_path):
    steps = 6
    settings = dict(max_steps=steps, logging_steps=100, per_device_train_batch_size=1)
    fast = _training_step_syncs(_trainer(tmp_path, True, **settings), steps)
    plain = _training_step_syncs(_trainer(tmp_path, False, on_nonfinite_loss="off", **settings), steps)
    print("host syncs per training step: sync-free", [len(s) for s in fast], "TRL's", [len(s) for s in plain])
    assert all(len(s) >= 4 for s in plain[3:]), plain  # the control
    assert all(s == [] for s in fast[3:]), fast  # after the first steps (the CUDA graphs' captures)


def test_logged_values_agree(tmp_path):
    logs = {}
    for sync_free in (False, True):
        trainer = _trainer(tmp_path, sync_free)
        trainer.train()
        logs[sync_free] = [h for h in trainer.state.log_history if "loss" in h]
    for a, b in zip(logs[False], logs[True]):
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
            assert b[key] == pytest.approx(a[key], rel=2e-2), (key, a[key], b[key])
