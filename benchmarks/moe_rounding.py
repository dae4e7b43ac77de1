"""How far each MoE experts implementation lands from float64 in bf16 and fp16: nbkit's against transformers' own.

Why: in the bf16 and fp16 curve runs (``benchmarks.curves``, BENCHMARKS.md, Learning curves per family) FastSFT's MoE
curves sit further from plain TRL's than two plain attention kernels do. Rounding differences in an MoE block flip top-k
choices and so move a curve more than elsewhere; the question this answers is whether nbkit's experts path rounds
worse than transformers' or only differently.

Workload (CPU): per family the tiny model of tests/test_moe.py (2 layers, hidden 16, 8 experts of intermediate 24,
top-2, vocab 64; expert and router weights drawn at std 0.5 so that routing is decisive), ``--batches`` random
batches of 2 x 32 token ids, next-token cross entropy on random labels, the same weights everywhere. Reference:
transformers' eager experts in float64. Paths, every weight and activation in ``--dtype``: transformers'
``grouped_mm`` (its default), its ``eager`` loop, and nbkit's ``fast_moe_routing`` with its torch kernels (the
Triton ones need a GPU; on a CPU its backend is the contiguous slices per expert). Figures: the relative L2
distance to the float64 run of the logits and of all parameter gradients together, median and quartiles over the
batches (lower is closer to the exact result; a batch where rounding flips a top-k choice is far off, so the spread
is wide in bf16).

    python -m benchmarks.moe_rounding --dtype bf16,fp16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch
from torch import nn

from .common import write_results

FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
PATHS = ("grouped_mm", "eager", "nbkit")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def tiny_moe(family: str) -> nn.Module:
    """tests/test_moe.py's model: small, with decisive routing (weights at std 0.5, gpt-oss's clamp at 1)."""
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts_per_tok=2, attn_implementation="eager")
    if family == "gpt_oss":
        config, cls = GptOssConfig(intermediate_size=24, num_local_experts=8, **common,
                                   layer_types=["sliding_attention", "full_attention"]), GptOssForCausalLM
    elif family == "qwen3_moe":
        config, cls = Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=24, num_experts=8,
                                     decoder_sparse_step=1, mlp_only_layers=[], **common), Qwen3MoeForCausalLM
    else:
        config, cls = MixtralConfig(intermediate_size=24, num_local_experts=8, **common), MixtralForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    for name, p in model.named_parameters():
        if "experts" in name or "router" in name or "gate.weight" in name:
            nn.init.normal_(p, std=0.5)
    for m in model.modules():
        if hasattr(m, "limit"):
            m.limit = 1.0
    return model


def _step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and every parameter's gradient (flattened, in float64) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return logits.detach().double(), grads


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def measure(family: str, dtype: torch.dtype, batches: int) -> list[dict[str, Any]]:
    """One row per path: median relative distances to float64 over ``batches`` batches."""
    from nbkit.speedups.moe import FastMoERouting

    base = tiny_moe(family)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (2, 32), generator=gen), torch.randint(0, 64, (2, 32), generator=gen))
            for _ in range(batches)]
    ref_model = base.to(torch.float64)
    ref_model.set_experts_implementation("eager")
    refs = [_step(ref_model, ids, labels) for ids, labels in data]
    rows = []
    for path in PATHS:
        model = tiny_moe(family).to(dtype)
        speedup = None
        try:
            if path == "nbkit":
                speedup = FastMoERouting(backend="auto", kernels="torch")
                if not speedup.attach(model):
                    raise RuntimeError("fast_moe_routing did not attach")
            else:
                model.set_experts_implementation(path)
            dist_l, dist_g = [], []
            for (ids, labels), (ref_l, ref_g) in zip(data, refs):
                logits, grads = _step(model, ids, labels)
                dist_l.append(_rel(logits, ref_l))
                dist_g.append(_rel(grads, ref_g))
            q_l, q_g = statistics.quantiles(dist_l, n=4), statistics.quantiles(dist_g, n=4)
            rows.append(dict(family=family, dtype=str(dtype).removeprefix("torch."), path=path, batches=batches,
                             logits_rel=statistics.median(dist_l), logits_rel_q1=q_l[0], logits_rel_q3=q_l[2],
                             grads_rel=statistics.median(dist_g), grads_rel_q1=q_g[0], grads_rel_q3=q_g[2]))
        except Exception as exc:  # a path this torch cannot run in this dtype on a CPU: say so
            rows.append(dict(family=family, dtype=str(dtype).removeprefix("torch."), path=path,
                             error=f"{type(exc).__name__}: {exc}"[:200]))
        finally:
            if speedup is not None:
                speedup.detach()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| family | dtype | path | logits: rel. distance to fp64, median (quartiles) | gradients: the same |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['dtype']} | {r['path']} | failed: {r['error'][:60]} | |")
        else:
            lines.append(f"| {r['family']} | {r['dtype']} | {r['path']} | {r['logits_rel']:.2e} "
                         f"({r['logits_rel_q1']:.1e}-{r['logits_rel_q3']:.1e}) | {r['grads_rel']:.2e} "
                         f"({r['grads_rel_q1']:.1e}-{r['grads_rel_q3']:.1e}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_rounding", description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dtype", default="bf16,fp16", help="comma separated: bf16, fp16, fp32")
    parser.add_argument("--batches", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = []
    for name in args.dtype.split(","):
        for family in args.families.split(","):
            rows += measure(family, DTYPES[name], args.batches)
    print(table(rows))
    write_results("moe_rounding", rows, argv=argv,
                  notes="CPU; median over the batches of ||x - x_fp64|| / ||x_fp64||, logits and all gradients")
    return rows


if __name__ == "__main__":
    main()
