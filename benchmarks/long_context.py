"""The longest single sequence that trains in a GPU memory budget, trained the way a user trains it.

Workload: a Llama-3.1-8B-shaped model (``--shape 8b``: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 kv
heads, head_dim 128, vocab 128256, rope_theta 500000, untied head; max_position_embeddings 1,048,576) or a
Qwen3-14B-shaped one (``--shape 14b``: ``benchmarks.e2e.SHAPES["14b"]``, max_position_embeddings raised the same
way), random weights saved once and loaded as a user loads them (``benchmarks.e2e.load_base``: bitsandbytes NF4,
double quant, bf16 compute). QLoRA r=32, alpha 32, on all 7 projections; batch 1; gradient checkpointing on
(non-reentrant); the dataset is one row of L random token ids (padding-free, no packing: the row is the step's
sequence), trained by each trainer's own ``train()``.

Paths (``--paths``, comma separated):
- ``sft``: plain TRL ``SFTTrainer`` (sdpa attention). TRL 1.16 computes its loss through its own fused, tiled LM head
  (``trl.trainer.utils.add_fused_lm_head``): the (L x vocab) logits never exist in plain TRL either.
- ``sft_full_logits``: plain TRL made to build the logits: a ``compute_loss_func`` (transformers' own
  ``ForCausalLMLoss`` on ``outputs.logits``), the branch of TRL 1.16's ``SFTTrainer.compute_loss`` that runs the
  model's ordinary forward. What the fused head saves. That branch also runs a second, no-grad fused forward for
  TRL's entropy/accuracy metrics, so its step time is not that of a trainer without the fused head.
- ``fastsft``: ``FastSFT`` with its defaults (since 2026-12-01 ``tiled_mlp="auto"``: MLP calls tiled only when short
  of memory; the first run measured ``tiled_mlp=False`` as the default); ``fastsft[switch=value;...]``: switches
  changed, e.g.
  ``fastsft[tiled_mlp=True]``, ``fastsft[offload_checkpointing=False]`` (the switches are passed through as given).
  A 12 GB host (free Colab): ``fastsft[offload_max_host_bytes=8589934592]`` caps the offload pool at 8 GiB, the rest
  of such a host going to the process itself (~2.5 GiB of RSS besides the pool here) and the system; the layer
  inputs past the cap stay on the GPU. It caps what nbkit pins, not the process: the table's RSS column says the rest.

Method:
- Budget: the H200 is capped with ``torch.cuda.set_per_process_memory_fraction(budget / total)`` (budgets in GiB,
  ``--budgets``). The cap applies to torch's caching allocator (reserved bytes, the loaded model included); the CUDA
  context (~0.5 GiB) is outside it, so a real card of that size has a little less. ``torch.cuda.mem_get_info`` does
  not see the cap: code that sizes itself by free memory (nbkit's offload prefetch check) sees the whole H200; the
  prefetch allocation itself falls back when the cap refuses it.
- A try (``run_try``): one fresh trainer on the loaded base (its own LoRA, same seed, unloaded afterwards as
  ``benchmarks.e2e`` does) and ``train()`` over two rows in order (``train_sampling_strategy="sequential"``): a
  short row, whose optimizer step creates the AdamW states, then the row of L tokens, which so runs with the memory
  of a steady-state step: one long step per try instead of two. The short row is 2,048 tokens on the 8B (1,639 on
  the 14B), not less: FastSFT's ``offload_checkpointing="auto"`` decides at the first step, from one layer input's
  size (>= 16 MiB), and must decide as a user's first, long, row makes it decide. Before the try: gc,
  ``empty_cache``, ``release_host_cache`` (pinned blocks); peak counters and this process's peak RSS (VmHWM, via
  /proc/self/clear_refs) reset. Outcome: ok / oom (CUDA OOM, also a library failing to allocate at the edge) /
  host-oom / error / time-cap. Recorded: step seconds (the long step; for offloaded paths its first touch of the
  pinned pool is included), peak GPU allocated and reserved, peak host RSS, nbkit's pinned offload pool, torch's
  pinned-allocator peak, host RAM in use, loss.
- The search, per (path, budget): a line of peak GPU allocated against L through this path's two longest fits (any
  budget; this budget's only for FastSFT's default, whose ``tiled_mlp="auto"`` tiles near the limit only; before
  there are two, the prior slope below, or the line run 2 measured) predicts where the peak reaches ``--fill`` x budget
  (``offload_longest.predict_max``); ``offload_longest.next_try`` picks the next length (just past the predicted
  limit, then just under it; model-guided bisection inside (longest fit, first failure) on a grid of the largest
  power of two <= 1/16 of the expected limit, at least ``--min-resolution`` tokens), capped by host RAM for offloaded
  paths (``host_limit_tokens``). A fit at a smaller budget is a fit here, a failure at a larger one a failure here
  (both only narrow the bracket; the table says which fit was measured where). It stops when the bracket is within
  the resolution ("converged"), at ``--max-tokens``, after ``--max-tries``, or when the next try (its time predicted
  from this path's earlier tries, ``a L + b L^2``) would end past ``--time-budget-s``.
- Order: first the step time at ``--tokens-per-s-at`` (32K) for every path at the largest budget (one warm-up and
  two timed long steps; the median is the tokens/s figure), then the searches, cheapest first (by the predicted
  time of a try at the predicted limit), each until it stops. ``--time-budget-s`` counts from the start of the
  command, model save and load included.
- Processes: the tries run in one worker subprocess that loads the model once (~20 s for the 8B in 4 bits; one
  process per try would spend most of the budget loading). A CUDA OOM inside ``train()`` is recoverable in process
  (fresh trainer per try, the base restored); what is not: the kernel's OOM killer (pinned host memory), a CUDA
  error that poisons the context, a trainer half built. Then the worker dies or exits, the parent records the try
  in flight as host-oom / error, and starts a fresh worker that resumes every search from the recorded tries (the
  saved model is reused). The parent rewrites ``$OUT/long_context.json`` as records arrive and kills the worker at
  the time budget plus a grace period.

Prediction (written before the first run; 8B, H200). Fixed: NF4 linears 6.98e9 x 0.5 B + double-quant constants
~3.6 GB, bf16 embeddings and head 2 x 1.05 GB, LoRA r=32 (84M params, bf16 as TRL casts them) with gradients and
AdamW states 0.67 GB, dequantized-weight and fused-head tiles ~0.5 GB: ~6.5 GiB. Per token:
- sft: the 32 checkpointed bf16 layer inputs, 32 x 4096 x 2 B = 256 KiB (8 GiB per 32K tokens), plus the one layer
  being recomputed for its backward, ~300 KiB (gate, up, silu(gate), their product: 4 x 28 KiB at 14336 x 2 B, and
  their gradients; two fp32 RMSNorms, q/k/v and attention ~90 KiB), plus ~30 KiB at the head: ~0.58 MiB/token
  (0.55-0.7: the same count gave 0.75 where the 14B measured 0.86 MB/token in benchmarks/offload_longest.py).
- sft_full_logits: at the loss, bf16 logits (128256 x 2 B = 250 KiB) and their fp32 copy, log_softmax's fp32
  output kept for backward and in backward its gradient and input gradient (3 x 501 KiB) on top of the 256 KiB of
  checkpoints: ~1.8 MiB/token; the logits, not the layers, set the limit.
- fastsft: offloaded checkpointing (auto: on above 2,048 tokens here) takes the 256 KiB/token of layer inputs to
  pinned host memory (2 restore buffers of 8 KiB/token stay); Liger's SwiGLU (fused_kernels, where liger-kernel is
  installed) keeps gate and up only; the layer's backward working set dominates: ~0.27 MiB/token (0.23-0.3; ~0.35
  without Liger). Host: 256 KiB/token of pinned pool.
- fastsft[tiled_mlp=True]: the MLP intermediates exist one tile at a time (fixed); attention, the MLP's input and
  output and the head remain: ~0.12 MiB/token; host RAM (256 KiB/token pinned, 128 GiB on the H200 host) caps it
  near 450K tokens, the time of a step long before (attention is O(L^2): ~70 s per step at 128K).

| budget | sft | sft_full_logits | fastsft | fastsft[tiled_mlp=True] |
|---|---|---|---|---|
| 12 GiB | ~9.5K | ~3K | ~21K | ~45K |
| 16 GiB | ~16.5K | ~5.4K | ~36K | ~80K |
| 24 GiB | ~31K | ~10K | ~66K | ~145K |
| 40 GiB | ~59K | ~19K | ~127K | ~280K |
| 80 GiB | ~130K | ~42K | ~280K | host/time bound |

Step time at 32K (H200): sft ~6-7 s (linear layers ~45 GFLOP/token in forward, recompute and backward; causal
attention about as much again at 32K); fastsft within 10% of it (the offload copies hide behind compute);
sft_full_logits ~20% slower (the extra metrics forward); tiled_mlp ~10-20% slower (one more MLP forward per layer).
In ~8 minutes the searches converge for the small budgets; tries of 100K+ tokens take a minute or more each, so the
large budgets of the fastsft paths end at the time budget with the bracket they reached.

    python -m benchmarks.long_context --shape 8b --budgets 12,16,24,40,80 \\
        --paths 'sft,sft_full_logits,fastsft,fastsft[tiled_mlp=True]' --tokens-per-s-at 32768 --time-budget-s 480
    python -m benchmarks.long_context --tiny     # CPU smoke run: tiny llama, a fake OOM limit; figures mean nothing
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from nbkit.memory import GiB, MiB, host_memory
from nbkit.ops.offload_lanes import host_available, release_host_cache

from .common import StepTimer, git_commit, parse_path, split_paths, timed_trainer, write_results
from .e2e import LORA_TARGETS, _restore_base, load_base
from .e2e import SHAPES as E2E_SHAPES
from .long_context_search import (
    MAX_POSITIONS,
    bracket,
    budget_dependent,
    crash_record,
    eta_s,
    expected_cost,
    inflight,
    offloaded,
    prior_line,
    resolution,
    run_search,
    warm_length,
)
from .offload_longest import HOST_RESERVE, failure_kind, host_limit_tokens, predict_max

NAME = "long_context"
ROOT = Path(__file__).resolve().parents[1]
LORA_R = LORA_ALPHA = 32
WARM_TOKENS = 256  # the first row (at least): its optimizer step creates the AdamW states before the long row runs
OFFLOAD_MIN_BYTES = 16 * MiB  # FastSFTConfig.offload_min_bytes' default: 'auto' offloads layer inputs at least this big
PATHS = ("sft", "sft_full_logits", "fastsft")
DEFAULT_PATHS = "sft,sft_full_logits,fastsft,fastsft[tiled_mlp=True]"
RESTART_RC = 3  # the worker asks for a fresh process (a CUDA error, or a base it could not restore)

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "14b": ("qwen3", dict(E2E_SHAPES["14b"], rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "tiny": ("llama", dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                           tie_word_embeddings=False)),
}

# ------------------------------------------------------------------------------------------------- the tries (GPU)
def save_random(shape: str, layers: Optional[int], folder: str, tiny: bool) -> float:
    """A random-weight model of ``shape`` saved to ``folder`` (built on the GPU in bf16); returns seconds."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    t0 = time.perf_counter()
    family, cfg = SHAPES[shape]
    cfg = dict(cfg, max_position_embeddings=MAX_POSITIONS)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = (LlamaConfig if family == "llama" else Qwen3Config)(**cfg)
    torch.manual_seed(0)
    device, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    del model
    release()
    return time.perf_counter() - t0


