"""Write README.md's switch table from the rows of ``nbkit.switches`` (run from anywhere).

Why a generator: a switch is described once, in its row (``nbkit/switches.py``); the README's table is made from the
rows' one-line summaries and defaults, between the markers ``START`` and ``END``, so it cannot drift from the config.

    python tools/switch_table.py           # rewrite the table in README.md
    python tools/switch_table.py --check   # exit 1 if README.md's table differs from what the rows make
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START = "<!-- switches:start: written by tools/switch_table.py from nbkit/switches.py; edit the rows there -->"
END = "<!-- switches:end -->"
HEADER = "| switch | default | what it does (in full: its `help`, in `nbkit/switches.py`) |"


def default_cell(value: Any) -> str:
    """A default as a user writes it: ``True``, ``"auto"``, ``None``, ``16 * 2**20`` (whole MiB or GiB of bytes)."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        for power in (30, 20):
            if value % 2**power == 0:
                return f"{value // 2**power} * 2**{power}"
    return repr(value)


def render() -> str:
    """The switch table, one row per switch: its name, its default and its summary."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # run from a checkout without nbkit installed
    from nbkit.switches import SWITCHES

    lines = [HEADER, "|---|---|---|"]
    lines += [f"| `{row.name}` | `{default_cell(row.default)}` | {row.summary} |" for row in SWITCHES]
    return "\n".join(lines)


def with_table(text: str, table: str) -> str:
    """``text`` (README.md's) with the part between the markers replaced by ``table``; ValueError without markers."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"README.md needs one {START!r} line before one {END!r} line")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{START}\n\n{table}\n\n{END}{tail}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table differs instead of writing it")
    parser.add_argument("--readme", type=Path, default=README, help="the README to write or check")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    wanted = with_table(text, render())
    if wanted == text:
        return 0
    if args.check:
        print(f"{args.readme}: the switch table differs from nbkit/switches.py's rows; run python tools/switch_table.py")
        return 1
    args.readme.write_text(wanted)
    print(f"wrote the switch table of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
