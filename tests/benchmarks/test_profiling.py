"""CPU tests of the profile's module ranges (``benchmarks.profiling.module_ranges``): a graphed path keeps its
decoder layers free of hooks (a hook inside a layer makes ``cuda_graphs`` run it eagerly, so the profile would time
another path), and a forward that raises leaves no range open."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.profiling import module_ranges
from nbkit.demo.models import tiny_model
from nbkit.model_parts import decoder_layers
from nbkit.speedups.graph_eligibility import hooked


def _hooks(m: torch.nn.Module) -> int:
    return len(m._forward_pre_hooks) + len(m._forward_hooks)


def test_layers_split_by_default_and_kept_whole_for_a_graphed_path():
    model = tiny_model("qwen3", 64, seed=0)
    layers = decoder_layers(model)
    with module_ranges(model):
        assert all(hooked(layer) for layer in layers)  # split: what cuda_graphs refuses
    with module_ranges(model, inside_layers=False):
        assert not any(hooked(layer) for layer in layers)
        assert all(_hooks(layer) == 2 for layer in layers)  # one range around each layer
        assert _hooks(model.model.embed_tokens) == 2 and _hooks(model.model.norm) == 2
    assert not any(_hooks(m) for m in model.modules())  # all removed


def test_a_forward_that_raises_closes_its_range():
    model = tiny_model("qwen3", 64, seed=0)
    layer = decoder_layers(model)[0]

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    layer.mlp.forward = boom
    ids = torch.randint(0, 64, (1, 8))
    with torch.autograd.profiler.profile() as prof, module_ranges(model):
        with pytest.raises(RuntimeError, match="boom"):
            model(input_ids=ids)
        time.sleep(0.2)  # a range left open would last until the ranges are dropped
    mlp = [e for e in prof.function_events if e.name == "fwd:mlp"]
    assert len(mlp) == 1 and mlp[0].time_range.elapsed_us() < 100_000
