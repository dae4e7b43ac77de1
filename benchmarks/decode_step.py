"""Where a dense decode step's time goes, and what fewer kernels buy: ``nbkit.dense_decode``'s captured step on the
1.7B Qwen3 shape (NF4 + LoRA r16 made dense), batch 1 and 32.

For each variant of the layer step, the same captured-graph timing: CUDA events around 256 replays after 16 warm-up
replays, per-step milliseconds (median of 5 such runs, min-max), and the first 32 tokens compared with the shipped
step's. Variants:
- ``shipped``: ``dense_decode.layer_step`` as it is;
- ``liger``: RMSNorm and SiLU-mul through Liger-Kernel's Triton kernels (one kernel each);
- ``matmul-attention``: attention as two batched matmuls and a softmax instead of SDPA's kernel;
- ``compiled``: ``layer_step`` through ``torch.compile`` (fusing norms, rotary, residuals), compile time reported.
A profile of one eager step (kernel count and the top kernels by time) comes first.

    python -m benchmarks.decode_step
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F

import nbkit.dense_decode as dense
from nbkit.chat import greedy_config, prompt_ids
from nbkit.demo.tokenizer import load_demo_tokenizer

from .chat import PROMPT, with_lora
from .common import write_results
from .e2e import load_base, save_random_model

SHIPPED = dense.layer_step


def liger_layer_step(x, layer, keys, values, mask, slot, rope, h, kv, eps, scaling):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    b, hidden = x.shape
    d = rope.shape[-1]
    n = LigerRMSNormFunction.apply(x, layer.ln1, eps)
    qkv = F.linear(n, layer.wqkv, layer.bqkv)
    qk = qkv[:, : (h + kv) * d].reshape(b, h + kv, d)
    if layer.qk_norm is not None:
        qk = F.rms_norm(qk, (d,), None, eps) * layer.qk_norm
    qk = torch.bmm(qk, rope)
    keys.index_copy_(2, slot, qk[:, h:, None, :])
    values.index_copy_(2, slot, qkv[:, (h + kv) * d :].reshape(b, kv, 1, d))
    q = qk[:, :h].reshape(b, kv, h // kv, d)
    a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    x = torch.addmm(x, a.reshape(b, h * d), layer.wo.t())
    n = LigerRMSNormFunction.apply(x, layer.ln2, eps)
    gu = F.linear(n, layer.wgu, layer.bgu)
    half = gu.shape[-1] // 2
    return torch.addmm(x, LigerSiLUMulFunction.apply(gu[:, :half].contiguous(), gu[:, half:].contiguous()),
                       layer.wd.t())


def matmul_attention_layer_step(x, layer, keys, values, mask, slot, rope, h, kv, eps, scaling):
    b, hidden = x.shape
    d = rope.shape[-1]
    n = F.rms_norm(x, (hidden,), layer.ln1, eps)
    qkv = F.linear(n, layer.wqkv, layer.bqkv)
    qk = qkv[:, : (h + kv) * d].reshape(b, h + kv, d)
    if layer.qk_norm is not None:
        qk = F.rms_norm(qk, (d,), None, eps) * layer.qk_norm
    qk = torch.bmm(qk, rope)
    keys.index_copy_(2, slot, qk[:, h:, None, :])
    values.index_copy_(2, slot, qkv[:, (h + kv) * d :].reshape(b, kv, 1, d))
    q = qk[:, :h].reshape(b, kv, h // kv, d)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling + mask
    a = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)
    x = torch.addmm(x, a.reshape(b, h * d), layer.wo.t())
    n = F.rms_norm(x, (hidden,), layer.ln2, eps)
    gu = F.linear(n, layer.wgu, layer.bgu)
    half = gu.shape[-1] // 2
    return torch.addmm(x, F.silu(gu[:, :half]) * gu[:, half:], layer.wd.t())


def _flat(x, ln1, ln2, wqkv, wo, wgu, wd, qk_norm, keys, values, mask, slot, rope, h: int, kv: int, eps: float,
          scaling: float):
    layer = dense._Layer(ln1, ln2, wqkv, None, wo, None, wgu, None, wd, None, qk_norm)
    return SHIPPED(x, layer, keys, values, mask, slot, rope, h, kv, eps, scaling)


_COMPILED: Any = None


def compiled_layer_step(x, layer, keys, values, mask, slot, rope, h, kv, eps, scaling):
    return _COMPILED(x, layer.ln1, layer.ln2, layer.wqkv, layer.wo, layer.wgu, layer.wd, layer.qk_norm, keys, values,
                     mask, slot, rope, h, kv, eps, scaling)


def profile_eager(decoder: dense.DenseDecoder, batch: int) -> dict:
    state = decoder._states[batch][0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dense.decode_step(decoder.weights, state)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
    print(table, flush=True)
    return {"kernels": len(events), "kernel_ms": sum(e.device_time for e in events) / 1e3, "table": table}


def time_replays(decoder: dense.DenseDecoder, batch: int) -> list[float]:
    state, graph = decoder._states[batch]
    runs = []
    for _ in range(5):
        state.slot.fill_(40)
        state.pos.fill_(40)
        for _ in range(16):
            graph.replay()
        state.slot.fill_(40)
        state.pos.fill_(40)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(256):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / 256)
    return runs


def main(argv: list[str] | None = None) -> None:
    global _COMPILED
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--variants", default="shipped,liger,matmul-attention,compiled")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="nbkit-decode-step-")
    save_random_model("1.7b", args.layers, folder, False)
    base, _ = load_base(folder, quantize=True)
    base.generation_config.eos_token_id = None
    model = with_lora(base)
    tokenizer = load_demo_tokenizer()
    ids = prompt_ids(tokenizer, [{"role": "user", "content": PROMPT}], torch.device("cuda"))
    config = greedy_config(model, tokenizer, 300)
    config.eos_token_id = None
    rows, reference = [], {}
    for variant in args.variants.split(","):
        dense.layer_step = {"shipped": SHIPPED, "liger": liger_layer_step, "compiled": compiled_layer_step,
                            "matmul-attention": matmul_attention_layer_step}[variant]
        if variant == "compiled":
            _COMPILED = torch.compile(_flat, fullgraph=True, dynamic=False)
        for batch in (1, 32):
            decoder = dense.DenseDecoder()
            batch_ids = ids.expand(batch, -1).contiguous()
            row: dict[str, Any] = {"variant": variant, "batch": batch}
            try:
                t0 = time.perf_counter()
                tokens = decoder.generate(model, batch_ids, config)
                row["first_call_s"] = time.perf_counter() - t0
                if variant == "shipped" and batch == 1:
                    row["profile"] = profile_eager(decoder, batch)
                runs = time_replays(decoder, batch)
            except Exception as error:  # a variant that fails is a result too
                row["error"] = f"{type(error).__name__}: {error}"[:300]
                rows.append(row)
                print(row, flush=True)
                continue
            reference.setdefault(batch, tokens[0][:32])
            row.update(step_ms=statistics.median(runs), step_ms_min=min(runs), step_ms_max=max(runs),
                       tok_per_s=batch * 1e3 / statistics.median(runs), same_32=tokens[0][:32] == reference[batch])
            rows.append(row)
            print({k: v for k, v in row.items() if k != "profile"}, flush=True)
    dense.layer_step = SHIPPED
    write_results("decode_step", {"rows": rows}, argv=argv, name="decode_step_1.7b")


if __name__ == "__main__":
    main()
