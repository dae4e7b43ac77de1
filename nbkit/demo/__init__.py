"""Everything the demo needs, shipped or generated, so that it runs with no download.

- ``nbkit.demo.tokenizer``: the small tokenizer nbkit ships (``demo_tokenizer_path``, ``load_demo_tokenizer``);
- ``nbkit.demo.data``: generated instruction data in three formats, with a held-out eval split (``make_dataset``);
- ``nbkit.demo.models``: tiny configs and random models of real families (``tiny_config``, ``tiny_model``);
- ``nbkit.demo.run``: ``python -m nbkit demo``.

Names are imported on first use, so ``import nbkit.demo`` does not load transformers.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__all__ = ["demo_tokenizer_path", "load_demo_tokenizer", "make_dataset", "demo_pairs", "tiny_config", "tiny_model"]

__getattr__ = lazy_exports(__name__, {
    "demo_tokenizer_path": ".tokenizer",
    "load_demo_tokenizer": ".tokenizer",
    "make_dataset": ".data",
    "demo_pairs": ".data",
    "tiny_config": ".models",
    "tiny_model": ".models",
})
