"""Write notebooks/*.ipynb from their plain-text sources in notebooks/src/ (run from anywhere).

Why sources: a notebook is JSON with outputs, execution counts, widget state and random cell ids; reviewing it means
reading that JSON. Each notebook is edited as one plain-text file, and the notebook written from it carries no
outputs, no widget state and stable cell ids, so a diff of a notebook is a diff of its cells.

    python tools/build_notebooks.py           # (re)write notebooks/*.ipynb
    python tools/build_notebooks.py --check   # exit 1, naming each notebook that differs from its source

A source is in the "percent" format that jupytext, VS Code and PyCharm open as a notebook:

    # %% [markdown]             a markdown cell: every line a "# " comment ("#" alone for an empty line)
    # %%                        a code cell
    # %% tags=["parameters"]    a code cell with tags (a JSON list)

A cell runs to the next ``# %%`` line; the empty lines around it are not part of it. Each notebook's first code cell
is tagged ``parameters`` (papermill's convention; nbclient runs can insert an overriding cell after it) and its second
is the setup cell, the same in every notebook (tests/test_notebooks.py checks both): an edit to it goes in every
source. Each notebook runs top to bottom on a GPU with a real model, or on a CPU with a tiny local model when there
is no GPU (``model_name="auto"``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "notebooks"
SRC_DIR = OUT_DIR / "src"
HEADER = re.compile(r"# %%(?P<markdown> \[markdown\])?(?: tags=(?P<tags>\[.*\]))?")


def read_cells(path: Path) -> list[tuple[str, str, list[str]]]:
    """The cells of a source, in order: (cell type, text, tags)."""
    cells: list[tuple[str, list[str], list[str]]] = []
    for number, line in enumerate(path.read_text().split("\n"), 1):
        where = f"{path}:{number}"
        if line.startswith("# %%"):
            header = HEADER.fullmatch(line)
            if header is None:
                raise ValueError(f'{where}: a cell starts with "# %%", "# %% [markdown]" or "# %% tags=[...]"')
            tags = json.loads(header["tags"]) if header["tags"] else []
            cells.append(("markdown" if header["markdown"] else "code", [], tags))
        elif not cells:
            raise ValueError(f'{where}: a source starts with a "# %%" line')
        elif cells[-1][0] == "markdown" and line:
            if line != "#" and not line.startswith("# "):
                raise ValueError(f'{where}: a markdown line is a "# " comment')
            cells[-1][1].append(line[2:])
        else:
            cells[-1][1].append(line)
    return [(kind, "\n".join(lines).strip("\n"), tags) for kind, lines, tags in cells]


def build(path: Path) -> nbformat.NotebookNode:
    """A clean notebook: no outputs, no execution counts, no widget state; cell ids derived from the name."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "accelerator": "GPU",  # Colab: ask for a GPU runtime
    }
    for i, (kind, text, tags) in enumerate(read_cells(path)):
        if kind == "markdown":
            cell = nbformat.v4.new_markdown_cell(text)
        else:
            cell = nbformat.v4.new_code_cell(text)
            if tags:
                cell.metadata["tags"] = tags
        cell.id = f"{path.stem[:2]}-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(path: Path) -> str:
    return nbformat.writes(build(path)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a notebook differs from its source")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder to write to (default notebooks/)")
    args = parser.parse_args(argv)
    sources = sorted(SRC_DIR.glob("*.py"))
    stale = []
    for source in sources:
        path = args.out / f"{source.stem}.ipynb"
        text = render(source)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(f"{path} (source: {source})")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if args.check:
        names = {source.stem for source in sources}
        stale += [f"{path} (no source in {SRC_DIR})" for path in sorted(args.out.glob("*.ipynb"))
                  if path.stem not in names]
    if stale:
        print("out of date (run python tools/build_notebooks.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
