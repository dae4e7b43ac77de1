"""The one table of nbkit's switches: every ``FastSFTConfig`` field nbkit adds to TRL's ``SFTConfig``, one row each.

Why one table: a switch used to be described three times (its ``help`` in ``config.py``, its values in
``settings.SWITCH_VALUES``, its row in README.md), and the three drifted. A ``Switch`` row holds all of it once:

- ``name`` and ``default``: ``FastSFTConfig``'s field and its default (``config.py`` keeps each field's type
  annotation, which transformers' ``HfArgumentParser`` / TRL's ``TrlParser`` read; the field's default and help come
  from here through ``config_field``);
- ``values``: the values the switch accepts where they are a fixed set (``AUTO_BOOL``, a tuple of strings, or
  ``(None, POSITIVE_INT)``), from which ``settings.SWITCH_VALUES`` is built; None where the field's type says it all
  (a plain bool or int, read by ``settings.numeric_fields``);
- ``summary``: one short line, the README's switch table cell (``python tools/switch_table.py`` writes that table
  between its markers; ``--check`` compares);
- ``help``: the whole description, the field's ``metadata["help"]`` (what ``--help`` of a script parsing
  ``FastSFTConfig`` prints). Long explanations live here, not in the summary.

Contract: ``SWITCHES`` lists the rows in the README's order; ``tests/test_switch_docs.py`` fails when a field nbkit
adds has no row or a row no field, when a field's default or help differs from its row, or when README's table is
not the one the rows make. A row refuses a multi-line or long summary, and a ``%`` in its help (argparse formats help
strings with ``%``, so ``--help`` would fail).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .ops.varlen_attention import KERNELS

AUTO_BOOL = (True, False, "auto")
POSITIVE_INT = "a positive int"  # in a switch's values: any int >= 1 (not a bool) is allowed too
SUMMARY_MAX = 120  # characters: a summary is a table cell, not a paragraph


@dataclasses.dataclass(frozen=True)
class Switch:
    """One switch of ``FastSFTConfig`` (see the module docstring for what each field feeds)."""

    name: str
    default: Any
    summary: str
    help: str
    values: Optional[tuple[Any, ...]] = None

    def __post_init__(self) -> None:
        if "\n" in self.summary or len(self.summary) > SUMMARY_MAX or "|" in self.summary:
            raise ValueError(f"{self.name}: the summary is one line of at most {SUMMARY_MAX} characters, without '|'")
        if "%" in self.help:
            raise ValueError(f"{self.name}: no '%' in help (argparse formats help strings with %; write 'percent')")
        if self.values is not None and self.values != (None, POSITIVE_INT) and self.default not in self.values:
            raise ValueError(f"{self.name}: the default {self.default!r} is not one of its values {self.values!r}")


SWITCHES: tuple[Switch, ...] = (
    Switch(
        "cached_packing", True,
        summary="Each batch's document boundaries are built once, when it is collated; attention reuses them: no T x T mask.",
        help="Build each batch's document boundaries (cu_seqlens, max_seqlen, position ids) once on the host when the "
        "batch is collated; every attention layer reuses them through nbkit's 'nbkit' attention and its varlen "
        "kernels: no dense T x T mask, no per-layer rebuild, no GPU-to-CPU sync in the forward. With packing=False, "
        "batches still go padding-free.",
    ),
    Switch(
        "attention_kernel", "auto", values=("auto", *KERNELS),
        summary="The packed attention's kernel. `\"auto\"`: flash-attn, else torch's varlen flash kernel, else exact SDPA.",
        help="Kernel for the 'nbkit' attention. 'auto': 'flash_attn' (flash-attn's varlen kernel) if installed, else "
        "'varlen' (torch's varlen flash kernel; sm80+, fp16/bf16), else 'sdpa'. 'sdpa': exact SDPA, the path for the "
        "T4, CPUs, fp32 and Gemma 2's soft-capping: the whole row in one call per layer with a T x T block-diagonal "
        "mask built once per step ('sdpa_masked') when the row holds more than two documents and the mask is small "
        "(at most 8,192 tokens; with soft-capping, while the fp32 scores of one layer stay under 1 GiB), else one "
        "call per document ('sdpa_loop', never a T x T mask); 'sdpa_masked' / 'sdpa_loop' force one of the two. "
        "'flex': flex attention with a block mask built once per step (CUDA; compiles for minutes). gpt-oss's "
        "attention sinks run on torch's varlen flash kernel (the rows rescaled by the sink, checked once by a probe). "
        "Models that need soft-capping (Gemma 2) use flash-attn or the exact path, with one warning.",
    ),
    Switch(
        "offload_checkpointing", "auto", values=AUTO_BOOL,
        summary="Checkpointed layer inputs wait in pinned CPU memory (side-stream copies, prefetched back in backward).",
        help="Keep checkpointed layer inputs in pinned CPU memory, copied there on a side stream and prefetched back "
        "in backward (double-buffered: offload_double_buffer). 'auto': on where it pays (CUDA with gradient "
        "checkpointing and layer inputs of at least offload_min_bytes), off on CPU and in eval. True needs "
        "gradient_checkpointing=True.",
    ),
    Switch(
        "offload_double_buffer", True,
        summary="Prefetch the next layer's offloaded input while the current one recomputes.",
        help="Prefetch the next layer's offloaded input into a second GPU buffer while the current one recomputes.",
    ),
    Switch(
        "offload_min_bytes", 16 * 2**20,
        summary="`\"auto\"` offloads a layer's checkpointed input only from this size on (16 MiB).",
        help="'auto' offloads only when one layer's checkpointed input is at least this large (16 MiB: 4K tokens of "
        "a 2048-wide model; its copy is ~0.3 ms and hides behind the layer).",
    ),
    Switch(
        "offload_max_host_bytes", None, values=(None, POSITIVE_INT),
        summary="Host RAM for offloaded layer inputs, at most (the rest stay on the GPU); `None`: the host's, less 4 GiB.",
        help="At most this many bytes of host RAM for offloaded layer inputs; the rest stay on the GPU (free Colab "
        "has ~12 GB of RAM in all). None: what the host has, less 4 GiB.",
    ),
    Switch(
        "selective_checkpointing", "auto", values=AUTO_BOOL,
        summary="The last layers whose activations fit in free GPU memory skip the recompute (or recompute only the MLP).",
        help="With gradient checkpointing on, let the layer plan keep the activations of the last decoder layers that "
        "fit in the GPU's free memory (no recompute in backward for them), and where a whole layer does not fit, its "
        "attention's with only the MLP recomputed; the rest stay checkpointed (offloaded, when offload_checkpointing "
        "is on, unless their inputs fit on the GPU). Planned after the first step from what each layer saves "
        "(measured in that step's recompute), the peak memory so far and the longest micro-batch "
        "(per_device_train_batch_size x max_length, or x the dataset's longest tokenized example without "
        "max_length), and once more after the first optimizer step; the plan is said in one line. 'auto': on CUDA; "
        "True: also on a CPU (every layer kept there). Same losses and gradients; more GPU memory in use, up to what "
        "was free.",
    ),
    Switch(
        "cuda_graphs", "auto", values=AUTO_BOOL,
        summary="Un-checkpointed dense layers replay forward and backward as CUDA graphs: short rows skip Python's launches.",
        help="Replay each decoder layer the layer plan keeps whole (every layer without gradient checkpointing, or those "
        "selective_checkpointing keeps) as one CUDA graph in the forward and one in the backward, so short rows are "
        "not bound by Python's kernel launches (checkpointed layers too with cuda_graphs_checkpointed). Micro-batches "
        "are padded up to buckets of 256 to 8,192 tokens (the padding is one more document, with a zero gradient), one "
        "set of graphs per bucket, captured at its first use (the step after the first: about a second). Needs "
        "cached_packing with the varlen or flash_attn kernel; dense models only (not MoE), no dropout, no hooks inside "
        "the layers; anything else runs eagerly, said once. 'auto': on CUDA for buckets where a layer's parameters x "
        "tokens stay below 6e11 (larger layers keep the GPU busy anyway: a 14B model's 4K rows were 10 percent slower "
        "graphed; BENCHMARKS.md, cuda_graphs); True: every bucket. Same losses and gradients as the eager layers up to "
        "rounding, under gradient accumulation, several micro-batch shapes per step and the tiled MLP (the GPU parity "
        "matrix, BENCHMARKS.md, Parity of the defaults); a layer whose capture would not be exact (other position "
        "embeddings than the captured ones, a trainable parameter the graph does not reach) stays eager.",
    ),
    Switch(
        "cuda_graphs_checkpointed", True, values=(True, False),
        summary="Checkpointed layers replay forward, recompute and backward as CUDA graphs too: big models on small cards.",
        help="With cuda_graphs on, also replay each decoder layer the plan leaves checkpointed (offloaded or not; after the "
        "first step, under torch's own checkpoint function) as CUDA graphs: its forward without grad, and in the "
        "backward its recompute and backward back to back, keeping only its input as checkpointing does; all such "
        "layers' graphs share one memory pool that holds one layer's activations, and the plan holds that pool back "
        "from what it spends. Same losses and gradients as checkpointing up to rounding (tests/gpu). On Unsloth's recipe "
        "at the Qwen3-14B shape capped at 15 GiB in fp16 (a T4's memory) and 22 GiB (an L4's) it was 1.39x and 1.18x "
        "the defaults with it off (BENCHMARKS.md, run 26). With every layer kept it changes nothing; False: checkpointed "
        "layers run eagerly, under checkpointing as before.",
    ),
    Switch(
        "fast_moe_routing", True,
        summary="MoE experts run sorted by expert: contiguous slices or one grouped matmul.",
        help="Run MoE experts through nbkit's routing: one sort by expert, contiguous slices or one grouped matmul, "
        "LoRA on experts as low-rank products.",
    ),
    Switch(
        "fused_lora", True,
        summary="PEFT LoRA layers (dense or 4-bit base) run as nbkit's fused autograd functions.",
        help="Run PEFT LoRA Linear layers (dense or 4-bit base) as nbkit's own autograd functions: the base GEMM "
        "accumulates into the LoRA product (no clone, cast, scale or add passes), and a checkpointed layer's "
        "recompute skips its last projection's base GEMM (its output is never read in backward). Layers with DoRA, "
        "dropout > 0 or a LoRA bias keep PEFT's forward.",
    ),
    Switch(
        "expandable_segments", "auto", values=AUTO_BOOL,
        summary="The CUDA allocator grows segments in place while training: a longer row maps pages, not new blocks.",
        help="Turn on the CUDA caching allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True) for the train() or evaluate() call, off again after it. With the default segments "
        "the first micro-batch longer than all before allocates new blocks for its whole activation set while the old "
        "ones stay cached: a slow step and gigabytes of reserved memory nobody reuses (BENCHMARKS.md, "
        "expandable_segments). 'auto': on a CUDA GPU on Linux under torch's own allocator, unless the user set "
        "expandable_segments themselves (either way: theirs is kept); True: wherever torch takes the setting; "
        "False: never. Allocation only: the same numbers, bit for bit.",
    ),
    Switch(
        "dequant_cache", "auto", values=AUTO_BOOL,
        summary="Fused LoRA layers' frozen 4-bit weights kept dequantized where memory is to spare; same numbers.",
        help="Keep the frozen 4-bit base weights of the LoRA layers fused_lora runs dequantized, in the step's compute "
        "dtype, instead of dequantizing each twice a step (forward, and backward for the input gradient). Planned "
        "layer by layer with the activations, from the same budget and after them (three quarters of the GPU memory "
        "left after the first step: the limit less 10 percent, the peak so far and the optimizer state), and again "
        "after the first optimizer step; 'auto': on CUDA; True: every layer (also on a CPU); False: never. The kept "
        "tensor is what the dequantization returns: outputs and gradients bit for bit the same. Costs 2 bytes a "
        "weight (a 1.7B model: about 3 GB).",
    ),
    Switch(
        "fused_kernels", "auto", values=AUTO_BOOL,
        summary="Fused RMSNorm, SwiGLU/GeGLU and RoPE kernels on CUDA (Liger-Kernel's; frozen norms nbkit's), when Liger is "
        "installed.",
        help="Liger-Kernel's fused RMSNorm, SwiGLU/GeGLU and RoPE on known families (Llama, Mistral, Qwen2/3, "
        "Qwen3-MoE, Mixtral, Gemma 1-3). 'auto': on when liger-kernel is installed (pip install "
        "\"nbkit-sft[liger]\"; colab_setup.sh installs it on GPUs) and the model is on CUDA. A norm whose weight "
        "does not train (every norm under LoRA) runs nbkit's RMSNorm kernel, whose backward computes no weight gradient.",
    ),
    Switch(
        "tiled_mlp", "auto", values=AUTO_BOOL,
        summary="For rows too long to fit: each MLP runs over tiles of the sequence. `\"auto\"`: only where memory runs short.",
        help="Run each decoder layer's dense MLP over tiles of the sequence, recomputed per tile in backward, so its "
        "(tokens x intermediate) activations exist for one tile at a time: for rows too long to fit otherwise. "
        "'auto': only MLP calls whose untiled MLP would take the GPU past 90 percent of its memory are tiled (judged "
        "from the allocator's counters once per input shape, so a checkpointed layer's recompute repeats its "
        "forward's choice; nothing on a CPU), so rows that fit run at full speed; True: every call longer than a "
        "tile. Tiles of tiled_mlp_tokens tokens. A tiled call costs one more MLP forward (16 percent of the step at "
        "32K tokens on the Llama-3.1-8B shape, BENCHMARKS.md, Long context). MoE blocks are not tiled.",
    ),
    Switch(
        "tiled_mlp_tokens", None, values=(None, POSITIVE_INT),
        summary="Tokens per tile of `tiled_mlp`; `None`: the model's hidden size.",
        help="Tokens per tile of tiled_mlp. None: the model's hidden size (one tile's activation is then the size of "
        "one MLP weight).",
    ),
    Switch(
        "sync_free_metrics", True,
        summary="TRL's loss, LM head and per-step metrics without a host read between forward and backward.",
        help="Keep TRL's per-step metrics (entropy, token accuracy, token count, MoE aux loss) on the GPU and read "
        "them when logging, instead of reading them on the host right after every forward, which makes the host wait "
        "for the GPU before it may queue the backward; with packed batches the collator also lists the labelled "
        "positions on the host, so TRL's fused LM head scores them without selecting them by a boolean mask (another "
        "read). The same loss, gradients and logged values (tested bit for bit); TRL's own compute_loss where it "
        "does something else (compute_loss_func, label smoothing, sequence parallelism, several processes), TRL's "
        "own head for MoE models that add the router loss.",
    ),
    Switch(
        "live_dashboard", "auto", values=AUTO_BOOL,
        summary="The live panel inside a notebook (`True`: always, `False`: never).",
        help="Attach nbkit.LiveDashboard: 'auto' inside a notebook, True always, False never. Viewers that show text "
        "only get a text line. Its callbacks took 0.8 percent of a 1.7B QLoRA 4K-token step on the H200.",
    ),
    # reliability (nbkit.reliability): what happens when something goes wrong, never the numbers of a run that goes right
    Switch(
        "validate_inputs", True,
        summary="Datasets and settings checked before training; each bad input named, with what to do.",
        help="Check datasets and settings before TRL prepares them, and fail with an error (or warn) naming the rows "
        "or the setting and what to do: an empty dataset, missing, mistyped or non-string fields, empty texts, "
        "answers or assistant turns (rows with nothing to learn), chats without an assistant turn, ShareGPT chats "
        "TRL would not convert (roles human/gpt, from/value keys: nbkit.reliability.from_sharegpt(dataset) maps "
        "them), no chat template, max_length below every document, incompatible switches, and, once TRL has "
        "prepared the data, a stop token no row trains (the model would never stop). False skips the checks (TRL's "
        "own errors remain). Batches whose labels are all masked are found during training (on_nonfinite_loss).",
    ),
    Switch(
        "on_nonfinite_loss", "stop", values=("stop", "skip", "off"),
        summary="A NaN/inf loss stops the run, its step not applied, naming the rows (`\"skip\"`: skip the step; `\"off\"`).",
        help="What a NaN/inf training loss does, flagged at the micro-batch it appears in, with the batch's dataset "
        "rows in the message. 'stop': raise NonFiniteLossError; the optimizer update of that step is not applied, so "
        "the weights and checkpoints stay those of the last good step. 'skip': warn and skip that optimizer step (no "
        "weight or optimizer-state update). On one process without fp16's gradient scaler the flags stay on the GPU "
        "(a fused torch optimizer skips a bad step by itself, as under GradScaler; another optimizer reads the flags "
        "once before its step) and are read after the step, before any log, save or evaluation, so the check adds "
        "no host wait inside the step; the error then comes up to one micro-batch later. Otherwise (several "
        "processes, fp16) they are read after each micro-batch's backward. 'off': TRL's behaviour (no check). The "
        "same flags warn about a batch whose labels are all masked (not with 'off').",
    ),
    Switch(
        "atomic_saves", True,
        summary="Checkpoints and the final model are staged and renamed into place: a kill mid-save breaks none.",
        help="Write checkpoints and save_model() output (the final adapter) to a hidden staging folder beside the "
        "target and rename it into place when complete, so a kill mid-save never leaves a broken latest checkpoint; "
        "resume_from_checkpoint=True then picks the newest complete one. Off for multi-process runs and push_to_hub "
        "(transformers' own saving).",
    ),
)

BY_NAME: dict[str, Switch] = {row.name: row for row in SWITCHES}


def switch_values() -> dict[str, tuple[Any, ...]]:
    """name -> the values it accepts, for the switches whose values are a fixed set (``settings.SWITCH_VALUES``)."""
    return {row.name: row.values for row in SWITCHES if row.values is not None}


def config_field(name: str) -> Any:
    """The ``dataclasses.field`` of switch ``name`` in ``FastSFTConfig``: its row's default and help."""
    row = BY_NAME[name]
    return dataclasses.field(default=row.default, metadata={"help": row.help})


def switch(args: Any, name: str) -> Any:
    """Switch ``name`` of a run's arguments: a ``FastSFTConfig``'s value, or the row's default when the run was given a
    plain ``SFTConfig`` (which has no such field)."""
    return getattr(args, name, BY_NAME[name].default)