def release() -> None:
    """Give back what the last try held: unreachable tensors, cached VRAM blocks, cached pinned host blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    release_host_cache()


def _status_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set (VmHWM) so a try reads its own peak; False where Linux refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _offload_stats(trainer: Any) -> Any:
    """The stats of the offload engine of FastSFT's layer runner (its pinned host pool), if it has one."""
    for s in list(getattr(trainer, "_speedups", []) or []):
        offload = getattr(s, "offload", None)
        stats = getattr(offload, "stats", None)
        if stats is not None and hasattr(stats, "host_bytes"):
            return stats
    return None


def _host_watch() -> Any:
    """A callback that samples host memory at each step's end: RAM in use, nbkit's pinned pool, host-short inputs."""
    from transformers import TrainerCallback

    class HostWatch(TrainerCallback):
        def __init__(self) -> None:
            self.trainer, self.used, self.pool, self.host_short = None, 0, 0, 0

        def on_step_end(self, args, state, control, **kwargs):
            used, _ = host_memory()
            self.used = max(self.used, used or 0)
            stats = _offload_stats(self.trainer)
            if stats is not None:
                self.pool = max(self.pool, int(stats.host_bytes))
                self.host_short = max(self.host_short, int(stats.host_short))

    return HostWatch()


def full_logits_loss(vocab_size: int) -> Callable:
    """``compute_loss_func`` for ``sft_full_logits``: the model's ordinary causal-LM loss on its full logits."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        return ForCausalLMLoss(outputs.logits, labels, vocab_size, num_items_in_batch=num_items_in_batch)

    return loss


def classify(err: BaseException) -> str:
    """A try's failure: "oom" (CUDA), "host-oom", or "error"."""
    text = str(err)
    if isinstance(err, MemoryError) or "DefaultCPUAllocator" in text or "can't allocate memory" in text:
        return "host-oom"
    kind = failure_kind(err)
    return "host-oom" if kind == "host RAM" else "oom" if kind else "error"


