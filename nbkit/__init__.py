"""nbkit: faster, watchable LLM fine-tuning in notebooks.

Public API: ``FastSFT``, ``FastSFTConfig``, ``load_model``, ``load_jsonl`` (your own JSON Lines data, checked line by
line), ``LiveDashboard``, and after training ``save_merged``, ``export_gguf`` (and ``nbkit.chat.chat``). Imported
lazily so that ``import nbkit`` stays cheap in a notebook's first cell.
"""

from __future__ import annotations

import logging

from ._lazy import lazy_exports


class _DropHubKernelHint(logging.Filter):
    """bitsandbytes on AVX512-BF16 CPUs tries to fetch a kernel from the Hub when imported (which nbkit's imports of
    PEFT/TRL cause) and logs "pip install kernels" when it cannot, or, through the ``kernels`` package offline, that
    it skips that kernel's publisher check: notes on a fetch the user did not ask for. Drop those lines only."""

    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        return self.needle not in str(record.msg)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropHubKernelHint("kernels-community"))
logging.getLogger("kernels._internals.hf_hub").addFilter(_DropHubKernelHint("kernels-community/quantization-bitsandbytes"))

__version__ = "0.1.0"
__all__ = ["FastSFT", "FastSFTConfig", "load_model", "load_jsonl", "LiveDashboard", "save_merged", "export_gguf",
           "__version__"]

__getattr__ = lazy_exports(__name__, {
    "FastSFT": ".trainer",
    "FastSFTConfig": ".config",
    "load_model": ".loading",
    "load_jsonl": ".reliability.jsonl",
    "LiveDashboard": ".dashboard",
    "save_merged": ".export",
    "export_gguf": ".export",
})
