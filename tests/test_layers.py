"""The layering CONTRIBUTING.md draws holds: no import in ``nbkit/`` points upward, and the diagram names every module.

Layers, top down: the user layer, ``nbkit/speedups/``, the base modules, ``nbkit/ops/``, ``nbkit/memory.py``. Imports
are read from the source (``ast``; lazy imports inside functions count too), so a shortcut taken in a function body
shows as well.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = {"nbkit.switches", "nbkit.settings", "nbkit.model_parts", "nbkit.say_once", "nbkit.compat", "nbkit.trl_seam"}


def layer(module: str) -> int:
    """0 = the bottom (memory) ... 4 = the user layer."""
    if module == "nbkit.memory":
        return 0
    if module == "nbkit.ops" or module.startswith("nbkit.ops."):
        return 1
    if module in BASE:
        return 2
    if module == "nbkit.speedups" or module.startswith("nbkit.speedups."):
        return 3
    return 4


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "nbkit").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "nbkit" or target.startswith("nbkit."):
                found |= {f"{target}.{a.name}" for a in node.names} if node.module is None else {target}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("nbkit")}
    return found


def upward(found: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in found.items() for t in targets if layer(t) > layer(m))


def test_no_import_points_upward():
    found = {name: imports(name, path) for name, path in modules().items()}
    assert upward(found) == []


def test_an_upward_import_is_caught():
    """Negative control: ops importing a speedup, base importing the trainer (even lazily)."""
    assert upward({"nbkit.ops.lora_linear": {"nbkit.speedups.ledger"}, "nbkit.settings": {"nbkit.trainer"},
                   "nbkit.speedups.moe": {"nbkit.ops.moe_routing", "nbkit.memory"}}) == [
        "nbkit.ops.lora_linear -> nbkit.speedups.ledger", "nbkit.settings -> nbkit.trainer"]


@pytest.mark.parametrize("name", sorted(modules()))
def test_contributing_names_every_module(name):
    diagram = (ROOT / "CONTRIBUTING.md").read_text().split("## Architecture", 1)[1].split("```")[1]
    stem = name.rpartition(".")[2] if name.count(".") else name
    if name in ("nbkit",):
        stem = "__init__"
    elif Path(modules()[name]).name == "__init__.py":
        stem = name.rpartition(".")[2] + "/"
    assert re.search(rf"(?<![\w]){re.escape(stem)}(?![\w])", diagram), f"{name} is not in CONTRIBUTING.md's diagram"
