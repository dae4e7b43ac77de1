"""``python -m nbkit``: the command dispatch, its usage and ``--version`` (what a bug report needs first)."""

from __future__ import annotations

import pytest

import nbkit
from nbkit.__main__ import main


def test_version_names_nbkit_and_its_stack(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"nbkit {nbkit.__version__} (")
    for name in ("torch", "transformers", "trl", "peft", "bitsandbytes", "datasets", "flash-attn"):
        assert f"{name} " in out


@pytest.mark.parametrize(("argv", "code"), [([], 2), (["--help"], 0), (["demos"], 2)])
def test_usage_and_unknown_commands(capsys, argv, code):
    assert main(argv) == code
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "usage: python -m nbkit {demo,setup,export}" in text and "--version" in text
    if argv == ["demos"]:
        assert "unknown command 'demos'" in captured.err
