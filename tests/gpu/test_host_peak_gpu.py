"""GPU: the long-context search's host bound sees page-locked memory (what offloaded checkpointing keeps its layer
inputs in), so on a GPU runtime a search cannot pin its way past the host's RAM unseen."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB = 2**20


def test_host_peak_counts_pinned_memory_freed_before_the_block_ends():
    from nbkit.notebook import HostPeak

    with HostPeak() as peak:
        pinned = torch.ones(256 * MiB // 4, pin_memory=True)  # 256 MiB page-locked, written
        assert pinned.is_pinned()
        time.sleep(0.1)
        del pinned
    assert peak.peak - peak.start >= 200 * MiB, (peak.start, peak.peak)


def test_length_search_measures_the_offload_pool_on_cuda(tmp_path):
    """A tiny model trained with offloaded checkpointing on CUDA at doubling lengths: every try after the first is
    predicted before it runs, offloading attaches in each, and the search ends at its limit with no try refused."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    from nbkit import FastSFT, FastSFTConfig, load_model
    from nbkit.demo.models import build_base
    from nbkit.notebook import LengthSearch, RunProbe

    build_base(tmp_path / "base", "qwen3", seed=0)
    model, tokenizer = load_model(str(tmp_path / "base"), load_in_4bit=False, lora_r=8)

    def try_length(length: int) -> dict:
        config = FastSFTConfig(output_dir=str(tmp_path / "trainer"), max_steps=2, per_device_train_batch_size=1,
                               learning_rate=0.0, max_length=length, packing=False, gradient_checkpointing=True,
                               gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=True, logging_steps=1,
                               save_strategy="no", report_to="none", disable_tqdm=True, live_dashboard=False,
                               offload_checkpointing=True)
        ids = torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        trainer = FastSFT(model=model, args=config, train_dataset=Dataset.from_dict({"input_ids": [ids]}),
                          processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)
        probe = RunProbe()
        trainer.add_callback(probe)
        trainer.train()
        attached = list(trainer.nbkit_attached)
        del trainer
        return {"fits": True, "seconds_per_step": probe.seconds_per_step, "attached": attached}

    found = LengthSearch(try_length, start=8192, limit=65536, max_step_seconds=120, label="offload").run()
    assert sorted(found["tried"]) == [8192, 16384, 32768, 65536]
    assert found["stopped"] == "reached the search limit, max_try_length=65,536"
    assert all("offload_checkpointing" in row["attached"] for row in found["tried"].values())
    assert all(row["predicted"]["host_bytes"] is not None for n, row in found["tried"].items() if n > 8192)
