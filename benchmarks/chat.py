"""Chat decoding benchmark: plain ``model.generate`` vs ``nbkit.chat``'s fast paths, side by side in one run.

Workload: a Qwen3-1.7B-shaped model with random weights, saved and loaded the way a user loads one for QLoRA
(``benchmarks.e2e.save_random_model`` / ``load_base``: bitsandbytes NF4, double quant, bf16 compute), batch 1, a
chat prompt from the demo tokenizer's template, 256 new tokens, greedy. Two models: the 4-bit base alone, and the
base with LoRA r=16 on all 7 projections (non-zero B, so the adapters change the numbers), as ``chat`` sees it right
after ``FastSFT.train()``.

Paths, on the same model and prompt:
- ``generate``: ``model.generate(input_ids, generation_config=...)``, greedy, transformers' default cache;
- ``graphed``: ``nbkit.decode.graphed.GraphedDecoder.generate`` with the same generation config (prompt through
  ``generate``, then the model's own step replayed from CUDA graphs): ``chat(exact=True)``'s path;
- ``dense``: ``nbkit.decode.dense.DenseDecoder.generate``: a dense copy of the weights (NF4 dequantized, LoRA merged,
  projections fused), the prompt through it at once, then one CUDA graph a step (Triton kernels for the small ops on
  a GPU): ``chat``'s default path when memory allows.
Batched (``--batch N``, 0 to skip): N chat prompts of different lengths, left-padded, ``model.generate`` on the
batch vs ``DenseDecoder.generate`` on the batch (``generate_answers``' two paths), tokens/s = all new tokens / s.
Stopping is switched off everywhere (``eos_token_id=None``) so every timed call makes exactly ``--new-tokens`` tokens
a row.
Sampling (``--sample``): each batch-1 path again with ``GenerationSettings(temperature, min_p, top_p, top_k,
seed=0)`` (default Unsloth's ``temperature=1.5, min_p=0.1``), rows marked ``mode=sample``: ``generate`` with
``do_sample=True`` under the seed, the fast paths drawing on the device. Their tokens are draws, so ``identical``
and the audit do not apply; a repeat with the same seed must give the same tokens (``repeats differ``).

Same tokens: ``identical``/``first_mismatch`` compare with ``generate``'s ids; ``audit`` holds each path's tokens to
the model's own logits, teacher-forced on them (one forward of prompt + tokens): ``not_argmax`` counts the steps whose
token is not the model's own best, ``max_gap`` is the largest logit gap of those, relative to the step's largest
|logit| (0 for a path that makes the model's own greedy choice at every step).

Timing: ``torch.cuda.synchronize()`` around each call, ``--warmup`` calls dropped, the median of ``--repeats``
reported (with min and max), tokens/s = new tokens / seconds. ``first_call_s`` is the first call's time (for
``nbkit`` it includes the capture, reported on its own as ``capture_s``). ``identical`` says whether the greedy
token ids equal ``generate``'s, token for token.

Prediction (written before the first run): ``generate`` at batch 1 is bound by the host issuing ~2K kernels per
token (about 25-40 tokens/s on this model); the graphed step issues ~60 eager attention calls and ~30 graph
replays per token, so >= 3x.
Prediction for the dense path (written before its first run): ~15 kernels a layer, ~440 a step, ~2 us each from a
graph (~0.9 ms), plus reading the 3.4 GB of bf16 weights at ~4 TB/s (~0.85 ms): ~1.8 ms a token, ~550 tok/s at
batch 1 (the floor, 3.4 GB at 4.8 TB/s, is ~1,400 tok/s); at batch 32 the matmuls still read each weight once, so a
step costs about the same: ~15,000 tok/s, against ``generate`` on the same batch host-bound at ~30 steps/s (~1,000).

Prediction for sampling (written before its first run, ``--sample``: temperature 1.5, min_p 0.1): the dense step
gains ~8 kernels over the vocabulary (151,936 logits: temperature, two softmaxes, the min-p cut, the race) inside its
graph and one ``exponential_`` fill outside it, ~60-80 us on a ~1.9 ms step, so within 5% of greedy; top-p adds a
sort of the vocabulary (~50 us more). The graphed path adds the same ops eagerly (~10 launches, ~100 us on a ~7.8 ms
step); ``generate`` samples at about its greedy speed (host-bound either way).

    python -m benchmarks.chat                 # GPU
    python -m benchmarks.chat --sample        # GPU, sampling rows beside the greedy ones
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

from nbkit.chat import prompt_ids
from nbkit.decode.config import GenerationSettings, chat_config
from nbkit.decode.dense import DenseDecoder
from nbkit.decode.graphed import GraphedDecoder
from nbkit.decode.plain import PlainDecoder
from nbkit.decode.shared import Unsupported
from nbkit.demo.tokenizer import load_demo_tokenizer

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


def audit(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, rows: list[list[int]]) -> dict:
    """Each row's tokens against the model's own logits, teacher-forced on them (see the module docstring)."""
    tokens = torch.tensor(rows, device=ids.device)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids, tokens], 1),
                       attention_mask=torch.cat([mask, torch.ones_like(tokens)], 1)).logits
    steps = logits[:, ids.shape[1] - 1 : -1].float()
    best = steps.max(dim=-1).values
    chosen = steps.gather(-1, tokens[..., None])[..., 0]
    gap = (best - chosen) / steps.abs().amax(dim=-1)
    return {"steps": int(gap.numel()), "not_argmax": int((gap > 0).sum()), "max_gap": float(gap.max())}


def _timed_path(fn: Any, args: argparse.Namespace) -> tuple[float, list[float], Any, list]:
    first_s, tokens = _timed(fn)
    for _ in range(max(0, args.warmup - 1)):
        _timed(fn)
    times, drift = [], []
    for _ in range(args.repeats):
        seconds, again = _timed(fn)
        times.append(seconds)
        drift.append(_first_mismatch(_flat(again), _flat(tokens)))
    return first_s, times, tokens, drift


def _flat(tokens: Any) -> list[int]:
    return [t for row in tokens for t in row] if tokens and isinstance(tokens[0], list) else tokens


def run_model(label: str, model: torch.nn.Module, tokenizer: Any, args: argparse.Namespace,
              batch: Any = None, settings: GenerationSettings | None = None) -> list[dict]:
    """Batch 1 (``batch`` None) or a left-padded ``batch``: each path timed, its tokens compared and audited;
    ``settings``: sample instead of greedy decoding."""
    device = next(model.parameters()).device
    if batch is None:
        ids = prompt_ids(tokenizer, [{"role": "user", "content": PROMPT}], device)
        mask = torch.ones_like(ids)
    else:
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    sample = settings is not None and settings.sampling
    settings = settings or GenerationSettings(max_new_tokens=args.new_tokens)
    config = chat_config(model, tokenizer, settings)
    config.eos_token_id = None  # every call makes exactly new_tokens tokens
    graphed, dense, plain_decoder = GraphedDecoder(), DenseDecoder(), PlainDecoder()

    def plain() -> list[list[int]]:
        return plain_decoder.generate(model, ids, copy.deepcopy(config), mask, settings=settings)

    paths = {"generate": plain, "dense": lambda: dense.generate(model, ids, config, mask, settings=settings)}
    if batch is None:
        paths["graphed"] = lambda: [graphed.generate(model, ids, config, settings=settings)]
    rows, reference = [], None
    for path, fn in paths.items():
        row: dict[str, Any] = {"model": label, "path": path, "batch": ids.shape[0], "prompt_tokens": ids.shape[1],
                               "new_tokens": args.new_tokens, "mode": "sample" if sample else "greedy"}
        try:
            first_s, times, tokens, drift = _timed_path(fn, args)
        except Unsupported as error:
            rows.append(dict(row, error=f"fast path not applicable: {error}"))
            continue
        # the same call again: the first token where it differs from the first call (None: identical)
        row["repeat_first_mismatch"] = drift
        median = statistics.median(times)
        made = sum(len(r) for r in tokens)
        row.update(first_call_s=first_s, s_median=median, s_min=min(times), s_max=max(times), seconds=times,
                   tok_per_s=made / median, generated=made, token_ids=tokens,
                   audit=None if sample else audit(model, ids, mask, tokens))
        if path == "generate":
            reference = tokens
        elif not sample:
            row["identical"] = tokens == reference
            row["first_mismatch"] = [_first_mismatch(a, b) for a, b in zip(tokens, reference)]
        if path == "graphed":
            row.update(capture_s=graphed.first_capture_s, captures=graphed.captures)
        if path == "dense":
            row.update(build_s=dense.build_s, captures=dense.captures,
                       dense_gib=dense.weights.nbytes / 2**30 if dense.weights else None)
        if path == "dense" and args.phases:
            row["phases_ms"] = dense_phases(dense, model, ids, config, mask)
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("token_ids", "seconds")}, flush=True)
    return rows


def dense_phases(decoder: DenseDecoder, model: torch.nn.Module, ids: torch.Tensor, config: Any,
                 mask: torch.Tensor, calls: int = 3) -> dict:
    """Where one ``DenseDecoder.generate`` call's time goes (median of ``calls`` calls, milliseconds): the signature
    walk, ``check``, ``prepare``, ``prefill`` (each timed with a sync before and after) and the rest (the replayed
    steps, the token reads). The wrappers are this benchmark's own; the decoder runs as it is."""
    import nbkit.decode.dense as dense_module

    spent: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            _sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _sync()
                spent[name] = spent.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
        return wrapper

    originals = {name: getattr(dense_module, name) for name in ("signature_of", "prefill")}
    runs = []
    try:
        for name, fn in originals.items():
            setattr(dense_module, name, timed(name, fn))
        decoder.check = timed("check", DenseDecoder.check.__get__(decoder))
        decoder.prepare = timed("prepare", DenseDecoder.prepare.__get__(decoder))
        for _ in range(calls):
            spent.clear()
            total, _ = _timed(lambda: decoder.generate(model, ids, config, mask))
            spent["total"] = total * 1e3
            spent["steps_and_reads"] = spent["total"] - sum(v for k, v in spent.items() if k != "total")
            runs.append(dict(spent))
    finally:
        for name, fn in originals.items():
            setattr(dense_module, name, fn)
        del decoder.check, decoder.prepare
    phases = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print({"dense_phases_ms": {k: round(v, 2) for k, v in phases.items()}}, flush=True)
    return phases


