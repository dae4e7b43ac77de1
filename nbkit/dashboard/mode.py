"""Where the dashboard runs, and which of its views that picks: a notebook kernel gets the widget (or HTML when
ipywidgets is missing), anything else one text line. The env var ``NBKIT_DASHBOARD`` may name the mode for
``"auto"``."""

from __future__ import annotations

import os
import sys

MODES = ("auto", "widget", "html", "text")
ENV_MODE = "NBKIT_DASHBOARD"


def in_notebook() -> bool:
    """True inside a Jupyter-protocol kernel (Jupyter, Colab, Kaggle, VS Code); False in a terminal or script.

    Looks only at an IPython that is already imported, so plain scripts never pay for importing it.
    """
    ipython_module = sys.modules.get("IPython")
    if ipython_module is None:
        return False
    try:
        shell = ipython_module.get_ipython()
    except Exception:
        return False
    if shell is None:
        return False
    if getattr(shell, "kernel", None) is not None:
        return True
    try:
        return "IPKernelApp" in shell.config
    except Exception:
        return False


def widgets_importable() -> bool:
    """Whether ``import ipywidgets`` works here (the widget view needs its core widgets)."""
    try:
        import ipywidgets
    except Exception:
        return False
    return ipywidgets is not None


def resolve_mode(mode: str = "auto") -> str:
    """Turn ``mode`` ("auto" or a concrete mode) into "widget", "html" or "text" for the current process."""
    if mode == "auto":
        mode = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"dashboard mode {mode!r}: choose one of {MODES}")
    if mode != "auto":
        return mode
    if not in_notebook():
        return "text"
    return "widget" if widgets_importable() else "html"
