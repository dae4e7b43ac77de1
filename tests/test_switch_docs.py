"""Each switch is described once, in its row of ``nbkit.switches``: ``FastSFTConfig``'s fields, their defaults and help,
``settings.SWITCH_VALUES`` and README.md's switch table (written by ``tools/switch_table.py``) all follow the rows.
CPU, no model; exact comparisons (strings and values), no tolerances."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from trl import SFTConfig

from nbkit import FastSFTConfig
from nbkit.settings import SWITCH_VALUES
from nbkit.switches import AUTO_BOOL, BY_NAME, POSITIVE_INT, SUMMARY_MAX, SWITCHES, Switch
from tools.switch_table import END, README, START, default_cell, main, render, with_table

ADDED = [f for f in dataclasses.fields(FastSFTConfig) if f.name not in SFTConfig.__dataclass_fields__]
HINTS = typing.get_type_hints(FastSFTConfig)


def test_every_field_nbkit_adds_has_one_row_and_every_row_a_field():
    names = [row.name for row in SWITCHES]
    assert len(names) == len(set(names)), "a switch has two rows"
    assert {f.name for f in ADDED} == set(names), {f.name for f in ADDED} ^ set(names)


@pytest.mark.parametrize("name", [row.name for row in SWITCHES])
def test_the_fields_default_and_help_are_its_rows(name):
    row, f = BY_NAME[name], FastSFTConfig.__dataclass_fields__[name]
    assert f.default is row.default or (type(f.default) is type(row.default) and f.default == row.default)
    assert f.default_factory is dataclasses.MISSING
    assert f.metadata["help"] == row.help


def _accepts(hint: typing.Any, value: typing.Any) -> bool:
    """Whether a value fits the field's type as HfArgumentParser reads it (Literal, Optional, a plain type)."""
    if typing.get_origin(hint) is typing.Literal:
        return any(value is a or (isinstance(a, str) and value == a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Union:
        return any(_accepts(member, value) for member in typing.get_args(hint))
    if hint is type(None):
        return value is None
    return isinstance(value, hint) and (hint is bool or not isinstance(value, bool))


@pytest.mark.parametrize("name", [row.name for row in SWITCHES])
def test_the_fields_type_takes_the_rows_default_and_every_value_it_accepts(name):
    row, hint = BY_NAME[name], HINTS[name]
    assert _accepts(hint, row.default), (hint, row.default)
    for value in row.values or ():
        assert _accepts(hint, 4096 if value == POSITIVE_INT else value), (hint, value)
    if row.values == AUTO_BOOL:  # the Literal HfArgumentParser needs for True / False / "auto"
        assert set(typing.get_args(hint)) == set(AUTO_BOOL)


def test_switch_values_are_the_rows_values():
    assert SWITCH_VALUES == {row.name: row.values for row in SWITCHES if row.values is not None}


def test_the_readme_table_is_the_one_the_rows_make():
    text = README.read_text()
    assert with_table(text, render()) == text, "README.md's switch table is stale: run python tools/switch_table.py"
    block = text.split(START, 1)[1].split(END, 1)[0]
    for row in SWITCHES:
        assert f"| `{row.name}` | `{default_cell(row.default)}` | {row.summary} |" in block


def test_the_tool_checks_and_rewrites_a_stale_table(tmp_path, capsys):
    readme = tmp_path / "README.md"
    fresh = with_table(f"# x\n\n{START}\n{END}\n\nbelow\n", render())
    readme.write_text(fresh.replace(SWITCHES[0].summary, "an old description"))
    assert main(["--check", "--readme", str(readme)]) == 1
    assert "switch_table.py" in capsys.readouterr().out
    assert main(["--readme", str(readme)]) == 0 and readme.read_text() == fresh
    assert main(["--check", "--readme", str(readme)]) == 0
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="switches:start"):
        main(["--check", "--readme", str(readme)])


def test_defaults_are_written_as_a_user_writes_them():
    assert [default_cell(v) for v in (True, None, "auto", 16 * 2**20, 8 * 2**30, 4096)] == [
        "True", "None", '"auto"', "16 * 2**20", "8 * 2**30", "4096"]


def test_a_row_refuses_a_long_summary_a_percent_in_help_and_a_default_it_does_not_accept():
    Switch("x", True, summary="Short.", help="Long.")
    with pytest.raises(ValueError, match="summary"):
        Switch("x", True, summary="y" * (SUMMARY_MAX + 1), help="Long.")
    with pytest.raises(ValueError, match="summary"):
        Switch("x", True, summary="two\nlines", help="Long.")
    with pytest.raises(ValueError, match="%"):
        Switch("x", True, summary="Short.", help="90% of it")
    with pytest.raises(ValueError, match="default"):
        Switch("x", "on", summary="Short.", help="Long.", values=AUTO_BOOL)


def test_the_command_line_help_shows_every_switch():
    """``--help`` of a script parsing FastSFTConfig (TRL's TrlParser is an HfArgumentParser) formats every help."""
    from transformers import HfArgumentParser

    text = " ".join(HfArgumentParser(FastSFTConfig).format_help().split())
    for row in SWITCHES:
        assert f"--{row.name}" in text
        assert " ".join(row.help.split()[:6]) in text, row.name
