"""``python -m nbkit <command>`` and the ``nbkit`` console script.

Commands: ``demo`` (``nbkit.demo.run``: train a tiny model on any machine; ``--resume`` continues an interrupted run),
``setup`` (``nbkit.setup``: install nbkit into a Colab/Kaggle runtime without touching its torch) and ``export``
(``nbkit.export.cli``: a saved adapter or model folder to merged 16-bit weights or a GGUF file). Everything
after the command goes to it unchanged; ``python -m nbkit demo --help`` lists the demo's options.
"""

from __future__ import annotations

import sys
from typing import Sequence

USAGE = """usage: python -m nbkit {demo,setup,export} [options]   (--version: nbkit's version and its stack's)

  demo    QLoRA-train a tiny model on generated data, no download (--help for options, --resume to continue)
  setup   install nbkit into this Colab/Kaggle Python, keeping its torch (--help for options)
  export  SOURCE --to merged|gguf [--quant TYPE] --out PATH: merge an adapter, or write a GGUF (--help)"""


def versions() -> str:
    """nbkit's version and those of the packages it trains with: what a bug report needs first."""
    from importlib.metadata import PackageNotFoundError, version

    from nbkit import __version__

    found = []
    for name in ("torch", "transformers", "trl", "peft", "bitsandbytes", "datasets", "liger-kernel", "flash-attn"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} absent")
    return f"nbkit {__version__} ({', '.join(found)})"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(versions())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from nbkit.demo.run import main as demo

        demo(rest)
        return 0
    if command == "setup":
        from nbkit.setup import main as setup

        return setup(rest)
    if command == "export":
        from nbkit.export.cli import main as export

        return export(rest)
    print(f"nbkit: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
