"""A whole training step of a few-layer gpt-oss-20b-shaped model: TRL's SFTTrainer vs FastSFT, side by side.

Workload (issue 4): gpt-oss-20b's config (hidden 2,880, 32 experts top-4, 64 query / 8 kv heads of 64, attention
sinks, sliding window 128 on every other layer, yarn rope, vocab 201,088, untied head) cut to ``--layers`` layers
(default 4), random bf16 weights, gradient checkpointing on. Data: pre-tokenized documents of ~400 tokens, packed
by TRL (``packing=True``, best-fit decreasing) into rows of ``--row`` tokens (4,096), ``--tokens / --row`` rows
per optimizer step through gradient accumulation (16,384 tokens per step).

Why rows of 4,096 and not one 16K row: gpt-oss has no SDPA support in transformers, so plain TRL runs eager
attention, which materializes (heads x T x T) scores; with TRL's padding-free packing one 16K row is 34 GB per
score tensor per layer (several alive at once), out of memory or minutes per step. 4K rows keep the plain path
runnable at the same tokens per step.

Losses: transformers 5.17's ``GptOssModel`` does not pass ``position_ids`` to its mask builders, so plain eager
attention over a packed row lets every token see the earlier documents of its row (checked on CPU: logits differ
from a per-document run by 0.46 on the tiny model); FastSFT's attention is per document. With ``--packing bfd`` the
SFTTrainer rows therefore compute a (slightly) different loss; the routing gain is isolated exactly by the
``*_noroute`` rows (same attention), and ``--packing off`` (one padded document per row, where plain attention is
per document as well) gives FastSFT and SFTTrainer the same loss (the CPU test checks both at fp32).

Paths: ``sft`` (SFTTrainer: eager attention with a dense causal mask over each row, experts on transformers'
``grouped_mm``), ``fast`` (FastSFT defaults: per-document attention with sinks on the varlen kernel,
``nbkit.ops.sink_attention``, or the exact fp32 loop where its probe fails; nbkit MoE routing), ``fast_noroute``
(FastSFT with ``fast_moe_routing=False``: separates the routing gain from the attention gain), and the same three
with LoRA r=16 (PEFT ``target_parameters`` on both expert tensors + ``target_modules`` q/k/v/o): ``sft_lora``,
``fast_lora``, ``fast_lora_noroute``. Full fine-tune rows are compared with ``sft``, LoRA rows with ``sft_lora``.

Prediction (written before the first run; H200, 4 layers, 16,384 tokens per step in 4 rows of 4,096).
  Plain eager attention per layer and row: 64 x 4,096^2 scores = 2.1 GB bf16, ~14 passes over it (scale, mask,
  sinks concat, max, softmax, slice, PV) ~ 8 ms forward, ~32 ms with recompute and backward: x 16 ~ 500 ms, the
  largest term. FastSFT's per-document attention (~10 documents per row, fp32 scores for the sinks, ~20 launches
  each) ~ 10 ms per layer and row: ~160 ms. MoE per layer per step: transformers grouped_mm fwd+bwd 38 ms + 13 ms
  recompute ~ 51 ms (x4: ~205 ms); nbkit full FT ~25 ms, LoRA ~20 ms (with fused LoRA kernels, since removed).
  lm_head 19 TFLOP per pass (full FT 3 passes ~90 ms, LoRA 2 ~60 ms) + the fp32 loss over 201K logits ~40 ms. AdamW
  (full FT, 4.4 B params) ~20 ms.
  full FT:  SFTTrainer ~880 ms, FastSFT ~430 ms (~2.0x), FastSFT without routing ~540 ms.
  LoRA:     SFTTrainer ~810 ms, FastSFT ~350 ms (~2.3x), FastSFT without routing ~470 ms.
  Losses (bfd): FastSFT vs SFTTrainer differ (cross-document attention in the plain path, see above) by ~1e-3
  relative on random weights; FastSFT vs its no-routing row within bf16 noise (~1e-3).

    python -m benchmarks.moe_step [--layers 4] [--tokens 16384] [--row 4096] [--steps 5] [--warmup 2]
                                   [--paths sft,fast,fast_noroute,sft_lora,fast_lora,fast_lora_noroute]
                                   [--packing bfd|off] [--tiny] [--profile PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import tempfile
from typing import Any, Optional

import torch

from .common import (
    StepTimer,
    environment,
    failed_row,
    markdown_table,
    packed_token_dataset,
    peak_memory,
    summarize,
    timed_trainer,
    write_results,
)
from .profiling import Profiled, module_ranges, profile_tables

# gpt-oss-20b (config.json of openai/gpt-oss-20b) where it differs from GptOssConfig's defaults
GPT_OSS_20B = dict(num_local_experts=32, num_experts_per_tok=4, router_aux_loss_coef=0.9)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=16)
LORA_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
PATHS = ("sft", "fast", "fast_noroute", "sft_lora", "fast_lora", "fast_lora_noroute")
LABELS = {
    "sft": "SFTTrainer", "fast": "FastSFT", "fast_noroute": "FastSFT, fast_moe_routing=False",
    "sft_lora": "SFTTrainer + LoRA", "fast_lora": "FastSFT + LoRA",
    "fast_lora_noroute": "FastSFT + LoRA, fast_moe_routing=False",
}
BASELINE = {"sft": "sft", "fast": "sft", "fast_noroute": "sft", "sft_lora": "sft_lora", "fast_lora": "sft_lora",
            "fast_lora_noroute": "sft_lora"}


def gpt_oss_config(layers: int, tiny: bool = False):
    """gpt-oss-20b's architecture (or a tiny one for CPU smoke runs) with ``layers`` layers, eager attention."""
    from transformers import GptOssConfig

    shape = dict(TINY) if tiny else dict(GPT_OSS_20B)
    return GptOssConfig(**shape, num_hidden_layers=layers, attn_implementation="eager",
                        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)])


