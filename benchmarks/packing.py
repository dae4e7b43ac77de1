"""Cached packing benchmark: plain TRL SFTTrainer (sdpa, flex attention) vs FastSFT, side by side in one run.

Workload (issue 2): Qwen3-1.7B-shaped model with random bf16 weights, LoRA r=16 on all 7 projections, one packed row
of 16,384 tokens per step from documents of about 400 tokens, gradient checkpointing on.

Prediction (written before the first run). Matmuls: 6 x 1.72e9 x 16,384 x (1 + 1/3 recompute) ~ 2.3e14 FLOP, about
0.29 s at 779 TFLOP/s; the LoRA side-products, norms and the loss over 152K vocab add ~0.3-0.4 s of memory-bound
work. Attention: per layer forward 0.34 ms varlen vs 7.5 ms dense-mask SDPA (BENCHMARKS.md, "The machine"); x 28
layers x (fwd + recompute + ~2.5x bwd) is ~0.04 s for varlen against ~0.9 s for the dense mask. So plain sdpa ~1.8 s,
FastSFT ~0.95-1.0 s (~1.85x), the per-document SDPA path (T4 path, forced) ~1.2 s: between the two.

    python -m benchmarks.packing [--tokens 16384] [--steps 6] [--warmup 2] \\
        [--paths sdpa,flex,nbkit,nbkit_sdpa,nbkit_sdpa_loop,nbkit_sdpa_masked]
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

import torch

from nbkit.demo.tokenizer import load_demo_tokenizer

from .common import (
    StepTimer,
    failed_row,
    markdown_table,
    packed_token_dataset,
    peak_memory,
    summarize,
    timed_trainer,
    write_results,
)

QWEN3_1_7B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def build_model(attn: str, layers: int | None, tiny: bool = False, seed: int = 0) -> torch.nn.Module:
    """Random weights, built directly on the GPU in bf16 (CPU fp32 for --tiny smoke runs)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = dict(TINY if tiny else QWEN3_1_7B)
    if layers:
        shape["num_hidden_layers"] = layers
    config = Qwen3Config(**shape, attn_implementation=attn)
    torch.manual_seed(seed)
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def run_path(path: str, dataset: Any, args: argparse.Namespace) -> dict:
    """One path's timed run on a freshly built model: its summary row."""
    from peft import LoraConfig
    from trl import SFTConfig

    from nbkit import FastSFTConfig

    attn = {"sdpa": "sdpa", "flex": "flex_attention"}.get(path, "sdpa")
    model = build_model(attn, args.layers, args.tiny)
    common = dict(
        output_dir=f"/tmp/nbkit-bench-{path}", max_steps=args.warmup + args.steps, per_device_train_batch_size=1,
        packing=True, max_length=args.tokens, bf16=not args.tiny, use_cpu=args.tiny, gradient_checkpointing=True,
        learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, seed=0,
        disable_tqdm=True,
    )
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0)
    timer = StepTimer()
    if path.startswith("nbkit"):
        kernel = path.split("_", 1)[1] if "_" in path else "auto"
        trainer_cls = timed_trainer(fast=True)
        # packing alone: the other speedups are off so the ratio is this speedup's own
        config = FastSFTConfig(**common, attention_kernel=kernel, offload_checkpointing=False, fast_moe_routing=False,
                               fused_lora=False, fused_kernels=False, tiled_mlp=False, live_dashboard=False,
                               sync_free_metrics=False)
    else:
        trainer_cls = timed_trainer(fast=False)
        config = SFTConfig(**common)
    trainer = trainer_cls(model=model, args=config, train_dataset=dataset, peft_config=peft_config, callbacks=[timer],
                          processing_class=load_demo_tokenizer())  # only its pad/eos ids are used: data is token ids
    trainer.step_timer = timer
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = peak_memory()
    extra = {"speedups": getattr(trainer, "nbkit_attached", [])}
    del trainer, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summarize(path, timer.times, args.warmup, peak, extra)


def main(argv: list[str] | None = None) -> list[dict]:
    """Every path on the same data, one model build each; writes and returns the rows."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="shrink the model (default: the full 28 layers)")
    parser.add_argument("--paths", default="sdpa,nbkit,nbkit_sdpa_loop,flex")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() or args.tiny):
        raise SystemExit("this benchmark needs a CUDA GPU (or --tiny for a CPU smoke run)")
    mean_len = 400 if not args.tiny else 40
    n_docs = 2 * (args.warmup + args.steps + 2) * args.tokens // mean_len
    dataset = packed_token_dataset(n_docs, (TINY if args.tiny else QWEN3_1_7B)["vocab_size"], mean_len=mean_len,
                                   spread=mean_len // 4)
    rows = []
    for path in args.paths.split(","):
        try:
            rows.append(dict(run_path(path, dataset, args), tokens=args.tokens))
        except Exception as exc:
            rows.append(dict(failed_row(path, exc), tokens=args.tokens))
        print(rows[-1], flush=True)
    write_results("packing", rows, argv=argv, notes="CPU smoke run (--tiny)" if args.tiny else "")
    print(markdown_table(rows, baseline="sdpa"))
    return rows

if __name__ == "__main__":
    main()
