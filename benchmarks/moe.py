"""MoE experts benchmark (issue 4): transformers eager / grouped_mm vs nbkit, full fine-tune and LoRA on experts.

Workloads (bf16, random weights, 16,384 tokens, router logits ~ N(0, 1) so routing is near-uniform):
  * gpt-oss-20b-shaped experts layer: hidden 2880, intermediate 2880, 32 experts, top-4 (S = 65,536 rows);
  * Qwen3-30B-A3B-shaped experts layer: hidden 2048, moe_intermediate 768, 128 experts, top-8 (S = 131,072 rows);
  * forward + backward of the experts module (hidden states, routing weights and, in full fine-tune, the expert
    weights get gradients); with LoRA r=16 on both expert tensors (PEFT ``target_parameters``, base frozen):
    PEFT's path (parametrization ``W + BA`` over the transformers experts implementation) vs nbkit;
  * a whole training step (forward, backward, AdamW) of a 2-layer gpt-oss-shaped causal LM (vocab 32,000,
    eager attention with sinks, 16 x 1,024 tokens): full fine-tune plain vs nbkit, and LoRA (attention + experts)
    PEFT vs PEFT + nbkit. Plain model forward/backward, no TRL.

Prediction (written before the first run; H200: 779 TFLOP/s bf16 matmul, ~4 TB/s achievable HBM).
  gpt-oss layer. GEMM work: forward 2*S*H*(2I) + 2*S*I*H = 3.26 TFLOP; full fine-tune x3 = 9.8 TFLOP, LoRA
  (no base dW) x2 = 6.5 TFLOP. One routed activation u = S*H*2 B = 377 MB (0.09 ms at 4 TB/s).
  transformers grouped_mm measured 40.3 ms: its elementwise tail (row gathers, bias gathers and adds, three
  sentinel masks, the strided gate slices and their backward zero-fills, the weight multiply, the inverse
  gather, ~70 u ~ 26 GB) is ~8-11 ms, which puts its grouped GEMMs at ~28-30 ms (~350 TFLOP/s). nbkit runs the
  same grouped GEMMs with a ~19 u tail (dispatch 2 u, fused gate 3 u + 5 u backward, fused combine 1.3 u + 3 u,
  bias sums as small GEMMs), so:
      eager ~102 ms (measured), grouped_mm 40 ms, nbkit 29-34 ms (1.2-1.4x).
  The eager loop's cost is mostly autograd, not the loop: each ``W[e]`` slice's backward writes a zero tensor of
  the whole expert stack (32 x 1.6 GB). nbkit's slice backend ("nbkit loop": one host transfer, 32 cuBLAS GEMMs of
  ~2,048 rows per projection, custom backward) has none of that: ~15 ms of GEMMs at ~650 TFLOP/s + ~3 ms, so
  ~19-24 ms, possibly ahead of grouped_mm for experts this large; for Qwen3's 128 experts its ~800 launches per
  step make it ~25-30 ms, behind grouped.
  LoRA r=16: PEFT = full fine-tune cost (dW of W + BA is still formed) + W + BA twice forward (1.6 GB written
  each) + two bmm in backward reading the 1.6 GB weight gradient: ~43-46 ms on grouped_mm, ~105-110 ms on eager.
  nbkit = fwd + dX GEMMs (~19-20 ms) + tail (~2 ms) + low-rank side products (N = 16 grouped GEMMs, memory-bound
  over x, gu, h: ~30 u ~ 3-5 ms) ~ 24-28 ms: 1.6-1.8x PEFT(grouped_mm), ~4x PEFT(eager). The 3x target over
  PEFT's default (grouped_mm) path is out of reach by this count: even zero overhead leaves the fwd + dX GEMMs,
  2/3 of PEFT's GEMM time.
  Qwen3 layer: forward 1.24 TFLOP, full fine-tune 3.7 TFLOP; 128 groups of ~1,024 rows run less efficiently
  (~350-400 TFLOP/s): GEMMs ~10 ms. uH = 537 MB, uI = 201 MB. transformers grouped_mm ~15 ms, nbkit ~11-12 ms;
  eager: 128 host-synced iterations, each writing and summing a whole-stack (1.2 GB) zero-padded weight
  gradient: ~600 GB of traffic, ~150-200 ms; LoRA: PEFT(grouped_mm) ~17 ms, nbkit ~9-11 ms (~1.7x).
  2-layer gpt-oss step, full fine-tune: attention (eager, 1,024-token rows) ~10 ms/layer, lm_head 9 TFLOP ~13 ms,
  AdamW over 1.9 B bf16 parameters ~7 ms: plain ~125 ms, nbkit ~105-110 ms. LoRA: PEFT ~120 ms, nbkit ~80-85 ms.

A fused LoRA-on-experts variant (the low-rank products folded into the dispatch, gate and down projection by
Triton kernels) was measured here and removed: gpt-oss 22.6 ms against 16.5 ms for the separate products (slower),
Qwen3 9.16 against 9.30 ms (level).

    python -m benchmarks.moe [--tokens 16384] [--steps 7] [--skip-model] [--profile] [--tiny]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import traceback
from typing import Callable, Optional

import torch
from torch import nn

from nbkit.speedups.moe import FastMoERouting

from .common import environment, event, peak_memory, write_results

GPT_OSS = dict(name="gpt-oss-20b layer", family="gpt_oss", hidden=2880, inter=2880, experts=32, top_k=4)
QWEN3 = dict(name="Qwen3-30B-A3B layer", family="qwen3_moe", hidden=2048, inter=768, experts=128, top_k=8)
TINY_SHAPES = [dict(GPT_OSS, hidden=64, inter=64, experts=8, top_k=2), dict(QWEN3, hidden=64, inter=32, experts=16,
                                                                           top_k=4)]
# predicted medians in ms (module docstring), for the table's "predicted" column
PREDICTED = {
    ("gpt-oss-20b layer", "transformers eager"): 102.5, ("gpt-oss-20b layer", "transformers grouped_mm"): 40.3,
    ("gpt-oss-20b layer", "nbkit loop"): 22.0, ("gpt-oss-20b layer", "nbkit"): 31.0,
    ("gpt-oss-20b layer", "nbkit (torch kernels)"): 36.0,
    ("gpt-oss-20b layer", "LoRA: PEFT on eager"): 107.0, ("gpt-oss-20b layer", "LoRA: PEFT on grouped_mm"): 44.0,
    ("gpt-oss-20b layer", "LoRA: nbkit"): 16.8,
    ("gpt-oss-20b layer", "LoRA: nbkit loop"): 18.0,
    ("Qwen3-30B-A3B layer", "transformers eager"): 180.0, ("Qwen3-30B-A3B layer", "transformers grouped_mm"): 15.0,
    ("Qwen3-30B-A3B layer", "nbkit loop"): 28.0, ("Qwen3-30B-A3B layer", "nbkit"): 11.5,
    ("Qwen3-30B-A3B layer", "nbkit (torch kernels)"): 13.0,
    ("Qwen3-30B-A3B layer", "LoRA: PEFT on eager"): 185.0, ("Qwen3-30B-A3B layer", "LoRA: PEFT on grouped_mm"): 17.0,
    ("Qwen3-30B-A3B layer", "LoRA: nbkit"): 9.5,
    ("Qwen3-30B-A3B layer", "LoRA: nbkit loop"): 62.0,
    ("2-layer gpt-oss step", "full FT: plain"): 125.0, ("2-layer gpt-oss step", "full FT: nbkit"): 108.0,
    ("2-layer gpt-oss step", "LoRA: PEFT"): 120.0, ("2-layer gpt-oss step", "LoRA: PEFT + nbkit"): 83.0,
}
BASELINES = {"transformers grouped_mm", "LoRA: PEFT on grouped_mm", "full FT: plain", "LoRA: PEFT"}


class _Holder(nn.Module):
    """A bare experts module under the attribute name PEFT's ``target_parameters`` patterns expect."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts


