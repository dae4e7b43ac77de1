"""nbkit: faster, watchable LLM fine-tuning in notebooks.

Public API: ``FastSFT``, ``FastSFTConfig``, ``load_model``, ``LiveDashboard``. Imported lazily so that
``import nbkit`` stays cheap in a notebook's first cell.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["FastSFT", "FastSFTConfig", "load_model", "LiveDashboard", "__version__"]

_WHERE = {
    "FastSFT": ".trainer",
    "FastSFTConfig": ".config",
    "load_model": ".loading",
    "LiveDashboard": ".dashboard",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module 'nbkit' has no attribute {name!r}")
