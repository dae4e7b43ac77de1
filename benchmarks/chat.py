"""Chat decoding benchmark: plain ``model.generate`` vs ``nbkit.chat``'s fast path, side by side in one run.

Workload: a Qwen3-1.7B-shaped model with random weights, saved and loaded the way a user loads one for QLoRA
(``benchmarks.e2e.save_random_model`` / ``load_base``: bitsandbytes NF4, double quant, bf16 compute), batch 1, a
chat prompt from the demo tokenizer's template, 256 new tokens, greedy. Two models: the 4-bit base alone, and the
base with LoRA r=16 on all 7 projections (non-zero B, so the adapters change the numbers), as ``chat`` sees it right
after ``FastSFT.train()``.

Paths, on the same model and prompt:
- ``generate``: ``model.generate(input_ids, generation_config=...)``, greedy, transformers' default cache;
- ``nbkit``: ``nbkit.graphed_decode.GraphedDecoder.generate`` with the same generation config: the decoding
  ``nbkit.chat(fast=True)`` runs (prompt through ``generate``, then the captured step replayed).
Stopping is switched off in both (``eos_token_id=None``) so every timed call makes exactly ``--new-tokens`` tokens.

Timing: ``torch.cuda.synchronize()`` around each call, ``--warmup`` calls dropped, the median of ``--repeats``
reported (with min and max), tokens/s = new tokens / seconds. ``first_call_s`` is the first call's time (for
``nbkit`` it includes the capture, reported on its own as ``capture_s``). ``identical`` says whether the greedy
token ids equal ``generate``'s, token for token.

Prediction (written before the first run): ``generate`` at batch 1 is bound by the host issuing ~2K kernels per
token (about 25-40 tokens/s on this model); the graphed step issues ~60 eager attention calls and ~30 graph
replays per token, so >= 3x.

    python -m benchmarks.chat                 # GPU
    python -m benchmarks.chat --tiny          # CPU smoke run of the script (the fast path falls back there)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from typing import Any

import torch

from nbkit.chat import greedy_config, prompt_ids
from nbkit.demo.tokenizer import load_demo_tokenizer
from nbkit.graphed_decode import GraphedDecoder, Unsupported

from .common import write_results
from .e2e import LORA_TARGETS, load_base, save_random_model

PROMPT = "Write a short poem about the sea, the wind and a small boat coming home at night."


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _timed(fn: Any) -> tuple[float, list[int]]:
    _sync()
    t0 = time.perf_counter()
    tokens = fn()
    _sync()
    return time.perf_counter() - t0, tokens


def with_lora(base: torch.nn.Module) -> torch.nn.Module:
    """The base with LoRA r=16 on the 7 projections and non-zero B (as after some training)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0,
                                            task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_((torch.randn(param.shape, generator=gen) * 0.01).to(param.dtype))
    return model.eval()


def run_model(label: str, model: torch.nn.Module, tokenizer: Any, args: argparse.Namespace) -> list[dict]:
    ids = prompt_ids(tokenizer, [{"role": "user", "content": PROMPT}], next(model.parameters()).device)
    config = greedy_config(model, tokenizer, args.new_tokens)
    config.eos_token_id = None  # every call makes exactly new_tokens tokens
    decoder = GraphedDecoder()
    paths = {
        "generate": lambda: [int(t) for t in model.generate(input_ids=ids, generation_config=copy.deepcopy(config))[
            0, ids.shape[1]:].tolist()],
        "nbkit": lambda: decoder.generate(model, ids, config),
    }
    rows, reference = [], None
    for path, fn in paths.items():
        row: dict[str, Any] = {"model": label, "path": path, "prompt_tokens": ids.shape[1],
                               "new_tokens": args.new_tokens}
        try:
            first_s, tokens = _timed(fn)
            for _ in range(max(0, args.warmup - 1)):
                _timed(fn)
            times, drift = [], []
            for _ in range(args.repeats):
                seconds, again = _timed(fn)
                times.append(seconds)
                drift.append(_first_mismatch(again, tokens))
            # the same call again: the first token where it differs from the first call (None: identical)
            row["repeat_first_mismatch"] = drift
        except Unsupported as error:
            rows.append(dict(row, error=f"fast path not applicable: {error}"))
            continue
        median = statistics.median(times)
        row.update(first_call_s=first_s, s_median=median, s_min=min(times), s_max=max(times), seconds=times,
                   tok_per_s=len(tokens) / median, generated=len(tokens), token_ids=tokens)
        if path == "generate":
            reference = tokens
        else:
            row["capture_s"] = decoder.first_capture_s
            row["captures"] = decoder.captures
            row["identical"] = tokens == reference
            row["first_mismatch"] = _first_mismatch(tokens, reference)
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("token_ids", "seconds")}, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | path | tok/s (median) | s per call (min-max) | speedup | first call s | capture s | "
             "identical ids | repeats differ from token |", "|" + "---|" * 9]
    base = {r["model"]: r for r in rows if r["path"] == "generate" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['path']} | {r['error'][:90]} |" + " |" * 6)
            continue
        ref = base.get(r["model"])
        speed = f"{r['tok_per_s'] / ref['tok_per_s']:.2f}x" if ref else "-"
        capture = f"{r['capture_s']:.2f}" if r.get("capture_s") is not None else "-"
        same = {True: "yes", False: f"no (from token {r.get('first_mismatch')})"}.get(r.get("identical"), "-")
        lines.append(f"| {r['model']} | {r['path']} | {r['tok_per_s']:,.1f} | {r['s_median']:.3f} "
                     f"({r['s_min']:.3f}-{r['s_max']:.3f}) | {speed} | {r['first_call_s']:.2f} | {capture} | {same} | "
                     f"{', '.join('-' if d is None else str(d) for d in r['repeat_first_mismatch'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="calls before the timed ones (the first is one)")
    parser.add_argument("--layers", type=int, default=None, help="shrink the model (default: all 28 layers)")
    parser.add_argument("--no-lora", action="store_true", help="only the 4-bit base")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on the CPU: checks the script runs")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() or args.tiny):
        raise SystemExit("this benchmark needs a CUDA GPU (or --tiny for a CPU smoke run)")
    shape = "tiny" if args.tiny else "1.7b"
    folder = tempfile.mkdtemp(prefix=f"nbkit-chat-{shape}-")
    save_s = save_random_model(shape, args.layers, folder, args.tiny)
    base, load_s = load_base(folder, quantize=not args.tiny)
    base.generation_config.eos_token_id = None
    print(f"model {shape}: saved in {save_s:.1f} s, loaded in {load_s:.1f} s", flush=True)
    tokenizer = load_demo_tokenizer()  # its ids (< 1024) are valid for the model; only the prompt comes from it
    rows = run_model("nf4" if not args.tiny else "tiny-fp32", base.eval(), tokenizer, args)
    if not args.no_lora:
        rows += run_model("nf4+lora16" if not args.tiny else "tiny-fp32+lora16", with_lora(base), tokenizer, args)
    text = table(rows)
    notes = "CPU smoke run: the figures mean nothing" if args.tiny else ""
    write_results("chat", {"load_s": load_s, "rows": rows}, notes, argv=argv, name=f"chat_{shape}")
    print(f"\n{shape}, batch 1, {args.new_tokens} new tokens, greedy\n{text}\n", flush=True)


if __name__ == "__main__":
    main()
