"""Benchmark results are in one schema, and BENCHMARKS.md cites exactly the results files there are.

The schema (benchmarks/README.md): a JSON object with exactly the keys benchmark, date, command, git_commit,
environment, figures, notes. ``benchmark`` names a module of benchmarks/; ``command`` runs it
(``python -m benchmarks.<benchmark> ...``; a result converted from the benchmarks' earlier location may name
``python -m nbkit.bench.<benchmark>`` if its notes say what was recorded afterwards); ``environment`` names the
machine and the versions; ``figures`` is a non-empty list of row objects.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
KEYS = {"benchmark", "date", "command", "git_commit", "environment", "figures", "notes"}
ENVIRONMENT = {"machine", "python", "torch", "cuda", "transformers", "trl", "peft", "bitsandbytes", "liger_kernel",
               "triton", "flash_attn"}
CITED = re.compile(r"benchmarks/results/[\w.\-]+\.json")


def schema_errors(payload: object) -> list[str]:
    """What keeps ``payload`` from the schema (empty when it follows it)."""
    if not isinstance(payload, dict):
        return ["not a JSON object"]
    errors = []
    if set(payload) != KEYS:
        errors.append(f"keys {sorted(payload)}; want {sorted(KEYS)}")
    bench = payload.get("benchmark")
    if not (isinstance(bench, str) and (ROOT / "benchmarks" / f"{bench}.py").is_file()):
        errors.append(f"benchmark {bench!r} is not a module of benchmarks/")
    if not (isinstance(payload.get("date"), str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", payload["date"])):
        errors.append(f"date {payload.get('date')!r} is not YYYY-MM-DD")
    notes = payload.get("notes")
    if not isinstance(notes, str):
        errors.append("notes is not a string")
        notes = ""
    modules = [f"benchmarks.{bench}"] + ([f"nbkit.bench.{bench}"] if "recorded afterwards" in notes else [])
    command = payload.get("command")
    if not (isinstance(command, str) and any(re.fullmatch(rf"python -m {re.escape(m)}( .+)?", command)
                                             for m in modules)):
        errors.append(f"command {command!r} does not run {' or '.join(modules)}")
    commit = payload.get("git_commit")
    if not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", commit)):
        errors.append(f"git_commit {commit!r} is not a full commit hash (or 'unknown')")
    env = payload.get("environment")
    if not isinstance(env, dict) or not ENVIRONMENT <= set(env):
        errors.append(f"environment lacks {sorted(ENVIRONMENT - set(env or {}))}")
    elif not all(isinstance(v, str) and v for v in env.values()):
        errors.append("environment values must be non-empty strings")
    figures = payload.get("figures")
    if not (isinstance(figures, list) and figures and all(isinstance(r, dict) and r for r in figures)):
        errors.append("figures is not a non-empty list of rows")
    return errors


def result_files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


def test_the_results_folder_holds_json_files_only():
    assert result_files(), "no results"
    others = [p.name for p in RESULTS.iterdir() if p.suffix != ".json"]
    assert not others, others


@pytest.mark.parametrize("path", result_files(), ids=lambda p: p.name)
def test_every_results_file_follows_the_schema(path):
    assert schema_errors(json.loads(path.read_text())) == []


def test_benchmarks_md_cites_every_results_file_and_only_existing_ones():
    cited = set(CITED.findall((ROOT / "BENCHMARKS.md").read_text()))
    present = {f"benchmarks/results/{p.name}" for p in result_files()}
    assert sorted(cited - present) == [], "cited but missing"
    assert sorted(present - cited) == [], "present but not cited"


def test_benchmarks_md_names_only_paths_that_exist():
    """Every repository path BENCHMARKS.md names in backticks (a file under nbkit/, benchmarks/ or tests/) exists."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    named = set(re.findall(r"`((?:nbkit|benchmarks|tests|notes)/[\w./\-]+\.\w+)`", text))
    assert sorted(p for p in named if not (ROOT / p).is_file()) == []
    assert "FACTS.md" not in text


def test_the_writer_produces_the_schema(tmp_path, monkeypatch):
    """``write_results`` records the exact command line and writes what it returns; a payload of named parts
    (rows plus run-level values) becomes rows that each carry those values."""
    from benchmarks.common import write_results

    monkeypatch.setenv("OUT", str(tmp_path))
    rows = [{"path": "sft", "step_ms": 12.5}, {"path": "fastsft", "step_ms": 6.25}]
    payload = write_results("packing", rows, "a note", argv=["--paths", "sft,fastsft[a=1;b=2]"])
    assert schema_errors(payload) == []
    assert payload["command"] == "python -m benchmarks.packing --paths 'sft,fastsft[a=1;b=2]'"
    assert json.loads((tmp_path / "packing.json").read_text()) == payload
    assert payload["figures"] == rows and payload["notes"] == "a note"

    payload = write_results("moe", {"env": {}, "args": {}, "table": "|", "tokens": 256, "rows": rows}, argv=[],
                            name="moe_tiny")
    assert schema_errors(payload) == [] and payload["command"] == "python -m benchmarks.moe"
    assert payload["figures"] == [dict(r, tokens=256) for r in rows]
    assert (tmp_path / "moe_tiny.json").is_file()


def test_the_schema_check_rejects_what_breaks_it():
    good = json.loads(result_files()[0].read_text())
    assert schema_errors(good) == []
    for broken in (
        {k: v for k, v in good.items() if k != "notes"},
        dict(good, extra=1),
        dict(good, benchmark="nope"),
        dict(good, date="29/11/2026"),
        dict(good, command="python bench.py"),
        dict(good, git_commit="HEAD"),
        dict(good, environment={"torch": "2.11"}),
        dict(good, figures=[]),
        dict(good, figures=[1, 2]),
    ):
        assert schema_errors(broken), broken
    moved = dict(good, command=f"python -m nbkit.bench.{good['benchmark']}", notes="")
    assert schema_errors(moved), "an old module path needs notes saying what was recorded afterwards"
