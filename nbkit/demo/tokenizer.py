"""The small tokenizer nbkit ships for its demo (built by tools/build_demo_tokenizer.py).

A 1,024-token byte-level BPE with a ChatML chat template whose assistant turns sit inside ``{% generation %}``
markers (TRL's ``assistant_only_loss`` needs them). eos is ``<|im_end|>``, pad is ``<|endoftext|>``. It loads
offline: the files are package data, found through ``importlib.resources``.
"""

from __future__ import annotations

from contextlib import ExitStack
from importlib import resources
from pathlib import Path

_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_keep_open = ExitStack()  # keeps an extracted copy alive when the package is imported from a zip


def demo_tokenizer_path() -> Path:
    """The folder holding the demo tokenizer's files (a real directory, usable with ``from_pretrained``)."""
    folder = resources.files("nbkit.demo") / "assets" / "tokenizer"
    path = _keep_open.enter_context(resources.as_file(folder))
    missing = [name for name in _FILES if not (Path(path) / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the demo tokenizer in {path} lacks {', '.join(missing)}: reinstall nbkit, or rebuild it with "
            "`python tools/build_demo_tokenizer.py` from a source checkout"
        )
    return Path(path)


def load_demo_tokenizer():
    """The demo tokenizer as a transformers fast tokenizer (no network access)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_tokenizer_path()), local_files_only=True)