def build_model(layers: int, tiny: bool):
    """Random weights, built on the GPU in bf16 (CPU fp32 for --tiny)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(gpt_oss_config(layers, tiny), dtype=dtype)
    return model


def run_path(path: str, dataset, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"nbkit-moe-step-{path}-") as output_dir:
        return _run_path(path, dataset, args, output_dir)


def _run_path(path: str, dataset, args: argparse.Namespace, output_dir: str) -> dict:
    from peft import LoraConfig
    from trl import SFTConfig

    from nbkit import FastSFTConfig
    from nbkit.demo.tokenizer import load_demo_tokenizer

    lora = path.endswith(("_lora", "_lora_noroute"))
    model = build_model(args.layers, args.tiny)
    packed = args.packing == "bfd"
    common = dict(
        output_dir=output_dir, max_steps=args.warmup + args.steps,
        per_device_train_batch_size=1 if packed else max(1, args.row // args.mean_len),
        gradient_accumulation_steps=args.accum, packing=packed, max_length=args.row,
        bf16=not args.tiny, use_cpu=args.tiny, gradient_checkpointing=True, learning_rate=1e-4 if lora else 1e-5,
        logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    peft_config = None
    if lora:
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_ATTENTION,
                                 target_parameters=LORA_EXPERTS)
    timer = StepTimer()
    prof = Profiled(start=args.warmup) if path == args.profile else None
    if path.startswith("fast"):
        trainer_cls = timed_trainer(fast=True)
        config = FastSFTConfig(**common, fast_moe_routing=not path.endswith("noroute"), live_dashboard=False)
    else:
        trainer_cls = timed_trainer(fast=False)
        config = SFTConfig(**common)
    callbacks = [timer] + ([prof.callback] if prof else [])
    trainer = trainer_cls(model=model, args=config, train_dataset=dataset, peft_config=peft_config, callbacks=callbacks,
                          processing_class=load_demo_tokenizer())  # only its pad/eos ids are used: data is token ids
    trainer.step_timer = timer
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with module_ranges(trainer.model) if prof else contextlib.nullcontext():
        trainer.train()
    peak = peak_memory()
    if prof and prof.prof is not None:
        print(f"\n### profile of {path} (gpt-oss, {args.layers} layers, {args.tokens} tokens/step)\n\n"
              f"{profile_tables(prof.prof, prof.count)}\n", flush=True)
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    extra: dict[str, Any] = {
        "label": LABELS[path],
        "speedups": getattr(trainer, "nbkit_attached", []),
        "attention": base.config._attn_implementation,
        "experts": base.get_experts_implementation(),
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }
    del trainer, model, base
    _free()
    return summarize(path, timer.times, args.warmup, peak, extra)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


PAIRS = [("fast", "sft"), ("fast_noroute", "sft"), ("fast_lora", "sft_lora"), ("fast_lora_noroute", "sft_lora"),
         ("fast", "fast_noroute"), ("fast_lora", "fast_lora_noroute")]


def loss_gaps(rows: list[dict]) -> dict[str, float]:
    """Largest relative gap between two paths' per-step losses (same data, same seed), for each pair in ``PAIRS``
    that ran: "fast vs sft" and so on."""
    by_path = {r["path"]: r for r in rows if not r.get("error")}
    gaps = {}
    for a, b in PAIRS:
        ra, rb = by_path.get(a), by_path.get(b)
        if ra is None or rb is None or not rb["losses"] or len(ra["losses"]) != len(rb["losses"]):
            continue
        gaps[f"{a} vs {b}"] = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(ra["losses"], rb["losses"]))
    return gaps


def tables(rows: list[dict]) -> str:
    out = []
    for baseline in ("sft", "sft_lora"):
        section = [dict(r, path=r.get("label", r["path"])) for r in rows if BASELINE.get(r["path"]) == baseline]
        if section:
            out.append(markdown_table(section, baseline=LABELS[baseline]))
    gaps = loss_gaps(rows)
    if gaps:
        out.append("max relative per-step loss gap: " + ", ".join(f"{pair} {g:.1e}" for pair, g in gaps.items()))
    return "\n\n".join(out)


def run(argv: Optional[list[str]] = None) -> list[dict]:
    """Parse ``argv``, run the selected paths one after the other, print and write the results; return the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per optimizer step")
    parser.add_argument("--row", type=int, default=4096, help="packed row length (max_length)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--packing", choices=("bfd", "off"), default="bfd",
                        help="bfd: TRL's packing into --row-token rows; off: one document per row, padded batches of "
                        "about --row tokens (the mode in which plain gpt-oss attention is per-document too)")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 gpt-oss on the CPU: checks the script runs")
    parser.add_argument("--profile", default=None, help="profile two steps of this path (one of --paths)")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() or args.tiny):
        raise SystemExit("this benchmark needs a CUDA GPU (or --tiny for a CPU smoke run)")
    if args.tiny and args.row == 4096:
        args.row, args.tokens = 128, 256
    args.accum = max(1, math.ceil(args.tokens / args.row))
    args.mean_len = 400 if not args.tiny else 40
    steps = args.warmup + args.steps
    n_docs = int(1.5 * steps * args.accum * args.row / args.mean_len) + 8
    vocab = gpt_oss_config(1, args.tiny).vocab_size
    dataset = packed_token_dataset(n_docs, vocab, mean_len=args.mean_len, spread=args.mean_len // 4)
    rows = []
    for path in args.paths.split(","):
        if path not in PATHS:
            raise SystemExit(f"unknown path {path!r}: choose from {', '.join(PATHS)}")
        try:
            rows.append(run_path(path, dataset, args))
        except Exception as exc:
            rows.append(failed_row(path, exc, label=LABELS[path]))
        shown = {k: v for k, v in rows[-1].items() if k not in ("step_ms_all", "tokens_all")}
        print(shown, flush=True)
    env = environment()
    table = tables(rows)
    write_results("moe_step", {"env": env, "args": vars(args), "rows": rows, "table": table,
                               "loss_gaps": loss_gaps(rows)})
    print(env)
    print(table)
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    run(argv)


if __name__ == "__main__":
    main()