_CUDA_BROKEN = ("CUDA error", "illegal memory access", "device-side assert", "CUBLAS_STATUS_EXECUTION_FAILED",
                "cudaError", "AcceleratorError", "misaligned address")


def make_config(spec: str, ctx: argparse.Namespace, steps: int) -> Any:
    """The path's training arguments: TRL's ``SFTConfig`` or nbkit's ``FastSFTConfig`` with its switches."""
    from trl import SFTConfig

    from nbkit import FastSFTConfig

    name, overrides = parse_path(spec)
    common = dict(
        output_dir=os.path.join(ctx.workdir, "trainer"), max_steps=steps, per_device_train_batch_size=1,
        padding_free=True, packing=False, max_length=None, train_sampling_strategy="sequential",
        bf16=not ctx.tiny, use_cpu=ctx.tiny, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, learning_rate=1e-4, logging_steps=1, report_to=[],
        save_strategy="no", dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    if name == "fastsft":
        return FastSFTConfig(**common, **{"live_dashboard": False, **overrides})
    return SFTConfig(**common, **overrides)


def run_try(base: torch.nn.Module, spec: str, budget: tuple[str, Optional[float]], tokens: int,
            ctx: argparse.Namespace, kind: str = "search", long_steps: int = 1, warmup: int = 0,
            res: Optional[int] = None) -> tuple[dict, torch.nn.Module]:
    """One try: a fresh trainer trains a warm row and then ``long_steps`` rows of ``tokens``; its record and the
    base model back (LoRA unloaded)."""
    from datasets import Dataset
    from peft import LoraConfig

    name, _ = parse_path(spec)
    label, gib = budget
    cuda = torch.cuda.is_available()
    rec: dict[str, Any] = dict(event="try", kind=kind, path=spec, budget=label, budget_gib=gib, tokens=tokens,
                               res=res, outcome=None, error=None, host_short=0, peak_gib=0.0)
    release()
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(gib * GiB / total)) if gib else 1.0)
        torch.cuda.reset_peak_memory_stats()
        with contextlib.suppress(Exception):
            torch.cuda.reset_peak_host_memory_stats()
        if gib and torch.cuda.memory_reserved() > gib * GiB:
            rec.update(outcome="oom", error=f"the loaded model alone holds {torch.cuda.memory_reserved() / GiB:.2f} "
                       f"GiB, over the budget", wall_s=0.0)
            return rec, base
    rec["rss_scope"] = "try" if reset_peak_rss() else "process"
    gen = torch.Generator().manual_seed(tokens)
    config = make_config(spec, ctx, steps=1 + long_steps)
    auto = -(-int(getattr(config, "offload_min_bytes", OFFLOAD_MIN_BYTES)) // (ctx.hidden * 2)) if cuda else 0
    rec["warm_tokens"] = warm = warm_length(tokens, ctx.warm_tokens, auto)
    rows = [torch.randint(10, ctx.vocab_size, (n,), generator=gen).tolist() for n in [warm] + [tokens] * long_steps]
    dataset = Dataset.from_dict({"input_ids": rows})
    timer, watch = StepTimer(), _host_watch()
    extra = {"compute_loss_func": full_logits_loss(ctx.vocab_size)} if name == "sft_full_logits" else {}
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS, lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    base.set_attn_implementation("sdpa")
    hook = fake_limit_hook(base, ctx.fake_limit) if ctx.fake_limit else None
    trainer = None
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        trainer = timed_trainer(name == "fastsft")(
            model=base, args=config, train_dataset=dataset, peft_config=lora, callbacks=[timer, watch],
            processing_class=ctx.tokenizer, **extra)  # only its pad/eos ids are used: the data are token ids
        trainer.step_timer = timer
        watch.trainer = trainer
        trainer.train()
        rec["outcome"] = "ok"
    except Exception as err:  # classified; the try's record says what it was
        rec["outcome"] = classify(err)
        rec["error"] = f"{type(err).__name__}: {err}"[:400]
        traceback.clear_frames(err.__traceback__)  # its frames hold the step's activations
    finally:
        if hook is not None:
            hook.remove()
    rec["wall_s"] = time.perf_counter() - t0
    rec["speedups"] = list(getattr(trainer, "nbkit_attached", []) or [])
    if trainer is None:
        rec["restart"] = True  # the trainer was half built: the base may hold half an adapter
    else:
        try:
            base = _restore_base(trainer)
        except Exception as err:
            rec["restart"] = True
            rec["error"] = ((rec["error"] or "") + f" | restoring the base: {type(err).__name__}: {err}")[:600]
    if rec["outcome"] == "error" and any(m in (rec["error"] or "") for m in _CUDA_BROKEN):
        rec["restart"] = True
    watch.trainer = None
    del trainer
    release()
    times = timer.times
    long_ms = times.step_ms[1:]
    timed = long_ms[warmup:] if len(long_ms) > warmup else long_ms
    rec.update(
        step_s=statistics.median(timed) / 1000 if timed and rec["outcome"] == "ok" else None,
        step_s_all=[ms / 1000 for ms in times.step_ms], tokens_all=times.tokens,
        warm_step_s=times.step_ms[0] / 1000 if times.step_ms else None,
        loss=times.losses[1] if len(times.losses) > 1 else None, losses=times.losses,
        peak_gib=(torch.cuda.max_memory_allocated() / GiB) if cuda else 0.0,
        reserved_gib=(torch.cuda.max_memory_reserved() / GiB) if cuda else 0.0,
        rss_peak_gib=(_status_bytes("VmHWM") or 0) / GiB, host_used_gib=watch.used / GiB,
        host_pool_gib=watch.pool / GiB, host_short=watch.host_short, pinned_torch_gib=_torch_pinned_peak() / GiB,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    )
    if rec["step_s"]:
        rec["tok_per_s"] = tokens / rec["step_s"]
    if not cuda:
        rec["peak_gib"] = 0.0  # no GPU: no peak line (a CPU's resident set is not what the budget caps)
    return rec, base


def _torch_pinned_peak() -> int:
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0))
    except Exception:
        pass
    return 0


