"""nbkit's speedups, and the one table the trainer chooses them from.

Each entry names the speedup (its ``FastSFTConfig`` switch, where it has one), when it attaches, and how it is built
from the run's arguments. A speedup module wires one idea into transformers/PEFT/TRL through a ``PatchLedger``
(``ledger.py``: what a speedup may touch); the numerics it runs live in ``nbkit.ops``.

- ``stage="model"``: attached to the model when ``train()`` / ``evaluate()`` starts, detached when it ends.
- ``stage="trainer"``: attached to the trainer right after the model stage (what it changes is the trainer's step:
  its loss, its clip, its FLOPs count), detached with the others.

The decoder layers have one row, ``decoder_layers``: one ``LayerRunner`` (``layer_runner``), the only nbkit wrapper
on a decoder layer, with the modes ``LAYER_MODES`` builds from their switches (each switch turns its mode off). It
attaches with the model stage and takes over the checkpointed layers when training begins (``begin_training``,
the trainer's ``on_train_begin``: transformers has enabled gradient checkpointing by then); one plan per layer, from
one memory budget (``layer_plan``, ``layer_budget``).

Which rows a run may take at all is decided once, before anything changes, by ``fast_path.decide`` (the model, the
adapter, the collator TRL built, the settings): a model or adapter the speedups were not built for gets none of
them, and a speedup that cannot apply whole (the packed collator and packed attention go together) is not built.

A speedup that decides at its first steps whether to do anything says so through an ``engaged`` attribute (the
layer runner through ``engaged_modes()``, by switch name); the trainer lists it in ``nbkit_attached`` only while it
is engaged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence

from ..switches import switch
from .ledger import PatchLedger, Speedup

__all__ = ["LAYER_MODES", "SPEEDUPS", "SpeedupSpec", "PatchLedger", "Speedup", "build"]


Stage = Literal["model", "trainer"]
STAGES: tuple[Stage, ...] = ("model", "trainer")  # attach order


@dataclass(frozen=True)
class SpeedupSpec:
    """One row of the table: the speedup's name, the stage, and a builder that returns the speedup or None (switched
    off, or not applicable to this run: then the plain path is TRL's own). ``switched``: whether ``name`` is a
    ``FastSFTConfig`` switch; the others are always on (they skip work whose result cannot change)."""

    name: str
    stage: Stage
    # (args, batches packed by nbkit's collator, train dataset, which names the run allows)
    build: Callable[[Any, bool, Any, Callable[[str], bool]], Optional[Speedup]]
    switched: bool = True

    @property
    def switch(self) -> Optional[str]:
        """The ``FastSFTConfig`` field that turns it off, or None."""
        return self.name if self.switched else None


def _packed(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    if not (switch(args, "cached_packing") and packed_batches):
        return None
    from .packed_attention import PackedAttention

    return PackedAttention(kernel=switch(args, "attention_kernel"))


def _allocator(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    mode = switch(args, "expandable_segments")
    if mode is False or (mode == "auto" and getattr(args, "use_cpu", False)):
        return None
    from .expandable_segments import ExpandableSegments

    return ExpandableSegments(mode=mode)


def _moe(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    if not switch(args, "fast_moe_routing"):
        return None
    from .moe import FastMoERouting

    return FastMoERouting()


def _lora(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    if not switch(args, "fused_lora"):
        return None
    from .fused_lora import FusedLoRA

    return FusedLoRA()


def _kernels(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    mode = switch(args, "fused_kernels")
    if mode is False:
        return None
    from .fused_kernels import FusedKernels, liger_ops

    if mode == "auto" and liger_ops() is None:
        return None  # quietly: auto means "where it is available"
    return FusedKernels()


def _tiled(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    mode = switch(args, "tiled_mlp")
    if mode is False:
        return None
    from .tiled_mlp import TiledMLP

    return TiledMLP(tile_tokens=switch(args, "tiled_mlp_tokens"), auto=mode == "auto")


def _offload(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    mode = switch(args, "offload_checkpointing")
    if mode is False or not getattr(args, "gradient_checkpointing", False):
        return None
    from .offload import OffloadedCheckpointing

    return OffloadedCheckpointing(mode=mode, double_buffer=switch(args, "offload_double_buffer"),
                                  min_bytes=switch(args, "offload_min_bytes"),
                                  max_host_bytes=switch(args, "offload_max_host_bytes"))


def _micro_batch(args: Any, row_tokens: int) -> int:
    """``per_device_train_batch_size`` rows of ``row_tokens``, each padded up to ``pad_to_multiple_of``."""
    multiple = getattr(args, "pad_to_multiple_of", None)
    if isinstance(multiple, int) and not isinstance(multiple, bool) and multiple > 1:
        row_tokens = -(-row_tokens // multiple) * multiple
    return int(getattr(args, "per_device_train_batch_size", 1) or 1) * int(row_tokens)


def max_micro_batch_tokens(args: Any) -> Optional[int]:
    """The most tokens one training micro-batch can hold: rows are truncated or packed to ``max_length``, and
    padding (per row, or of a padding-free batch) goes up to a multiple of ``pad_to_multiple_of``. None: unbounded."""
    length = getattr(args, "max_length", None)
    return _micro_batch(args, length) if length else None


def longest_example_tokens(dataset: Any) -> Optional[int]:
    """The longest tokenized example of a map-style ``datasets.Dataset`` (its ``input_ids`` column, read from Arrow
    without loading it into Python); None for anything else (an iterable dataset, an untokenized one)."""
    data = getattr(dataset, "data", None)
    if data is None or "input_ids" not in getattr(dataset, "column_names", ()):
        return None
    try:
        import pyarrow.compute as pc

        longest = pc.max(pc.list_value_length(data.column("input_ids"))).as_py()
    except Exception:  # noqa: BLE001 - an unexpected column type: no bound, the speedup stays off
        return None
    return int(longest) if longest else None


def dataset_micro_batch_tokens(args: Any, dataset: Any) -> Optional[int]:
    """The most tokens one micro-batch of ``dataset`` can hold when ``max_length`` sets no bound (TRL refuses
    ``max_length`` for padding-free rows without packing): ``per_device_train_batch_size`` x its longest example
    (rounded up to ``pad_to_multiple_of``). The whole table is read, rows a selection or shuffle left out included:
    an upper bound."""
    longest = longest_example_tokens(dataset)
    return _micro_batch(args, longest) if longest is not None else None


def _selective(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    mode = switch(args, "selective_checkpointing")
    if mode is False or not getattr(args, "gradient_checkpointing", False):
        return None
    import torch

    if mode == "auto" and (getattr(args, "use_cpu", False) or not torch.cuda.is_available()):
        return None  # quietly: 'auto' sizes by CUDA memory
    from .selective_checkpointing import SelectiveCheckpointing

    # no max_length (padding-free rows without packing, where TRL refuses it): the dataset bounds a micro-batch
    bound = max_micro_batch_tokens(args) or dataset_micro_batch_tokens(args, dataset)
    accumulation = getattr(args, "gradient_accumulation_steps", 1) or 1
    return SelectiveCheckpointing(mode=mode, max_tokens=bound, accumulation=accumulation)


def _graphs(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    mode = switch(args, "cuda_graphs")
    if mode is False or not packed_batches:
        return None  # the graphs read cached_packing's metadata
    import torch

    if mode == "auto" and (getattr(args, "use_cpu", False) or not torch.cuda.is_available()):
        return None  # quietly: 'auto' means where graphs exist (True attaches and says why it cannot)
    from .cuda_graphs import CudaGraphs

    return CudaGraphs(mode=mode, checkpointed=bool(switch(args, "cuda_graphs_checkpointed")))


def _dequant(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    mode = switch(args, "dequant_cache")
    if mode is False or not switch(args, "fused_lora"):
        return None  # the kept copies are read by fused_lora's layers only
    import torch

    if mode == "auto" and (getattr(args, "use_cpu", False) or not torch.cuda.is_available()):
        return None  # quietly: 'auto' sizes by CUDA memory
    from .dequant_cache import DequantCache, compute_dtype

    return DequantCache(mode=mode, dtype=compute_dtype(args))


def _sync_free(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    if not switch(args, "sync_free_metrics"):
        return None
    from .sync_free_loss import SyncFreeLoss

    return SyncFreeLoss()


def _walks(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    from .step_walks import CachedTrainableWalks

    return CachedTrainableWalks()


def _flops(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    from .step_flops import CachedFlops

    return CachedFlops()


# The decoder layers' modes: (switch, role in the LayerRunner, builder), in the order the runner is handed them
LAYER_MODES: tuple[tuple[str, str, Callable], ...] = (
    ("selective_checkpointing", "keep", _selective),
    ("offload_checkpointing", "offload", _offload),
    ("cuda_graphs", "graphs", _graphs),
    ("tiled_mlp", "tiled", _tiled),
    ("dequant_cache", "dequant", _dequant),
)
LAYERS = "decoder_layers"


def _layers(args: Any, packed_batches: bool, dataset: Any = None, allows: Any = None) -> Optional[Speedup]:
    """The one layer runner, with every mode the switches (and the run's path) allow; None without any."""
    modes = {}
    for name, role, make in LAYER_MODES:
        if allows is None or allows(name):
            mode = make(args, packed_batches, dataset)
            if mode is not None:
                modes[role] = mode
    if not modes:
        return None
    from .layer_runner import LayerRunner

    return LayerRunner(**modes)


SPEEDUPS: tuple[SpeedupSpec, ...] = (
    SpeedupSpec("expandable_segments", "model", _allocator),  # first: before the run allocates anything
    SpeedupSpec("cached_packing", "model", _packed),
    SpeedupSpec("fast_moe_routing", "model", _moe),
    SpeedupSpec("fused_lora", "model", _lora),
    SpeedupSpec("fused_kernels", "model", _kernels),
    SpeedupSpec(LAYERS, "model", _layers, switched=False),  # after fused_kernels: the MLP forward it found is run
    SpeedupSpec("sync_free_metrics", "trainer", _sync_free),
    SpeedupSpec("step_walks", "trainer", _walks, switched=False),
    SpeedupSpec("step_flops", "trainer", _flops, switched=False),
)


ALWAYS_ON = frozenset(spec.name for spec in SPEEDUPS if not spec.switched)  # not listed as attached: no choice


def build(stage: str, args: Any, packed_batches: bool, dataset: Any = None, path: Any = None,
          attached: Sequence[Speedup] = ()) -> list[Speedup]:
    """The speedups of ``stage`` this run's arguments (and its train dataset, where they need it) switch on, in
    table order (attach order). ``path``: the run's ``fast_path.FastPath``, decided once before anything changed;
    a row it does not allow is not built (none, for a run it keeps on TRL's own path). ``attached``: the speedups
    of the stages before, attached now. One that reads another's work is handed it here: the layer runner's
    ``cuda_graphs`` mode reads the per-forward runs of ``cached_packing``'s ``PackedAttention``
    (``CudaGraphs.packed``)."""
    allows = path.allows if path is not None else None
    built = [s for s in (spec.build(args, packed_batches, dataset, allows) for spec in SPEEDUPS
                         if spec.stage == stage and (allows is None or spec.name == LAYERS or allows(spec.name)))
             if s is not None]
    packed = next((s for s in (*attached, *built) if s.name == "cached_packing"), None)
    for speedup in built:
        graphs = getattr(speedup, "graphs", None)
        if graphs is not None and getattr(graphs, "packed", None) is None:
            graphs.packed = packed
    return built
