"""Getting a trained model out: merged 16-bit weights, GGUF files for llama.cpp / Ollama, the Hub.

- ``merge``: ``save_merged`` / ``merge_folder`` -- the adapter merged into the original base, checked by logits
  (``merge_check``: the merge in float32, then the saved folder within the saved dtype's measured rounding floor).
- ``gguf``: ``export_gguf`` -- a model folder to one GGUF file (pure Python, the ``gguf`` package), read back with
  transformers' GGUF reader and checked by logits; ``QUANT_TYPES`` lists what it writes.
- ``modelfile``: ``write_modelfile`` -- an Ollama ``Modelfile`` beside the GGUF (template, stop tokens).
- ``push``: ``push_to_hub`` -- upload a folder or file with huggingface_hub.
- ``cli``: ``python -m nbkit export SOURCE --to merged|gguf ...``.

The names below are imported on first use, so ``import nbkit.export`` stays cheap.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__all__ = ["save_merged", "merge_folder", "export_gguf", "QUANT_TYPES", "write_modelfile", "push_to_hub",
           "ExportCheckError"]

__getattr__ = lazy_exports(__name__, {
    "save_merged": ".merge",
    "merge_folder": ".merge",
    "export_gguf": ".gguf",
    "QUANT_TYPES": ".gguf",
    "write_modelfile": ".modelfile",
    "push_to_hub": ".push",
    "ExportCheckError": ".compare",
})