def _time(step: Callable[[], None], steps: int, warmup: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start, end = event(), event()
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _experts(shape: dict, device: str, dtype: torch.dtype) -> nn.Module:
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    with torch.device(device):
        if shape["family"] == "gpt_oss":
            cfg = GptOssConfig(hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                               num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"])
            module = GptOssExperts(cfg)
        else:
            cfg = Qwen3MoeConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["inter"],
                                 num_experts=shape["experts"], num_experts_per_tok=shape["top_k"])
            module = Qwen3MoeExperts(cfg)
        module = module.to(dtype)
        for p in module.parameters():
            nn.init.normal_(p, std=0.02)
    return module


def _lora_holder(experts: nn.Module, r: int = 16) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    holder = _Holder(experts)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    holder = inject_adapter_in_model(config, holder)
    for name, p in holder.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_B" in name:
            nn.init.normal_(p, std=0.01)
    return holder


PROFILED = ("LoRA: PEFT on grouped_mm", "LoRA: nbkit")


def _profile(step: Callable[[], None], name: str) -> str:
    """One profiled step (after the timed ones): the kernels by GPU time, so that a row's cost can be split."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70)
    out = os.environ.get("OUT")
    if out:
        safe = "".join(c if c.isalnum() else "_" for c in name)
        with open(os.path.join(out, f"moe_profile_{safe}.txt"), "w") as f:
            f.write(table)
    return table


def bench_layer(shape: dict, tokens: int, steps: int, device: str, dtype: torch.dtype, rows: list,
                profile: bool = False) -> None:
    T, H, E, K = tokens, shape["hidden"], shape["experts"], shape["top_k"]
    experts = _experts(shape, device, dtype)
    torch.manual_seed(1)
    x = torch.randn(T, H, device=device, dtype=dtype).requires_grad_(True)
    top = torch.randn(T, E, device=device).topk(K, dim=-1)
    index = top.indices
    weights = top.values.softmax(-1).to(dtype).requires_grad_(True)
    grad_out = torch.randn(T, H, device=device, dtype=dtype)
    holders = {"full": _Holder(experts)}
    refs: dict = {}

    def run_variant(label: str, kind: str, impl: Optional[str], nbkit: Optional[dict]) -> None:
        holder = holders[kind]
        base = holder.experts.get_base_layer() if kind == "lora" else holder.experts
        fm = FastMoERouting(**nbkit) if nbkit is not None else None
        params = [p for p in holder.parameters() if p.requires_grad]

        def step():
            for t in (x, weights, *params):
                t.grad = None
            out = holder.experts(x, index, weights)
            out.backward(grad_out)
            return out

        row = dict(section="layer fwd+bwd", shape=shape["name"], variant=label)
        try:
            if fm is not None:
                assert fm.attach(holder), "nbkit did not attach"
                plan = base._nbkit_moe_plan
                row["plan"] = f"{plan.backend}/{'triton' if plan.triton else 'torch'}"
            else:
                base.config._experts_implementation = impl
            _free()
            out = step()
            check = (out.detach().float(), x.grad.float())
            ref_key = kind
            if ref_key not in refs:
                refs[ref_key] = check
            row["rel_err_out"] = _rel(check[0], refs[ref_key][0])
            row["rel_err_dx"] = _rel(check[1], refs[ref_key][1])
            del out, check
            slow = "eager" in label or "loop" in label
            row["ms"], row["all_ms"] = _time(step, max(3, steps // 2) if slow else steps, 1 if slow else 2)
            row["peak_gib"] = peak_memory() / 2**30
            if profile and label in PROFILED:
                print(f"profile: {shape['name']} | {label}\n{_profile(step, shape['name'] + ' ' + label)}", flush=True)
        except Exception as err:  # report and keep going: one broken variant must not hide the others
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        finally:
            if fm is not None:
                fm.detach()
            for t in (x, weights, *params):
                t.grad = None
        rows.append(row)
        print(_row_line(row), flush=True)

    run_variant("transformers eager", "full", "eager", None)
    run_variant("transformers grouped_mm", "full", "grouped_mm", None)
    run_variant("nbkit loop", "full", None, dict(backend="loop"))
    run_variant("nbkit (torch kernels)", "full", None, dict(kernels="torch"))
    run_variant("nbkit", "full", None, {})
    for p in experts.parameters():
        p.grad = None
    holders["lora"] = _lora_holder(experts)
    run_variant("LoRA: PEFT on eager", "lora", "eager", None)
    run_variant("LoRA: PEFT on grouped_mm", "lora", "grouped_mm", None)
    run_variant("LoRA: nbkit", "lora", None, {})
    run_variant("LoRA: nbkit loop", "lora", None, dict(backend="loop"))


def _gpt_oss_model(layers: int, tiny: bool, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, GptOssConfig

    if tiny:
        shape = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2)
    else:
        shape = dict(vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                     num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4)
    config = GptOssConfig(**shape, num_hidden_layers=layers, sliding_window=128,
                          layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                          attn_implementation="eager", max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def bench_model(layers: int, batch: int, seq: int, steps: int, tiny: bool, device: str, dtype: torch.dtype,
                rows: list) -> None:
    from peft import LoraConfig, get_peft_model

    name = f"{layers}-layer gpt-oss step"
    model = _gpt_oss_model(layers, tiny, device, dtype)
    torch.manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)

    def run(label: str, net: nn.Module, nbkit: bool) -> None:
        row = dict(section="training step", shape=name, variant=label)
        fm = FastMoERouting() if nbkit else None
        params = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=0.0, foreach=True)  # full cost, unchanged weights: comparable losses
        try:
            if fm is not None:
                assert fm.attach(net), "nbkit did not attach"
            _free()
            with torch.no_grad():
                row["loss"] = net(input_ids=ids, labels=ids).loss.item()

            def step():
                loss = net(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            row["ms"], row["all_ms"] = _time(step, steps, 2)
            row["peak_gib"] = peak_memory() / 2**30
        except Exception as err:
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        finally:
            if fm is not None:
                fm.detach()
            opt.zero_grad(set_to_none=True)
        rows.append(row)
        print(_row_line(row), flush=True)

    run("full FT: plain", model, False)
    run("full FT: nbkit", model, True)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = get_peft_model(model, lora)
    run("LoRA: PEFT", peft_model, False)
    run("LoRA: PEFT + nbkit", peft_model, True)


def _row_line(row: dict) -> str:
    if row.get("error"):
        return f"{row['shape']} | {row['variant']}: failed: {row['error']}"
    extra = {k: row[k] for k in ("rel_err_out", "rel_err_dx", "loss", "plan") if k in row}
    return f"{row['shape']} | {row['variant']}: {row['ms']:.2f} ms {extra}"


def markdown(rows: list[dict], predicted: bool = True) -> str:
    lines = ["| workload | path | ms (median) | predicted ms | vs baseline | check | peak GiB |", "|" + "---|" * 7]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['shape']} | {r['variant']} | failed: {r['error'][:90]} | | | | |")
            continue
        section = [b for b in rows if b["shape"] == r["shape"] and b["variant"] in BASELINES and not b.get("error")
                   and b["variant"].startswith("LoRA") == r["variant"].startswith("LoRA")]
        ratio = f"{section[0]['ms'] / r['ms']:.2f}x" if section else "-"
        if "loss" in r:
            check = f"loss {r['loss']:.4f}"
        else:
            check = f"rel err out {r['rel_err_out']:.1e}, dx {r['rel_err_dx']:.1e}"
        pred = PREDICTED.get((r["shape"], r["variant"])) if predicted else None
        lines.append(f"| {r['shape']} | {r['variant']}{' [' + r['plan'] + ']' if 'plan' in r else ''} | "
                     f"{r['ms']:.2f} | {pred if pred is not None else '-'} | {ratio} | {check} | "
                     f"{r.get('peak_gib', 0):.1f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--profile", action="store_true",
                    help=f"print (and write to $OUT) a kernel profile of one step of: {', '.join(PROFILED)}")
    args = ap.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    tokens = 256 if tiny else args.tokens
    rows: list[dict] = []
    for shape in (TINY_SHAPES if tiny else [GPT_OSS, QWEN3]):
        bench_layer(shape, tokens, args.steps, device, dtype, rows, args.profile)
        _free()
    if not args.skip_model:
        seq = 64 if tiny else 1024
        bench_model(args.layers, max(1, tokens // seq), seq, max(3, args.steps - 1), tiny, device, dtype, rows)
        _free()
    table = markdown(rows, predicted=not tiny)
    write_results("moe", {"env": environment(), "tokens": tokens, "rows": rows, "table": table})
    print()
    print(table)


if __name__ == "__main__":
    main()