def batch_of(tokenizer: Any, n: int) -> Any:
    """``n`` chat prompts of different lengths, left-padded as ``generate_answers`` pads them."""
    words = PROMPT.split()
    questions = [" ".join(words[: 4 + (i * 7) % (len(words) - 3)]) + f" ({i})" for i in range(n)]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True) for q in questions]
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | mode | path | tok/s (median) | s per call (min-max) | speedup | first call s | "
             "identical ids (first differing token) | not the model's argmax (max gap) | repeats differ from token |",
             "|" + "---|" * 11]
    base = {(r["model"], r["batch"], r.get("mode")): r for r in rows if r["path"] == "generate" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r.get('mode')} | {r['path']} | {r['error'][:90]} |"
                         + " |" * 6)
            continue
        ref = base.get((r["model"], r["batch"], r.get("mode")))
        speed = f"{r['tok_per_s'] / ref['tok_per_s']:.2f}x" if ref else "-"
        first = [m for m in r.get("first_mismatch") or [] if m is not None]
        same = {True: "yes", False: f"no (from {min(first) if first else '-'})"}.get(r.get("identical"), "-")
        a = r["audit"]
        audited = f"{a['not_argmax']} of {a['steps']} ({a['max_gap']:.4f})" if a else "-"
        lines.append(f"| {r['model']} | {r['batch']} | {r.get('mode')} | {r['path']} | {r['tok_per_s']:,.1f} | "
                     f"{r['s_median']:.3f} ({r['s_min']:.3f}-{r['s_max']:.3f}) | {speed} | {r['first_call_s']:.2f} | "
                     f"{same} | {audited} | "
                     f"{', '.join('-' if d is None else str(d) for d in r['repeat_first_mismatch'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="calls before the timed ones (the first is one)")
    parser.add_argument("--layers", type=int, default=None, help="shrink the model (default: all 28 layers)")
    parser.add_argument("--no-lora", action="store_true", help="only the 4-bit base")
    parser.add_argument("--no-base", action="store_true", help="only the base with LoRA")
    parser.add_argument("--batch", type=int, default=32, help="prompts in the batched run (0: none)")
    parser.add_argument("--phases", action="store_true", help="also time the dense path's phases (see dense_phases)")
    parser.add_argument("--sample", action="store_true", help="also each batch-1 path sampling (see the docstring)")
    parser.add_argument("--temperature", type=float, default=1.5)
    parser.add_argument("--min-p", type=float, default=0.1)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
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
    rows = [] if args.no_base else run_model("nf4" if not args.tiny else "tiny-fp32", base.eval(), tokenizer, args)
    if not args.no_lora:
        label = "nf4+lora16" if not args.tiny else "tiny-fp32+lora16"
        model = with_lora(base)
        rows += run_model(label, model, tokenizer, args)
        if args.sample:
            rows += run_model(label, model, tokenizer, args, settings=GenerationSettings(
                max_new_tokens=args.new_tokens, temperature=args.temperature, min_p=args.min_p, top_p=args.top_p,
                top_k=args.top_k, seed=0, do_sample=True))
        if args.batch:
            rows += run_model(label, model, tokenizer, args, batch=batch_of(tokenizer, args.batch))
    text = table(rows)
    notes = "CPU smoke run: the figures mean nothing" if args.tiny else ""
    write_results("chat", {"load_s": load_s, "rows": rows}, notes, argv=argv, name=f"chat_{shape}")
    mode = "greedy" + (f" and sampling (temperature {args.temperature}, min_p {args.min_p}, top_p {args.top_p}, "
                       f"top_k {args.top_k})" if args.sample else "")
    print(f"\n{shape}, {args.new_tokens} new tokens a row, {mode}\n{text}\n", flush=True)


if __name__ == "__main__":
    main()