def fake_limit_hook(base: torch.nn.Module, limit: int) -> Any:
    """--tiny: a CUDA OOM raised by the first decoder layer for rows longer than ``limit`` (no budget on a CPU)."""
    def check(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] > limit:
            raise torch.OutOfMemoryError(f"fake OOM (--tiny-fake-limit {limit:,}): a row of {x.shape[-2]:,} tokens")

    return base.model.layers[0].register_forward_pre_hook(check, with_kwargs=True)


# ------------------------------------------------------------------------------------------------------ the worker
def _emit(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def budgets_of(args: argparse.Namespace) -> list[tuple[str, Optional[float]]]:
    if args.tiny:
        return [("fake", None)]
    return [(f"{g:g} GiB", g) for g in sorted({float(b) for b in args.budgets.split(",") if b.strip()})]


def _describe(r: dict) -> str:
    extra = f" ({r['error'][:160]})" if r.get("error") else ""
    step = f", step {r['step_s']:.2f} s" if r.get("step_s") else ""
    return (f"[{r['budget']}] {r['path']} {r['tokens']:,} tokens ({r['kind']}): {r['outcome']}{extra} in "
            f"{r.get('wall_s') or 0:.1f} s{step}, peak {r.get('peak_gib') or 0:.2f} GiB "
            f"(reserved {r.get('reserved_gib') or 0:.2f}), host RSS {r.get('rss_peak_gib') or 0:.1f} GiB, "
            f"pool {r.get('host_pool_gib') or 0:.1f} GiB, loss {r.get('loss')}")


def worker(workdir: str) -> int:
    """The tries: loads the model once, runs the timing tries and the searches, appends each record to
    ``records.jsonl``; resumes from the records already there (a worker that died before it)."""
    from nbkit.demo.tokenizer import load_demo_tokenizer

    from .common import environment

    wd = Path(workdir)
    plan = json.loads((wd / "plan.json").read_text())
    args = parse_args(plan["argv"])
    out = wd / "records.jsonl"
    records = read_records(out)
    if args.tiny:
        torch.set_num_threads(1)  # a tiny model: more threads only contend
    cuda = torch.cuda.is_available()
    deadline = plan["start"] + args.time_budget_s - 5
    shape = "tiny" if args.tiny else args.shape
    folder = wd / "model"
    save_s = None
    if not (folder / "saved").exists():
        folder.mkdir(exist_ok=True)
        save_s = save_random(shape, args.layers, str(folder), args.tiny)
        (folder / "saved").write_text("ok")
    base, load_s = load_base(str(folder), quantize=not args.tiny)
    cfg = base.config
    ctx = argparse.Namespace(tiny=args.tiny, workdir=str(wd), vocab_size=cfg.vocab_size, hidden=cfg.hidden_size,
                             tokenizer=load_demo_tokenizer(), warm_tokens=args.warm_tokens,
                             fake_limit=args.tiny_fake_limit if args.tiny else None)
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    _emit(out, dict(event="model", shape=shape, layers=layers, save_s=save_s, load_s=load_s,
                    weights="nf4" if not args.tiny else "fp32", environment=environment(), git_commit=git_commit()))
    print(f"[{NAME}] {shape} x {layers} layers: saved in {save_s or 0:.1f} s, loaded in {load_s:.1f} s; "
          f"{deadline - time.time():.0f} s left", flush=True)

    paths = []
    for spec in split_paths(args.paths):  # a switch this checkout does not have fails here, once, not per try
        try:
            make_config(spec, ctx, steps=1)
            paths.append(spec)
        except Exception as err:
            if not any(r.get("event") == "path_error" and r["path"] == spec for r in records):
                _emit(out, dict(event="path_error", path=spec, error=f"{type(err).__name__}: {err}"[:300]))
            print(f"[{NAME}] {spec}: cannot be built here ({err}); skipped", flush=True)
    budgets = budgets_of(args)
    tries = {p: [r for r in records if r.get("event") == "try" and r["path"] == p] for p in paths}
    every: list[dict] = [t for p in paths for t in tries[p]]

    def overhead() -> float:
        extra = [t["wall_s"] - sum(t["step_s_all"][1:]) for t in every
                 if t["outcome"] == "ok" and t.get("wall_s") and t.get("step_s_all")]
        return statistics.median(extra) if extra else (1.0 if args.tiny else 10.0)

    def eta_for(spec: str, long_steps: int = 1) -> Callable[[int], Optional[float]]:
        def eta(t: int) -> Optional[float]:
            own = [(x["tokens"], x["step_s"]) for x in tries.get(spec, []) if x.get("step_s")]
            pts = own or [(x["tokens"], x["step_s"]) for x in every if x.get("step_s")]
            return eta_s(pts, t, overhead(), long_steps)
        return eta

    def one(spec: str, budget: tuple, t: int, kind: str, res: Optional[int] = None, long_steps: int = 1,
            warmup: int = 0) -> dict:
        nonlocal base
        _emit(out, dict(event="start", path=spec, budget=budget[0], budget_gib=budget[1], tokens=t, kind=kind,
                        res=res))
        rec, base = run_try(base, spec, budget, t, ctx, kind=kind, long_steps=long_steps, warmup=warmup, res=res)
        _emit(out, rec)
        every.append(rec)  # tries[spec] gets it from the caller (run_search appends its own tries)
        print(_describe(rec), flush=True)
        return rec

    # the step time at --tokens-per-s-at, every path at the largest budget
    tps = args.tokens_per_s_at
    if tps:
        top = budgets[-1]
        for spec in paths:
            if any(t["kind"] == "timing" for t in tries[spec]):
                continue
            steps = args.timing_warmup + args.timing_steps
            e = eta_for(spec, steps)(tps)
            if e is not None and time.time() + e > deadline:
                _emit(out, dict(event="timing_skipped", path=spec, tokens=tps, why=f"time budget (~{e:.0f} s)"))
                continue
            rec = one(spec, top, tps, "timing", long_steps=steps, warmup=args.timing_warmup)
            tries[spec].append(rec)
            if rec.get("restart"):
                return RESTART_RC

    # the searches, cheapest first
    done = {(r["path"], r["budget"]) for r in records if r.get("event") == "search_end"}
    searched = split_paths(args.search_paths) if args.search_paths else paths
    pending = [(spec, b) for b in budgets for spec in paths if spec in searched and (spec, b[0]) not in done]

    def implied(spec: str, gib: Optional[float]) -> tuple[int, Optional[int]]:
        oks = [t["tokens"] for t in tries[spec] if t["outcome"] == "ok" and (t.get("budget_gib") or 0) < (gib or 0)]
        fails = [t["tokens"] for t in tries[spec] if t["outcome"] in ("oom", "host-oom")
                 and (t.get("budget_gib") or 0) > (gib or 0)]
        return max(oks, default=0), min(fails, default=None)

    def cost(item: tuple) -> float:
        spec, (label, gib) = item
        line = [t for t in tries[spec] if t["outcome"] == "ok" and t.get("peak_gib")]
        cap = gib * args.fill if (gib and cuda) else None
        return expected_cost(line, cap, prior_line(shape, spec), eta_for(spec), args.start_tokens)

    while pending:
        pending.sort(key=lambda item: (cost(item), budgets.index(item[1])))
        spec, budget = pending.pop(0)
        label, gib = budget
        cap = gib * args.fill if (gib and cuda) else None
        prior = prior_line(shape, spec)
        here = [t for t in tries[spec] if t["budget"] == label]
        lo_i, hi_i = implied(spec, gib)
        line = [t for t in (here if budget_dependent(spec) else tries[spec]) if t["outcome"] == "ok" and t.get("peak_gib")]
        pred = predict_max(line, cap, prior)
        res = next((t["res"] for t in here if t.get("res")), None) or resolution(
            pred if pred and pred > 0 else max(lo_i, args.start_tokens), args.min_resolution)

        def host_limit(spec: str = spec) -> Optional[int]:
            if not offloaded(spec, cuda):
                return None
            room = (host_available() or 2**50) - HOST_RESERVE
            return host_limit_tokens("nbkit", layers, hidden, room)

        stop = run_search(
            lambda t, spec=spec, budget=budget, res=res: one(spec, budget, t, "search", res=res),
            tries[spec], label, cap, prior=prior, res=res, deadline=deadline, clock=time.time, eta=eta_for(spec),
            implied_lo=lo_i, implied_hi=hi_i, host_limit=host_limit, max_tokens=args.max_tokens,
            start_tokens=args.start_tokens, max_tries=args.max_tries, same_budget_line=budget_dependent(spec))
        if stop == "restart":
            return RESTART_RC
        line = [t for t in tries[spec] if t["outcome"] == "ok" and t.get("peak_gib")]
        _emit(out, dict(event="search_end", path=spec, budget=label, budget_gib=gib, stopped_by=stop, resolution=res,
                        implied_fit=lo_i, implied_fail=hi_i, predicted_tokens=predict_max(line, cap, prior)))
        print(f"[{label}] {spec}: {stop}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------------ the parent
def summarize(records: Sequence[dict], spec: str, budget: tuple[str, Optional[float]]) -> dict:
    """One (path, budget) summary row: longest fit, first failure, and the figures at the longest fit."""
    label, gib = budget
    tries = [r for r in records if r.get("event") == "try" and r["path"] == spec]
    here = [t for t in tries if t["budget"] == label]
    end = next((r for r in records if r.get("event") == "search_end" and r["path"] == spec and r["budget"] == label),
               {})
    lo, hi = bracket(here)
    below = [t for t in tries if t["outcome"] == "ok" and (t.get("budget_gib") or 0) < (gib or 0) and t["tokens"] > lo]
    fit = max((t for t in here if t["outcome"] == "ok"), key=lambda t: t["tokens"], default=None)
    first = min((t for t in here if t["tokens"] == hi), key=lambda t: t["tokens"], default=None) if hi else None
    oks = sorted((t for t in tries if t["outcome"] == "ok" and t.get("peak_gib")), key=lambda t: t["tokens"])
    slope = None
    if len(oks) >= 2 and oks[-1]["tokens"] > oks[0]["tokens"]:
        a, b = oks[0], oks[-1]
        slope = (b["peak_gib"] - a["peak_gib"]) / (b["tokens"] - a["tokens"])
    timing = next((t for t in here if t["kind"] == "timing" and t.get("step_s")), None)
    implied = max(below, key=lambda t: t["tokens"]) if below else None

    def at(key: str) -> Any:
        return fit.get(key) if fit else None

    return dict(
        row="summary", path=spec, budget=label, budget_gib=gib, longest_tokens=lo or None,
        longest_implied_tokens=implied["tokens"] if implied else None,
        longest_implied_from=implied["budget"] if implied else None,
        first_failed_tokens=hi, failed_by=_failed_by(first),
        stopped_by=end.get("stopped_by") or ("not run" if not here else "not searched (timed only)"
                                             if all(t["kind"] == "timing" for t in here)
                                             else "not finished (worker stopped)"),
        resolution=end.get("resolution") or next((t["res"] for t in here if t.get("res")), None),
        tries=len(here), tries_s=sum(t.get("wall_s") or 0 for t in here), step_s=at("step_s"),
        tok_per_s=at("tok_per_s"), peak_gib=at("peak_gib"), reserved_gib=at("reserved_gib"),
        rss_peak_gib=at("rss_peak_gib"), host_pool_gib=at("host_pool_gib"), pinned_torch_gib=at("pinned_torch_gib"),
        loss=at("loss"), predicted_tokens=end.get("predicted_tokens"), gib_per_token=slope,
        mib_per_token=slope * GiB / MiB if slope else None,
        tok_per_s_timing=timing["tok_per_s"] if timing else None, timing_tokens=timing["tokens"] if timing else None,
    )


def _failed_by(first: Optional[dict]) -> Optional[str]:
    if first is None:
        return None
    return first["outcome"] + (f": {first['error'][:120]}" if first.get("error") else "")


def build_rows(records: Sequence[dict], args: argparse.Namespace) -> list[dict]:
    """The results' figures: every try (with the run's model figures) and one summary per (path, budget)."""
    model = next((r for r in records if r.get("event") == "model"), {})
    run = {k: model.get(k) for k in ("shape", "layers", "weights", "save_s", "load_s")}
    run.update(lora_r=LORA_R, lora_alpha=LORA_ALPHA, fill=args.fill, time_budget_s=args.time_budget_s)
    if args.tiny:
        run["tiny_fake_limit"] = args.tiny_fake_limit
    rows = [dict(run, row="try", **{k: v for k, v in r.items() if k not in ("event", "start")})
            for r in records if r.get("event") == "try"]
    bad = {r["path"]: r["error"] for r in records if r.get("event") == "path_error"}
    for budget in budgets_of(args):
        for spec in split_paths(args.paths):
            if spec in bad:
                rows.append(dict(run, row="summary", path=spec, budget=budget[0], budget_gib=budget[1],
                                 error=bad[spec], stopped_by="path not available"))
            else:
                rows.append(dict(run, **summarize(records, spec, budget)))
    return rows


def _fmt_tokens(n: Optional[int]) -> str:
    return f"{n:,}" if n else "-"


def tables(rows: Sequence[dict]) -> str:
    """The markdown tables: the search per budget and path, then the step time at the timing length."""
    lines = ["| budget | path | longest that trained | first that failed | step s | peak GPU GiB | host RAM GiB "
             "(RSS / pinned pool) | search |", "|" + "---|" * 8]
    for r in (r for r in rows if r["row"] == "summary"):
        longest = _fmt_tokens(r.get("longest_tokens"))
        if r.get("longest_implied_tokens"):
            longest += f" (>= {r['longest_implied_tokens']:,} at {r['longest_implied_from']})"
        failed = _fmt_tokens(r.get("first_failed_tokens"))
        if r.get("failed_by"):
            failed += f" ({r['failed_by'].split(':')[0]})"
        step = f"{r['step_s']:.2f}" if r.get("step_s") else "-"
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") else "-"
        host = f"{r['rss_peak_gib']:.1f} / {r.get('host_pool_gib') or 0:.1f}" if r.get("rss_peak_gib") else "-"
        search = f"{r['stopped_by']}; {r.get('tries', 0)} tries, {r.get('tries_s') or 0:.0f} s"
        if r.get("resolution"):
            search += f", res {r['resolution']:,}"
        lines.append(f"| {r['budget']} | {r['path']} | {longest} | {failed} | {step} | {peak} | {host} | {search} |")
    timing = [r for r in rows if r["row"] == "try" and r.get("kind") == "timing"]
    if timing:
        base = next((r for r in timing if r["path"] == "sft" and r.get("step_s")), None)
        lines += ["", "| path | tokens | step s (median) | tokens/s | vs sft | peak GPU GiB | outcome |",
                  "|" + "---|" * 7]
        for r in timing:
            ok = bool(r.get("step_s"))
            ratio = f"{base['step_s'] / r['step_s']:.2f}x" if ok and base else "-"
            lines.append(f"| {r['path']} | {r['tokens']:,} | {r['step_s']:.2f} | {r['tok_per_s']:,.0f} | {ratio} | "
                         f"{r['peak_gib']:.2f} | ok |" if ok else
                         f"| {r['path']} | {r['tokens']:,} | - | - | - | - | {r['outcome']} |")
    return "\n".join(lines)


def notes_for(args: argparse.Namespace, restarts: int) -> str:
    text = ("GPU budget emulated with torch.cuda.set_per_process_memory_fraction (caps torch's caching allocator, "
            "model included; the CUDA context is outside it). A try: a fresh trainer, a short row then one row of "
            "the length (steady-state memory in one long step; on CUDA the short row is long enough for FastSFT's "
            "'auto' offload to decide as for the long row). Host RAM: peak RSS of the worker per try (VmHWM reset), "
            "nbkit's pinned offload pool, torch's pinned-allocator peak.")
    if args.tiny:
        text = ("CPU smoke run (--tiny): tiny llama, fp32 LoRA, no GPU budget; OOM faked above "
                f"--tiny-fake-limit {args.tiny_fake_limit} tokens; the figures mean nothing. " + text)
    if restarts:
        text += f" The worker was restarted {restarts} time(s) (see the tries marked crashed)."
    return text


def run_parent(args: argparse.Namespace, argv: list[str]) -> dict:
    """Runs the worker (restarted after a crash), rewrites the results as records arrive, prints the tables."""
    workdir = tempfile.mkdtemp(prefix="nbkit-long-context-")
    wd = Path(workdir)
    start = time.time()
    (wd / "plan.json").write_text(json.dumps({"argv": argv, "start": start}))
    out = wd / "records.jsonl"
    hard = start + args.time_budget_s + args.grace_s
    restarts, seen = 0, 0
    payload: dict = {}

    def write() -> dict:
        records = read_records(out)
        model = next((r for r in records if r.get("event") == "model"), None)
        env = {"environment": model["environment"], "git_commit": model["git_commit"]} if model else None
        return write_results(NAME, build_rows(records, args), notes_for(args, restarts), argv=argv,
                             environment_of=env)

    try:
        while True:
            proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{NAME}", "--worker", workdir], cwd=ROOT)
            killed = False
            while proc.poll() is None:
                time.sleep(0.5 if args.tiny else 2.0)
                if time.time() > hard:
                    proc.kill()
                    killed = True
                    proc.wait()
                    break
                size = out.stat().st_size if out.exists() else 0
                if size != seen:
                    seen = size
                    payload = write()
            rc = proc.returncode
            if rc == 0:
                break
            records = read_records(out)
            start_rec = inflight(records)
            if start_rec is not None:
                crashed = crash_record(start_rec, rc, killed)
                _emit(out, crashed)
                print(f"[{NAME}] worker died (rc {rc}) under {start_rec['path']} at {start_rec['tokens']:,} tokens: "
                      f"{crashed['outcome']}", flush=True)
            if killed or rc == 2 or restarts >= args.max_restarts or (start_rec is None and rc != RESTART_RC):
                break
            restarts += 1
            print(f"[{NAME}] starting a fresh worker ({restarts}/{args.max_restarts})", flush=True)
        payload = write()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n" + tables(payload["figures"]) + "\n", flush=True)
    return payload


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8b", choices=["8b", "14b"])
    parser.add_argument("--layers", type=int, default=None, help="shrink the model (default: all layers)")
    parser.add_argument("--budgets", default="12,16,24,40,80", help="GPU memory budgets in GiB, comma separated")
    parser.add_argument("--paths", default=DEFAULT_PATHS)
    parser.add_argument("--search-paths", default=None,
                        help="the paths searched (default: all of --paths; the others are only timed)")
    parser.add_argument("--time-budget-s", type=float, default=480.0,
                        help="wall seconds for the whole run (model save and load included); default ~8 minutes")
    parser.add_argument("--tokens-per-s-at", type=int, default=None,
                        help="time each path at this length at the largest budget (0: off; default 32768)")
    parser.add_argument("--timing-steps", type=int, default=2)
    parser.add_argument("--timing-warmup", type=int, default=1)
    parser.add_argument("--warm-tokens", type=int, default=WARM_TOKENS)
    parser.add_argument("--fill", type=float, default=0.97, help="share of a budget the peak line may reach")
    parser.add_argument("--min-resolution", type=int, default=None, help="finest search grid (default 1024 tokens)")
    parser.add_argument("--start-tokens", type=int, default=None, help="first length without a prediction")
    parser.add_argument("--max-tokens", type=int, default=None, help=f"longest try (default {MAX_POSITIONS:,})")
    parser.add_argument("--max-tries", type=int, default=10, help="tries per (path, budget)")
    parser.add_argument("--max-restarts", type=int, default=4)
    parser.add_argument("--grace-s", type=float, default=60.0, help="past the time budget, the worker is killed")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU with a fake OOM limit")
    parser.add_argument("--tiny-fake-limit", type=int, default=300)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv))
    tiny = args.tiny
    for key, gpu, cpu in (("tokens_per_s_at", 32768, 128), ("min_resolution", 1024, 32), ("start_tokens", 8192, 128),
                          ("max_tokens", MAX_POSITIONS, 4096)):
        if getattr(args, key) is None:
            setattr(args, key, cpu if tiny else gpu)
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    """The benchmark (parent); ``--worker DIR`` is the process that runs the tries."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        sys.exit(worker(args.worker))
    if not (torch.cuda.is_available() or args.tiny):
        raise SystemExit("this benchmark needs a CUDA GPU (or --tiny for a CPU smoke run)")
    if args.search_paths and not set(split_paths(args.search_paths)) <= set(split_paths(args.paths)):
        raise SystemExit("--search-paths must be some of --paths")
    for spec in split_paths(args.paths):
        if parse_path(spec)[0] not in PATHS:
            raise SystemExit(f"unknown path {spec!r}: the paths are {', '.join(PATHS)} and fastsft[switch=value;...]")
    return run_parent(args, argv)


if __name__ == "__main__":
    main()
