"""Two checks every Triton kernel in nbkit.ops gets without a GPU: its results under Triton's interpreter against
the torch twin (in a subprocess: TRITON_INTERPRET must be set before triton is imported), and a compile to sm_90."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, marker: str) -> None:
    """Run ``script`` under the Triton interpreter; it prints ``marker`` when every comparison held."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and marker in proc.stdout, proc.stderr[-3000:]


def compile_for_sm90(cases: list[tuple[Any, dict, dict]], cache_dir: str) -> None:
    """Each (kernel, signature, constexprs) compiles to a cubin for sm_90 (the H200): catches compile-only errors."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton has no ASTSource/GPUTarget")
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    for fn, sig, consts in cases:
        sig = {**sig, **{name: "constexpr" for name in consts}}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        assert compiled.asm.get("cubin"), fn


def ptrs(names: list[str], dtype: str) -> dict[str, str]:
    return {n: dtype for n in names}
