"""End-to-end QLoRA SFT benchmark: plain TRL SFTTrainer vs FastSFT, side by side in one run, and a step profile.

Workload (issue 8): a Qwen3-1.7B- or Qwen3-14B-shaped model with random weights, saved once and loaded the way a user
loads one (``from_pretrained`` with bitsandbytes NF4, double quant, bf16 compute), LoRA r=16 (alpha 32) on all 7
projections, ``packing=True`` with one packed row of 4K or 16K tokens per step from ~400-token documents, gradient
checkpointing on. The base model is loaded once; each path wraps it with its own LoRA (same seed, so the same
initial adapters) and unloads it afterwards. ``--recipe notebook`` runs the common notebook recipe instead (issue
15): ``per_device_train_batch_size=2``, ``gradient_accumulation_steps=4``, padding-free without packing, one
document per row of 256 to ``--tokens`` - 256 tokens (cut as a user's ``max_length`` would; TRL refuses
``max_length`` there), LoRA r=32 (alpha 32). The step timer syncs once per optimizer step (as a trainer logging
every step does), not per micro-step, and its entries are whole optimizer steps.

``--recipe unsloth`` runs Unsloth's notebook recipe (``benchmarks/unsloth_recipe.py``), the one most notebook users
run, beside ``benchmarks/unsloth_e2e.py``'s Unsloth run of it: batch 2 x 4 accumulation steps, no packing, rows cut
at ``--tokens`` (default 2,048) by the trainer's ``max_length``, ``adamw_8bit``, LoRA r=16 alpha 16, learning rate 2e-4
with 5 warmup steps, seed 3407, ``--steps`` (default 60) optimizer steps in all, on documents of 100 to 3,000 tokens.
Its row is timed as the user waits: the whole ``train()`` (synchronized before and after), every step's wall time in
order (the first 4 on their own), the median after ``--warmup`` (default 4) steps with its spread, peak allocated
memory, first and last loss, and FastSFT's layer-capture statistics where the trainer exposes them. The base model
is loaded under the first row's cap (``N@G``), as on the card it stands for. One results file per run:
``e2e_recipe-unsloth_<shape>_<compute>_<cap>_<paths>.json``; ``benchmarks/recipe_table.py`` sets the files of the
three trainers side by side (``benchmarks/recipe_round.sh`` runs them all, each in its own process). With ``--tiny``
(CPU) bitsandbytes' ``adamw_8bit`` runs on the CPU too.

Paths (``--paths``, comma separated):
- ``sft``: TRL ``SFTTrainer`` with transformers' default attention (sdpa), what a TRL user gets without flash-attn.
- ``sft_liger``: the same with ``use_liger_kernel=True`` (TRL applies Liger's layer kernels; its own fused LM head).
- ``fastsft``: ``FastSFT`` with its defaults.
- ``fastsft[switch=value;...]``: FastSFT with switches (or any config field, e.g. ``logging_steps``) changed, e.g.
  ``fastsft[fused_lora=False;fused_kernels=False]``.

``--profile NAME`` runs ``torch.profiler`` over two steps of that path and prints kernel time by category, by
operator and by module (forward ranges per module type; backward by autograd node), and writes the trace to $OUT.
``--gaps NAME`` runs that path once more with the GPU alone profiled over its timed steps and prints where the GPU
idles between kernels (total, the largest gaps and the kernels around them).
``--each-path-alone`` runs each path in a Python process of its own, one after another, on the model saved once
(``--model-dir DIR`` keeps and reuses that folder): in one process the path that runs first gets a fresh allocator
and later ones inherit what it left (BENCHMARKS.md, run 20: the 14B 4K row's slow step depended on the order).
``--host-profile NAME`` runs that path once more after the timed runs, its timed steps sampled by pyinstrument (an
optional dependency), and prints where the host's time per step goes: by package (nbkit's modules one by one), the
host's waits for the GPU (the step timer's synchronize among them: the share of the step the GPU was the bottleneck),
and the top functions.
``--first-steps-profile`` samples each path's first ``--warmup`` steps the same way, each step on its own, and
``train()``'s start before them: where a fresh process's first steps go (kernels compiled, the plan measured, graphs
captured). Those rows are marked ``(first steps host-profiled)``: the sampler adds a few percent to their steps.
Run it in a process of its own (``--each-path-alone``, or ``benchmarks/recipe_round.sh``'s ``FIRST_STEPS=1``), so
nothing was compiled before.

Prediction for the 1.7B / 16K workload, FastSFT vs plain ``sft``: see BENCHMARKS.md (written before the run).

    python -m benchmarks.e2e --shape 1.7b --tokens 16384 --paths sft,fastsft
    python -m benchmarks.e2e --shape 1.7b --profile fastsft
    python -m benchmarks.e2e --shape 1.7b --tokens 2048 --steps 10 --host-profile fastsft
    python -m benchmarks.e2e --shape 1.7b --recipe unsloth --fp16 --tokens 2048@15 --steps 5 --paths fastsft \
        --first-steps-profile
    python -m benchmarks.e2e --shape 1.7b --recipe notebook --tokens 2048 --steps 10
    python -m benchmarks.e2e --shape 1.7b --recipe unsloth --fp16 --tokens 2048@15 --paths fastsft --model-dir /tmp/m
    python -m benchmarks.e2e --tiny          # CPU smoke run (bf16 LoRA, no quantization)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

from nbkit.demo.tokenizer import load_demo_tokenizer

from . import results_names, unsloth_recipe
from .common import (
    StepTimer,
    failed_row,
    markdown_table,
    packed_token_dataset,
    parse_path,
    peak_memory,
    split_paths,
    summarize,
    timed_trainer,
    write_results,
)
from .profiling import (
    FirstStepsSampled,
    HostProfiled,
    Profiled,
    gap_host_tables,
    gap_tables,
    host_tables,
    module_ranges,
    profile_tables,
)
from .workload_args import resolve_defaults, workload_parser

SHAPES = {
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "14b": dict(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
COMMON = dict(max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ------------------------------------------------------------------------------------------------------- the model
def save_random_model(shape: str, layers: int | None, folder: str, tiny: bool) -> float:
    """A random-weight Qwen3 of ``shape`` saved to ``folder`` (built on the GPU in bf16); returns seconds."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    t0 = time.perf_counter()
    cfg = dict(SHAPES[shape], **COMMON)
    if layers:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(0)
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**cfg), dtype=dtype)
    model.save_pretrained(folder)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def load_base(folder: str, quantize: bool, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, float]:
    """The base model as a user loads it for QLoRA (``nbkit.load_model``'s settings, adapters left to the trainer);
    ``dtype``: the compute dtype (float16 as on a T4)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from nbkit.loading import keep_4bit_trainable

    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if quantize:
        kwargs = dict(dtype=dtype, device_map={"": 0}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype))
    elif torch.cuda.is_available():
        kwargs = dict(dtype=dtype, device_map={"": 0})
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    if quantize:
        keep_4bit_trainable(model)
    model.config.use_cache = False
    return model, time.perf_counter() - t0


def log_memory() -> None:
    """``--memory-log``: nbkit's decisions at INFO and one line of GPU memory after every optimizer step."""
    import logging

    from torch.optim.optimizer import register_optimizer_step_post_hook

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("nbkit").setLevel(logging.INFO)
    logging.getLogger("nbkit.speedups.cuda_graphs").setLevel(logging.DEBUG)  # each capture's reserved memory
    steps = [0]

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps[0] += 1
        if torch.cuda.is_available():
            gib, stats = 2**30, torch.cuda.memory_stats()
            # the allocator's own calls so far: a step that grows its cache (cudaMalloc) or flushes it to retry
            # (cudaFree after a synchronize) pays for them, once
            print(f"memory after optimizer step {steps[0]}: allocated {torch.cuda.memory_allocated() / gib:.2f} GiB, "
                  f"reserved {torch.cuda.memory_reserved() / gib:.2f}, peak {torch.cuda.max_memory_allocated() / gib:.2f}, "
                  f"cudaMalloc {stats.get('num_device_alloc', 0)}, cudaFree {stats.get('num_device_free', 0)}, "
                  f"retries {stats.get('num_alloc_retries', 0)}", flush=True)

    register_optimizer_step_post_hook(after_step)


