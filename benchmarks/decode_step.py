"""Where a dense decode step's time goes, and what each of its kernels buys: ``nbkit.decode.dense``'s captured step
on the 1.7B Qwen3 shape (NF4 + LoRA r16 made dense), batch 1 and 32.

For each variant of the step, the same captured-graph timing: CUDA events around 256 replays after 16 warm-up
replays, per-step milliseconds (median of 5 such runs, min-max), and the first 32 tokens compared with the shipped
step's. Variants:
- ``shipped``: ``DenseDecoder()`` as it is (Triton small ops, cuBLAS matmuls; attention's keys split by
  ``decode_kernels.split_for``: 4 programs a kv head at batch 1, one at 32);
- ``torch``: every op in torch (``kernels="torch"``: what runs without Triton);
- ``one-split``: the shipped step with one attention program a row and kv head (no combine kernel).
A profile of one eager step (kernel count and the top kernels by time) comes first, for batch 1 of each variant.

    python -m benchmarks.decode_step
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

import nbkit.decode.dense as dense
import nbkit.ops.decode_kernels as kernels
from nbkit.chat import greedy_config, prompt_ids
from nbkit.demo.tokenizer import load_demo_tokenizer

from .chat import PROMPT, with_lora
from .common import write_results
from .e2e import load_base, save_random_model

VARIANTS = {"shipped": ({}, None), "torch": ({"kernels": "torch"}, None), "one-split": ({}, 1)}


def profile_eager(decoder: dense.DenseDecoder, batch: int) -> dict:
    state = decoder._states[batch][0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        decoder._step(state)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
    print(table, flush=True)
    return {"kernels": len(events), "kernel_ms": sum(e.device_time for e in events) / 1e3, "table": table}


def time_replays(decoder: dense.DenseDecoder, batch: int) -> list[float]:
    state, graph = decoder._states[batch][0], decoder._states[batch][1]["greedy"]
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
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
    default_programs = kernels.PROGRAMS
    for variant in args.variants.split(","):
        options, programs = VARIANTS[variant]
        kernels.PROGRAMS = programs or default_programs
        for batch in (1, 32):
            decoder = dense.DenseDecoder(**options)
            batch_ids = ids.expand(batch, -1).contiguous()
            row: dict[str, Any] = {"variant": variant, "batch": batch}
            try:
                t0 = time.perf_counter()
                tokens = decoder.generate(model, batch_ids, config)
                row["first_call_s"] = time.perf_counter() - t0
                row["split"] = decoder._states[batch][0].split
                if batch == 1:
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
            decoder.release()
    kernels.PROGRAMS = default_programs
    write_results("decode_step", {"rows": rows}, argv=argv, name="decode_step_1.7b")


if __name__ == "__main__":
    main()
