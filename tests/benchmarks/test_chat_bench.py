"""CPU test of the chat benchmark's entry point (``python -m benchmarks.chat --tiny``): it runs end to end, with the
sampling rows beside the greedy ones, and writes one row per path and mode (the fast paths say why they do not apply
on a CPU; ``generate``'s sampled tokens repeat for the seed and are not its greedy ones)."""

from __future__ import annotations

import json

from benchmarks import chat as bench


def test_tiny_run_writes_greedy_and_sampling_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    bench.main(["--tiny", "--sample", "--new-tokens", "6", "--batch", "0", "--repeats", "2", "--no-base"])
    rows = json.loads((tmp_path / "chat_tiny.json").read_text())["figures"]
    assert {(r["mode"], r["path"]) for r in rows} == {(m, p) for m in ("greedy", "sample")
                                                       for p in ("generate", "dense", "graphed")}
    by = {(r["mode"], r["path"]): r for r in rows}
    assert "no CUDA device" in by["sample", "dense"]["error"]
    greedy, sampled = by["greedy", "generate"], by["sample", "generate"]
    assert sampled["repeat_first_mismatch"] == [None, None]  # the seed repeats the draws
    assert sampled["token_ids"] != greedy["token_ids"] and sampled["audit"] is None
    assert "| sample | generate |" in capsys.readouterr().out
