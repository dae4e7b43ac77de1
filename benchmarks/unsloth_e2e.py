"""Unsloth's QLoRA training speed on benchmarks/e2e.py's workload: the reference a FastSFT figure is read against.

What it measures: the same random-weight Qwen3 (``e2e.save_random_model``: 1.7B or 14B shape, saved to a local
folder), loaded Unsloth's way, ``FastLanguageModel.from_pretrained(folder, load_in_4bit=True, dtype=...,
max_seq_length=<tokens>)`` (bitsandbytes NF4, double quant), LoRA r=16 alpha 32 on all 7 projections through
``FastLanguageModel.get_peft_model(..., lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth",
random_state=0)``, then TRL's ``SFTTrainer`` / ``SFTConfig`` as Unsloth patches them on import, with ``e2e``'s
``sft`` settings: one packed row of ``--tokens`` tokens per step (``packing=True``, ``max_length``) from ~400-token
documents (``packed_token_dataset``), batch 1, no gradient accumulation, learning rate 1e-4 (linear, no warmup),
TrainingArguments' default optimizer ``adamw_torch_fused`` and weight decay 0, seed 0. Unsloth's trainer config has
defaults of its own (adamw_8bit, gradient accumulation 2, weight decay 0.001, 10% warmup, seed 3407): each is set
back explicitly. ``--fp16``: float16 compute and training (as on a T4). ``N@G`` in ``--tokens`` caps the process's
GPU memory at G GiB for that row (``e2e.cap_memory``). Timing is ``common.StepTimer`` (CUDA events, one entry per
optimizer step, the first ``--warmup`` steps dropped, ``summarize``'s median over full rows); each row records
loss_first / loss_mean and peak allocated memory, and is written as path "unsloth" by ``write_results``
($OUT/unsloth_e2e_<shape>_<dtype>_<caps>.json, after each row: ``results_names``), the versions of unsloth,
unsloth_zoo and trl added to the environment. A row that fails (e.g. out of memory under the cap) is recorded with
``failed_row`` and the next one runs.

``--recipe unsloth``: Unsloth's notebook recipe instead (``benchmarks/unsloth_recipe.py``, the same settings and
data as ``e2e --recipe unsloth``), as its notebooks write it: ``from_pretrained(..., max_seq_length=<--tokens, default
2048>)``, ``get_peft_model(r=16, lora_alpha=16, lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth",
random_state=3407)`` on all 7 projections, Unsloth's SFTConfig with the notebook's values (batch 2 x 4 accumulation
steps, 5 warmup steps, learning rate 2e-4 linear, ``adamw_8bit``, weight decay 0.01, seed 3407, logging every step,
``packing=False``, ``max_length`` = --tokens, ``--steps`` (default 60) steps in all); the rest is left to Unsloth's
defaults (it may turn padding-free batching on: the row records ``padding_free``). Timed as ``e2e``'s recipe rows are
(``unsloth_recipe.recipe_row``: the whole ``train()``, every step's wall time, the first 4 on their own), written to
$OUT/unsloth_e2e_recipe-unsloth_<shape>_<compute>_<cap>.json. ``--model-dir DIR`` reuses the random model saved there
(``e2e --model-dir`` saves the same one; the demo tokenizer is added beside it when missing) and keeps it.

Each row loads the model afresh (Unsloth bakes ``max_seq_length`` in at load), so every row starts from the same base
and the same initial adapters. Unsloth sees the whole device (its heuristics read the total memory, not the cap).
Without xformers or flash-attn (not on the benchmark machine) Unsloth runs its SDPA path for packed rows.

It needs its own environment: Unsloth 2026.10.9 pins trl<=1.15 and datasets<5, nbkit's benchmark wheels are trl 1.16
and datasets 5.2. ``benchmarks/unsloth_env.sh`` builds it (see there), then, from the repo root:

    . benchmarks/unsloth_env.sh && python3 -m benchmarks.unsloth_e2e --shape 1.7b --fp16 \\
        --tokens 16384@14,4096@14 --steps 6 --warmup 3
    . benchmarks/unsloth_env.sh && python3 -m benchmarks.unsloth_e2e --shape 1.7b --recipe unsloth --fp16 \\
        --tokens 2048@15 --model-dir /tmp/m
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from . import results_names, unsloth_recipe
from .workload_args import resolve_defaults, workload_parser

PATH = "unsloth"
# The versions a figure depends on beyond common.PACKAGES (distribution names)
EXTRA_PACKAGES = {"unsloth": "unsloth", "unsloth_zoo": "unsloth_zoo", "trl": "trl", "datasets": "datasets",
                  "xformers": "xformers", "torchao": "torchao", "cut_cross_entropy": "cut_cross_entropy"}
# TRL's SFTConfig takes these from TrainingArguments (transformers 5.17), which e2e's plain ``sft`` path gets;
# Unsloth's SFTConfig changes their defaults, so they are passed explicitly
TRAINING_DEFAULTS = dict(optim="adamw_torch_fused", weight_decay=0.0, warmup_steps=0, lr_scheduler_type="linear",
                         gradient_accumulation_steps=1, max_grad_norm=1.0)


def environment_with_unsloth() -> dict[str, Any]:
    """``write_results``' environment (machine, versions, commit) plus the Unsloth stack's versions."""
    from importlib import metadata

    from .common import environment, git_commit

    env = environment()
    for key, dist in EXTRA_PACKAGES.items():
        try:
            env[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[key] = "absent"
    return {"git_commit": git_commit(), "environment": env}


def add_tokenizer(folder: str) -> None:
    """Put nbkit's demo tokenizer beside the random weights, so the folder loads as a complete checkpoint (e2e passes
    the same tokenizer to its trainers; only its pad/eos ids are used: the data are token ids)."""
    from nbkit.demo.tokenizer import demo_tokenizer_path

    for name in os.listdir(demo_tokenizer_path()):
        shutil.copy(os.path.join(demo_tokenizer_path(), name), folder)


def run_row(folder: str, tokens: int, dataset: Any, args: argparse.Namespace) -> dict:
    """One row: load with Unsloth at ``tokens``, its LoRA, its SFTTrainer over ``warmup + steps`` steps (the recipe:
    ``steps``); its row."""
    import torch
    from trl import SFTConfig, SFTTrainer  # Unsloth's own, patched in on `import unsloth`
    from unsloth import FastLanguageModel

    from .common import StepTimer, TimedStepMixin, peak_memory, summarize
    from .e2e import LORA_TARGETS

    recipe = args.recipe == unsloth_recipe.RECIPE
    dtype = torch.float16 if args.fp16 else torch.bfloat16
    t0 = time.perf_counter()
    model, tokenizer = FastLanguageModel.from_pretrained(folder, max_seq_length=tokens, dtype=dtype, load_in_4bit=True)
    load_s = time.perf_counter() - t0
    trainer = None
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if recipe:  # the notebook's cells, gradient checkpointing left to use_gradient_checkpointing
            model = FastLanguageModel.get_peft_model(
                model, **unsloth_recipe.LORA, target_modules=LORA_TARGETS, use_gradient_checkpointing="unsloth",
                random_state=unsloth_recipe.SEED)
            config = SFTConfig(
                output_dir=f"/tmp/nbkit-e2e-{PATH}", max_steps=args.steps, max_length=tokens, bf16=not args.fp16,
                fp16=args.fp16, report_to=[], save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
                **unsloth_recipe.SFT)
        else:
            model = FastLanguageModel.get_peft_model(
                model, r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0, bias="none",
                use_gradient_checkpointing="unsloth", random_state=0)
            config = SFTConfig(
                output_dir=f"/tmp/nbkit-e2e-{PATH}", max_steps=args.warmup + args.steps, per_device_train_batch_size=1,
                packing=True, max_length=tokens, bf16=not args.fp16, fp16=args.fp16, gradient_checkpointing=True,
                learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, seed=0,
                disable_tqdm=True, **TRAINING_DEFAULTS)
        timer = StepTimer()
        cls = type(f"Timed{SFTTrainer.__name__}", (TimedStepMixin, SFTTrainer), {})
        trainer = cls(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
        trainer.step_timer = timer
        torch.cuda.synchronize()
        t_train = time.perf_counter()
        trainer.train()
        torch.cuda.synchronize()
        train_s = time.perf_counter() - t_train
        peak = peak_memory()
        optim = str(getattr(config.optim, "value", config.optim))
        extra = {"load_s": load_s, "optim": optim}
        if recipe:
            row = unsloth_recipe.recipe_row(PATH, timer.times, train_s, t_train - t0, peak, args.warmup,
                                            {**extra, **unsloth_recipe.batching(trainer)})
        else:
            row = summarize(PATH, timer.times, args.warmup, peak, dict(extra, train_s=train_s))
        if timer.times.first_step_s is not None:  # from adding the LoRA, as e2e's trainers add theirs
            row["first_step_s"] = timer._t0 - t0 + timer.times.first_step_s
        return row
    finally:
        del trainer, model, tokenizer
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> list[dict]:
    """Each ``--tokens`` row in turn, Unsloth's model loaded afresh for each; writes and returns the rows."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = workload_parser(__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="packed", choices=["packed", unsloth_recipe.RECIPE],
                        help="packed: e2e's packed rows (default); unsloth: Unsloth's notebook recipe")
    parser.add_argument("--model-dir", default=None,
                        help="the random model's folder: reused when it holds one, saved there otherwise, and kept "
                             "(default: a new temporary folder, removed afterwards)")
    args = resolve_defaults(parser.parse_args(argv))

    import torch
    import unsloth  # noqa: F401  before transformers, TRL and PEFT: Unsloth patches them as it is imported

    from .common import failed_row, markdown_table, packed_token_dataset, write_results
    from .e2e import SHAPES, cap_memory, caps_of, save_random_model
    from .recipe_table import table as recipe_table

    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    env = environment_with_unsloth()
    print(env["environment"], flush=True)
    compute = "fp16" if args.fp16 else "bf16"
    recipe = args.recipe == unsloth_recipe.RECIPE
    folder = args.model_dir or tempfile.mkdtemp(prefix=f"nbkit-unsloth-e2e-{args.shape}-")
    name = results_names.results_name("unsloth_e2e", args.shape, compute, caps_of(args.tokens),
                                      recipe=unsloth_recipe.RECIPE if recipe else None)
    rows: list[dict] = []
    try:
        if os.path.isfile(os.path.join(folder, "config.json")):
            print(f"model {args.shape}: reused from {folder}", flush=True)
        else:
            save_s = save_random_model(args.shape, args.layers, folder, tiny=False)
            print(f"model {args.shape}: saved in {save_s:.1f} s", flush=True)
        if not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
            add_tokenizer(folder)
        for spec_row in args.tokens.split(","):
            tokens_text, _, cap = spec_row.partition("@")
            tokens = int(tokens_text)
            cap_gib = float(cap) if cap else None
            cap_memory(cap_gib)
            if recipe:
                dataset = unsloth_recipe.documents(unsloth_recipe.n_documents(args.steps),
                                                   SHAPES[args.shape]["vocab_size"], tokens)
            else:
                mean_len = 400
                n_docs = 2 * (args.warmup + args.steps + 2) * tokens // mean_len
                dataset = packed_token_dataset(n_docs, SHAPES[args.shape]["vocab_size"], mean_len=mean_len,
                                               spread=mean_len // 4)
            try:
                row = run_row(folder, tokens, dataset, args)
            except Exception as exc:  # one failing row (an OOM under the cap) must not lose the others
                row = failed_row(PATH, exc)
            gc.collect()  # the failure's traceback held the model until here
            torch.cuda.empty_cache()
            row = dict(row, shape=args.shape, tokens=tokens, weights="nf4", recipe=args.recipe, cap_gib=cap_gib,
                       compute=compute)
            rows.append(row)
            print({k: v for k, v in row.items() if not isinstance(v, list)}, flush=True)
            what = f"{tokens} tokens/step" if not recipe else f"Unsloth's notebook recipe, rows <= {tokens} tokens"
            what += f", process capped at {cap_gib:g} GiB" if cap_gib else ""
            table = recipe_table([row]) if recipe else markdown_table([row])
            print(f"\n{args.shape}, {what}, QLoRA nf4, {compute}\n{table}\n", flush=True)
            # after each row length, so a run cut short keeps the lengths it finished
            write_results("unsloth_e2e", rows, argv=argv, name=name, environment_of=env,
                          notes="Unsloth's FastLanguageModel + its patched TRL SFTTrainer on e2e.py's workload" +
                          (" (Unsloth's notebook recipe)" if recipe else ""))
    finally:
        if not args.model_dir:
            shutil.rmtree(folder, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