def cap_memory(gib: float | None) -> None:
    """Cap this process's GPU memory at ``gib`` GiB (None: the whole device), as a smaller card would; the allocator's
    cache is emptied first so the cap applies to what the next row allocates."""
    if not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total) if gib else 1.0)


def _restore_base(trainer: Any) -> torch.nn.Module:
    """Take the LoRA back out so the next path starts from the same base (and the same initial adapters)."""
    model = trainer.model
    base = model.unload() if hasattr(model, "unload") else model
    base.__dict__.pop("forward", None)  # TRL's fused LM head is an instance attribute
    if getattr(base, "_require_grads_hook", None) is not None:
        base.disable_input_require_grads()
    base.zero_grad(set_to_none=True)
    return base


# ------------------------------------------------------------------------------------------------------- the paths
# a profile's text: the row's key for it by the kind of extra run, and its heading
EXTRA_TEXT = {"host": "host_profile", "gaps": "gpu_gaps", "gap_host": "gap_host"}
TEXT_TITLE = {"profile": "profile", "host_profile": "host profile", "gpu_gaps": "GPU idle",
              "gap_host": "host in GPU gaps", "first_steps_host": "host in the first steps"}


def run_path(spec: str, base: torch.nn.Module, dataset: Any, args: argparse.Namespace,
             profile: bool, host: bool = False, gaps: bool = False,
             gap_host: bool = False) -> tuple[dict, torch.nn.Module, str]:
    """One path's timed run on ``base`` (its own LoRA, unloaded afterwards): its row, the base back, its profile
    (``profile``: the GPU's kernels; ``host``: the host's time, sampled)."""
    from peft import LoraConfig
    from trl import SFTConfig

    from nbkit import FastSFTConfig

    name, overrides = parse_path(spec)
    tiny = args.tiny
    notebook = getattr(args, "recipe", "packed") == "notebook"  # benchmarks/dashboard.py's args have no recipe
    recipe = getattr(args, "recipe", "packed") == "unsloth"
    fp16 = getattr(args, "fp16", False)
    common = dict(
        output_dir=f"/tmp/nbkit-e2e-{name}", max_steps=args.warmup + args.steps, per_device_train_batch_size=1,
        packing=True, max_length=args.tokens, bf16=not (tiny or fp16), fp16=fp16, use_cpu=tiny, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, learning_rate=1e-4, logging_steps=1, report_to=[],
        save_strategy="no", dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    if notebook:  # the data are cut to --tokens already: TRL refuses max_length with padding-free, unpacked rows
        common.update(per_device_train_batch_size=2, gradient_accumulation_steps=4, packing=False, padding_free=True,
                      max_length=None)
    if recipe:  # Unsloth's notebook values; TRL cuts the rows at max_length
        common.update(unsloth_recipe.SFT, max_steps=args.steps, max_length=args.tokens)
    if name == "sft_liger":
        common["use_liger_kernel"] = True
    timer = StepTimer()
    if name.startswith("fastsft"):
        cls = timed_trainer(fast=True)
        config = FastSFTConfig(**{**common, "live_dashboard": False, **overrides})
    else:
        cls = timed_trainer(fast=False)
        config = SFTConfig(**{**common, **overrides})
    base.set_attn_implementation("sdpa")
    rank, alpha = (32, 32) if notebook else (16, 32)
    lora = unsloth_recipe.LORA if recipe else dict(r=rank, lora_alpha=alpha, lora_dropout=0.0)
    peft_config = LoraConfig(**lora, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    prof = Profiled(start=args.warmup) if profile else None
    if gaps:
        prof = Profiled(start=args.warmup, count=args.steps, host=False)
    if gap_host:
        prof = Profiled(start=args.warmup, count=2, host=True, stack=True)
    sampler = HostProfiled(start=args.warmup, count=args.steps) if host else None
    first = FirstStepsSampled(args.warmup) if getattr(args, "first_steps_profile", False) and not (
        profile or host or gaps or gap_host) else None
    callbacks = [timer] + ([prof.callback] if prof else []) + ([sampler.callback] if sampler else []) \
        + ([first.callback] if first else [])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(unsloth_recipe.SEED if recipe else 0)
    t0 = time.perf_counter()
    trainer = cls(model=base, args=config, train_dataset=dataset, peft_config=peft_config, callbacks=callbacks,
                  processing_class=load_demo_tokenizer())  # only its pad/eos ids are used: the data are token ids
    trainer.step_timer = timer
    if fp16 and not name.startswith("fastsft"):
        # TRL's QLoRA recipe keeps the adapters in bf16, whose gradients fp16's GradScaler cannot unscale (an
        # error at the first step); a TRL user on a T4 puts them in fp32 by hand, as FastSFT does itself
        for param in trainer.model.parameters():
            if param.requires_grad and param.dtype == torch.bfloat16:
                param.data = param.data.float()
    # a graphed path keeps its layers whole in the profile: a hook inside one would make it run eagerly
    graphed = torch.cuda.is_available() and getattr(trainer.args, "cuda_graphs", False) not in (False, None)
    ranges = module_ranges(trainer.model, inside_layers=not graphed) if profile else contextlib.nullcontext()
    with ranges:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t_train = time.perf_counter()
        try:
            trainer.train()
        except Exception as exc:  # a failed row keeps the plan and graph counters: what it held when it failed
            exc.nbkit_stats = {"speedups": getattr(trainer, "nbkit_attached", []),
                               **unsloth_recipe.capture_stats(trainer)}
            raise
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        train_s = time.perf_counter() - t_train
    peak = peak_memory()
    # the layer plan and graph counters ride along with every row: a row's plan is half of what explains its speed
    extra = {"speedups": getattr(trainer, "nbkit_attached", []), **unsloth_recipe.capture_stats(trainer)}
    if recipe:
        row = unsloth_recipe.recipe_row(
            spec, timer.times, train_s, t_train - t0, peak, args.warmup,
            {**extra, "optim": str(getattr(config.optim, "value", config.optim)), **unsloth_recipe.batching(trainer)})
    else:
        row = summarize(spec, timer.times, args.warmup, peak, dict(extra, train_s=train_s))
    if timer.times.first_step_s is not None:  # from trainer construction: what a user waits for after loading
        row["first_step_s"] = timer._t0 - t0 + timer.times.first_step_s
    text = profile_tables(prof.prof, prof.count) if profile and prof.prof is not None else ""
    if gaps and prof.prof is not None:
        trace = os.path.join(tempfile.mkdtemp(prefix="nbkit-e2e-gaps-"), "trace.json")
        prof.prof.export_chrome_trace(trace)
        text = gap_tables(trace, prof.count)
        shutil.rmtree(os.path.dirname(trace), ignore_errors=True)
    if gap_host and prof.prof is not None:
        trace = os.path.join(tempfile.mkdtemp(prefix="nbkit-e2e-gaps-"), "trace.json")
        prof.prof.export_chrome_trace(trace)
        text = gap_host_tables(trace, prof.count)
        shutil.rmtree(os.path.dirname(trace), ignore_errors=True)
    if sampler is not None and sampler.session is not None:
        text, row["host_ms_per_step"] = host_tables(sampler.session, sampler.count, row.get("step_ms"))
    if first is not None:
        text = row["first_steps_host"] = first.tables(timer.times.step_ms)
        row["path"] = f"{spec} (first steps host-profiled)"
    if profile and prof.prof is not None and os.environ.get("OUT"):
        with contextlib.suppress(Exception):
            prof.prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"trace_{name}.json"))
    base = _restore_base(trainer)
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, base, text


