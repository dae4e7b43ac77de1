"""Two runs written to one $OUT never share a results file: the name carries every part that sets a run apart."""

from __future__ import annotations

import itertools

from benchmarks.results_names import results_name


def test_runs_that_differ_in_any_part_get_different_names():
    runs = itertools.product(["e2e", "unsloth_e2e"], ["1.7b", "14b"], ["bf16", "fp16"], [[None], [14.0], [None, 14.0]],
                             [(), ("fastsft",), ("sft", "fastsft")], [None, "unsloth", "notebook"])
    names = [results_name(b, shape, dtype, caps, paths, recipe=r) for b, shape, dtype, caps, paths, r in runs]
    assert len(set(names)) == len(names)


def test_the_recipe_names_read_as_before_and_each_cap_is_named_once():
    assert results_name("e2e", "1.7b", "fp16", [15.0], ["fastsft"], recipe="unsloth") == \
        "e2e_recipe-unsloth_1.7b_fp16_cap15_fastsft"
    assert results_name("e2e", "1.7b", "bf16", [None, None, 14.0], ["sft", "fastsft[]"]) == \
        "e2e_1.7b_bf16_uncapped+cap14_sft+fastsft"