def recipe_dataset(args: argparse.Namespace, shape: str, tokens: int) -> Any:
    """A row length's data: ``--recipe``'s documents for ``tokens`` (the row length, or the cut)."""
    if args.recipe == "unsloth":
        return unsloth_recipe.documents(unsloth_recipe.n_documents(args.steps), SHAPES[shape]["vocab_size"], tokens)
    if args.recipe == "notebook":  # one document per row, cut to the row length as a user's max_length would
        mean_len = tokens // 2
        n_docs = 8 * (args.warmup + args.steps + 2)
        spread = mean_len - min(256, mean_len // 4)
    else:
        mean_len = 40 if args.tiny else 400
        n_docs = 2 * (args.warmup + args.steps + 2) * tokens // mean_len
        spread = mean_len // 4
    return packed_token_dataset(n_docs, SHAPES[shape]["vocab_size"], mean_len=mean_len, spread=spread)


def row_table(rows: list[dict], recipe: str, paths: list[str]) -> str:
    """The markdown table of one row length's paths: ``recipe_table``'s for the Unsloth recipe, else
    ``markdown_table`` with plain ``sft`` as the baseline."""
    if recipe == "unsloth":
        from .recipe_table import table

        return table(rows)
    return markdown_table(rows, baseline="sft" if "sft" in paths else None)


def main(argv: list[str] | None = None) -> list[dict]:
    """Every path at every ``--tokens`` on one loaded base model; writes and returns the rows."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = workload_parser(__doc__.splitlines()[0])
    parser.add_argument("--paths", default="sft,fastsft")
    parser.add_argument("--profile", default=None, help="profile this path (one of --paths, or an extra one)")
    parser.add_argument("--host-profile", default=None, help="run this path once more with its host side sampled")
    parser.add_argument("--first-steps-profile", action="store_true",
                        help="sample the host over each path's first --warmup steps, each on its own (pyinstrument)")
    parser.add_argument("--gaps", default=None, help="run this path once more with the GPU alone profiled: its idle time")
    parser.add_argument("--gap-host", default=None,
                        help="run this path once more, host and Python stacks recorded: what the host ran in each GPU gap")
    parser.add_argument("--recipe", default="packed", choices=["packed", "notebook", "unsloth"],
                        help="packed: one packed row of --tokens per step, batch 1, LoRA r16; notebook: the common "
                             "notebook recipe, batch 2 x 4 accumulation steps, padding-free without packing, "
                             "documents of 256 to --tokens - 256 tokens, LoRA r32; unsloth: Unsloth's notebook "
                             "recipe (benchmarks/unsloth_recipe.py), timed as the user waits")
    parser.add_argument("--no-4bit", action="store_true", help="bf16 LoRA instead of QLoRA")
    parser.add_argument("--memory-log", action="store_true",
                        help="print the GPU memory before each row and after every optimizer step (allocated, reserved, "
                             "peak), nbkit's INFO messages (what each speedup decided, from which memory figures) "
                             "and each CUDA-graph capture's reserved memory")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on the CPU: checks the script runs")
    parser.add_argument("--model-dir", default=None,
                        help="the random model's folder: reused when it holds one, saved there otherwise, and kept "
                             "(default: a new temporary folder)")
    parser.add_argument("--each-path-alone", action="store_true",
                        help="run every path in a Python process of its own, one after another, on the model saved "
                             "once: no path inherits another's allocator cache, kernels or warm-up, as in a fresh "
                             "notebook")
    args = resolve_defaults(parser.parse_args(argv))
    if not (torch.cuda.is_available() or args.tiny):
        raise SystemExit("this benchmark needs a CUDA GPU (or --tiny for a CPU smoke run)")
    if args.memory_log:
        log_memory()
    shape = "tiny" if args.tiny else args.shape
    quantize = not (args.no_4bit or args.tiny)
    folder = args.model_dir or tempfile.mkdtemp(prefix=f"nbkit-e2e-{shape}-")
    reused = os.path.isfile(os.path.join(folder, "config.json"))
    save_s = 0.0 if reused else save_random_model(shape, args.layers, folder, args.tiny)
    if args.each_path_alone:
        try:
            return each_path_alone(args, argv, folder, shape)
        finally:
            if not args.model_dir:  # a 14B model's folder is 30 GB
                shutil.rmtree(folder, ignore_errors=True)
    if args.recipe == "unsloth":  # loaded under the first row's cap, as the card it stands for must (Unsloth's is)
        cap_memory(caps_of(args.tokens)[0])
    base, load_s = load_base(folder, quantize, torch.float16 if args.fp16 else torch.bfloat16)
    weights = "nf4" if quantize else ("fp16" if args.fp16 else "bf16") if torch.cuda.is_available() else "fp32"
    saved = f"reused from {folder}" if reused else f"saved in {save_s:.1f} s"
    print(f"model {shape}: {saved}, loaded ({weights}) in {load_s:.1f} s", flush=True)
    paths = split_paths(args.paths)
    if args.profile and args.profile not in paths:
        paths.append(args.profile)
    rows: list[dict] = []
    tokens_spec = args.tokens  # run_path reads the row's length from args.tokens
    for spec_row in tokens_spec.split(","):
        tokens, _, cap = spec_row.partition("@")
        tokens = args.tokens = int(tokens)
        cap_gib = float(cap) if cap else None
        cap_memory(cap_gib)
        if args.memory_log and torch.cuda.is_available():
            print(f"memory before the {spec_row} row: allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
                  f"reserved {torch.cuda.memory_reserved() / 2**30:.2f}", flush=True)
        dataset = recipe_dataset(args, shape, tokens)
        run_rows = []
        runs = [(spec, "") for spec in paths] + ([(args.host_profile, "host")] if args.host_profile else []) \
            + ([(args.gaps, "gaps")] if args.gaps else []) + ([(args.gap_host, "gap_host")] if args.gap_host else [])
        for spec, extra in runs:
            try:
                row, base, text = run_path(spec, base, dataset, args, profile=spec == args.profile and not extra,
                                           host=extra == "host", gaps=extra == "gaps", gap_host=extra == "gap_host")
                if text:
                    key = "first_steps_host" if "first_steps_host" in row else EXTRA_TEXT.get(extra, "profile")
                    print(f"\n### {TEXT_TITLE[key]} of {spec} ({shape}, {tokens} tokens)\n\n{text}\n", flush=True)
                    row[key] = text
                if extra:
                    row["path"] = f"{spec} ({'host-profiled' if extra in ('host', 'gap_host') else 'GPU-profiled'})"
            except Exception as exc:
                row = failed_row(spec, exc, **getattr(exc, "nbkit_stats", {}))
            run_rows.append(dict(row, shape=shape, tokens=tokens, weights=weights, load_s=load_s, recipe=args.recipe,
                                 cap_gib=cap_gib, compute=compute_of(args)))
            print({k: v for k, v in run_rows[-1].items() if not isinstance(v, list) and k not in TEXT_TITLE}, flush=True)
        rows += run_rows
        table = row_table(run_rows, args.recipe, paths)
        what = f"{tokens} tokens/step" if args.recipe == "packed" else f"{args.recipe} recipe, rows <= {tokens} tokens"
        what += f", process capped at {cap_gib:g} GiB" if cap_gib else ""
        print(f"\n{shape}, {what}, {'QLoRA nf4' if quantize else 'LoRA ' + weights}\n{table}\n",
              flush=True)
        # after each row length, so a run cut short keeps the lengths it finished
        write_results("e2e", rows, argv=argv, name=results_name(shape, args, tokens_spec, paths),
                      notes="CPU smoke run (--tiny)" if args.tiny else "")
    if not args.model_dir:  # the base is in memory; a 14B model's folder is 30 GB of disk
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def compute_of(args: argparse.Namespace) -> str:
    """The compute dtype a run trains in: fp32 (--tiny, on the CPU), fp16 (--fp16) or bf16."""
    return "fp32" if args.tiny else "fp16" if args.fp16 else "bf16"


def caps_of(tokens: str) -> list[float | None]:
    """The cap in GiB of each row of ``--tokens`` (``N@G``), None where uncapped."""
    return [float(cap) if cap else None for cap in (t.partition("@")[2] for t in tokens.split(","))]


def results_name(shape: str, args: argparse.Namespace, tokens: str, paths: list[str]) -> str:
    """The results file's name (without .json) under $OUT (``results_names.results_name``): the recipe (none for the
    packed rows), the shape, the compute dtype, the caps of ``tokens`` (``--tokens``) and the paths."""
    recipe = None if args.recipe == "packed" else args.recipe
    return results_names.results_name("e2e", shape, compute_of(args), caps_of(tokens), paths, recipe=recipe)


def each_path_alone(args: argparse.Namespace, argv: list[str], folder: str, shape: str) -> list[dict]:
    """``--each-path-alone``: each path of ``--paths`` runs as ``python -m benchmarks.e2e`` of its own (the same
    arguments, that one path, ``--model-dir`` the saved model), one after another; their rows, merged row length by
    row length in ``--paths`` order, are this run's results (each row says ``process``: which path's process)."""
    import json
    import subprocess

    if args.profile or args.host_profile or args.gaps or args.gap_host:
        raise SystemExit("--each-path-alone times paths only: profile a path in a run of its own")
    own = [a for a in argv if a != "--each-path-alone"]
    by_path: list[tuple[str, list[dict]]] = []
    for index, spec in enumerate(split_paths(args.paths), 1):
        with tempfile.TemporaryDirectory(prefix="nbkit-e2e-path-") as out:
            print(f"process {index}: {spec}", flush=True)
            subprocess.run([sys.executable, "-m", "benchmarks.e2e", *own, "--paths", spec, "--model-dir", folder],
                           check=False, env={**os.environ, "OUT": out})
            try:
                with open(os.path.join(out, f"{results_name(shape, args, args.tokens, [spec])}.json")) as f:
                    found = json.load(f)["figures"]
            except (OSError, ValueError, KeyError):
                found = []
        by_path.append((spec, [dict(row, process=index) for row in found]))
    rows: list[dict] = []
    for spec_row in args.tokens.split(","):
        tokens, _, cap = spec_row.partition("@")
        key = (int(tokens), float(cap) if cap else None)
        run_rows = []
        for index, (spec, found) in enumerate(by_path, 1):
            row = next((r for r in found if (r.get("tokens"), r.get("cap_gib")) == key), None)
            if row is None:  # its process stopped before this row length (its output above says why)
                row = dict(failed_row(spec, RuntimeError("its process wrote no row of this length")), process=index,
                           shape=shape, tokens=key[0], cap_gib=key[1])
            run_rows.append(row)
        rows += run_rows
        table = row_table(run_rows, args.recipe, [spec for spec, _ in by_path])
        capped = f", process capped at {cap} GiB" if cap else ""
        print(f"\n{shape}, {tokens} tokens/step{capped}, each path in its own process\n{table}\n", flush=True)
    write_results("e2e", rows, argv=argv, name=results_name(shape, args, args.tokens, split_paths(args.paths)),
                  notes="CPU smoke run (--tiny)" if args.tiny else "")
    return rows


if __name__ == "__main__":
    main()
