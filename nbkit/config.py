"""``FastSFTConfig``: TRL's ``SFTConfig`` plus one switch per nbkit speedup.

Every switch only changes speed or memory, never the numbers: a switch turned off gives plain TRL's code path. The
values each switch accepts and the hardware defaults are rules of ``nbkit.settings``, applied here when the config
is built:

- ``bf16`` / ``fp16`` left unset: bf16 where the hardware runs it natively, fp16 on GPUs without fast bf16 (a T4),
  fp32 on a CPU, said in one log line (TRL's own default, bf16, fails on a CPU). A value the user gives stands.
- ``dataloader_pin_memory`` left unset: on only with an accelerator to copy batches to.

Before any of that, and before TRL's and transformers' own ``__post_init__`` (which compare the values and fail
with a ``TypeError`` on a string, or let it through to the optimizer): every field typed int or float, whichever
class declares it, must hold a number of its type (``settings.numeric_fields``, ``settings.as_number``). A numeric
string (PyYAML reads ``2e-4`` as one) is converted, as TRL's own YAML path converts it, and said in one warning;
anything else is a ``SettingError`` naming the field, the value and what to pass. ``max_length`` then follows the
one length rule (``settings.length_problem``): a positive int, or None.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from trl import SFTConfig

from . import settings

logger = logging.getLogger(__name__)

AutoBool = Literal[True, False, "auto"]  # a Literal, so transformers' HfArgumentParser (TrlParser) can parse it


@dataclass
class FastSFTConfig(SFTConfig):
    """``SFTConfig`` with nbkit's switches. TRL's fields keep their meaning; three defaults follow the hardware."""

    # -- TRL/transformers fields whose default nbkit chooses from the hardware (None: not set by the user)
    bf16: Optional[bool] = field(
        default=None,
        metadata={"help": "bf16 mixed precision. Unset: on where the hardware runs bf16 natively (and fp16 unset)."},
    )
    fp16: Optional[bool] = field(
        default=None,
        metadata={"help": "fp16 mixed precision. Unset: on for GPUs without fast bf16 (a T4), off elsewhere."},
    )
    dataloader_pin_memory: Optional[bool] = field(
        default=None,
        metadata={"help": "Pin batches in host memory. Unset: on when there is an accelerator to copy them to."},
    )

    cached_packing: bool = field(
        default=True,
        metadata={
            "help": "Build each batch's document boundaries (cu_seqlens, max_seqlen, position ids) once on the host "
            "at collate time and run attention through nbkit's varlen kernels: no dense T x T mask, no per-layer "
            "rebuild, no GPU-to-CPU sync in the forward. Without packing, batches go padding-free as well."
        },
    )
    attention_kernel: str = field(
        default="auto",
        metadata={
            "help": "Kernel for the 'nbkit' attention: 'auto' (best present), 'flash_attn', 'varlen' (torch's "
            "varlen flash kernel), 'flex' (flex attention, block mask built once per step), 'sdpa' (exact SDPA: "
            "'sdpa_masked' for rows of many short documents while the T x T mask is small, else 'sdpa_loop'; the "
            "path for CPUs, older GPUs and soft-capping), 'sdpa_loop' (one SDPA call per document, never a T x T "
            "mask), 'sdpa_masked' (one call per layer with a T x T block-diagonal mask built once per step)."
        },
    )
    offload_checkpointing: AutoBool = field(
        default="auto",
        metadata={
            "help": "Keep checkpointed layer inputs in pinned CPU memory, copied on a side stream. 'auto': on where "
            "it pays (CUDA with gradient checkpointing and large activations), off on CPU and in eval."
        },
    )
    offload_double_buffer: bool = field(
        default=True,
        metadata={"help": "Prefetch the next layer's input into a second GPU buffer while the current recomputes."},
    )
    offload_min_bytes: int = field(
        default=16 * 2**20,
        metadata={"help": "'auto' offloads only when one layer's checkpointed input is at least this large "
                  "(16 MiB: 4K tokens of a 2048-wide model; its copy is ~0.3 ms and hides behind the layer)."},
    )
    offload_max_host_bytes: Optional[int] = field(
        default=None,
        metadata={"help": "At most this many bytes of host RAM for offloaded layer inputs; the rest stay on the GPU "
                  "(free Colab has ~12 GB of RAM for everything). None: what the host has, less 4 GiB."},
    )
    selective_checkpointing: AutoBool = field(
        default="auto",
        metadata={
            "help": "With gradient checkpointing, leave the last decoder layers whose activations fit in free GPU "
            "memory un-checkpointed (no recompute in backward for them), the rest checkpointed (and offloaded, when "
            "offload_checkpointing is on). Decided after the first step, from what one layer saves per token "
            "(measured in that step's recompute), the peak memory so far and per_device_train_batch_size x "
            "max_length (or x the dataset's longest tokenized example). 'auto': on CUDA; True: also on CPU (every "
            "layer un-checkpointed there). "
            "Same losses and gradients; more GPU memory in use (up to what was free)."
        },
    )
    cuda_graphs: AutoBool = field(
        default="auto",
        metadata={
            "help": "Replay each decoder layer that is not checkpointed (selective_checkpointing's, or every layer "
            "without gradient checkpointing) as one CUDA graph in the forward and one in the backward, so a short "
            "row's step is not bound by Python's kernel launches. Micro-batches are padded up to buckets of 256 to "
            "8192 tokens (one padding document, zero gradient), one set of graphs per bucket, captured at its first "
            "use. 'auto' and True: on CUDA with cached_packing's varlen kernels, for dense (not MoE) models "
            "without dropout; anything else runs eagerly. Same losses and gradients up to rounding."
        },
    )
    fast_moe_routing: bool = field(
        default=True,
        metadata={
            "help": "Run MoE experts through nbkit's routing: one sort by expert, contiguous slices or one grouped "
            "matmul, LoRA on experts as low-rank products."
        },
    )
    fused_lora: bool = field(
        default=True,
        metadata={
            "help": "Run PEFT LoRA Linear layers (dense or 4-bit base) as one fused autograd function: the LoRA "
            "product is accumulated into the base output by the GEMM, no clone/cast/scale/add passes. Layers with "
            "DoRA, dropout > 0 or a LoRA bias keep PEFT's forward."
        },
    )
    fused_kernels: AutoBool = field(
        default="auto",
        metadata={
            "help": "Liger-Kernel's fused RMSNorm, SwiGLU/GeGLU and RoPE on known families (Llama, Mistral, Qwen2/3, "
            "Qwen3-MoE, Mixtral, Gemma 1-3). 'auto': on when liger-kernel is installed and the model is on CUDA."
        },
    )
    tiled_mlp: AutoBool = field(
        default="auto",
        metadata={
            "help": "Run each decoder layer's dense MLP over tiles of the sequence, recomputed per tile in backward, "
            "so its (tokens x intermediate) activations exist for one tile at a time: for rows too long to fit "
            "otherwise. 'auto': only calls whose untiled MLP would take the GPU past 90% of its memory are tiled; "
            "True: every call longer than a tile. A tiled call costs one more MLP forward; MoE blocks are not tiled."
        },
    )
    tiled_mlp_tokens: Optional[int] = field(
        default=None,
        metadata={"help": "Tokens per tile of tiled_mlp. None: the model's hidden size (one tile's activation is then "
                  "the size of one MLP weight)."},
    )
    sync_free_metrics: bool = field(
        default=False,
        metadata={
            "help": "Keep TRL's per-step metrics (entropy, token accuracy, token count, MoE aux loss) on the GPU and "
            "read them when logging, instead of reading them on the host right after every forward, which stalls "
            "the queue before the backward. Same loss and logged values; TRL's own compute_loss where it does "
            "something else (compute_loss_func, label smoothing, sequence parallelism, several processes). Off until its "
            "effect on step time is measured."
        },
    )
    live_dashboard: AutoBool = field(
        default="auto",
        metadata={"help": "Attach nbkit.LiveDashboard: 'auto' inside a notebook, True always, False never."},
    )

    # -- reliability (nbkit.reliability): these change what happens when something goes wrong, never the numbers of
    # a run that goes right.
    validate_inputs: bool = field(
        default=True,
        metadata={
            "help": "Check datasets and settings before training (empty dataset, missing or non-string fields, chats "
            "without an assistant turn, ShareGPT chats TRL would not convert, rows with nothing to learn, no chat "
            "template, max_length below every document, incompatible switches) and fail with an error naming the "
            "row or the setting. False skips the checks (TRL's own errors remain)."
        },
    )
    on_nonfinite_loss: str = field(
        default="stop",
        metadata={
            "help": "What a NaN/inf training loss does, detected at the micro-batch it appears in, with the batch's "
            "dataset rows in the message. 'stop': raise NonFiniteLossError after its backward and before the "
            "optimizer step (the check reads the loss where transformers does, so it adds no host sync), so the "
            "weights and checkpoints stay those of the last good step. 'skip': warn and skip that optimizer step "
            "(no weight or optimizer-state update; under fp16 the GradScaler skips it). 'off': TRL's behaviour (no "
            "check). The same read warns about a batch whose labels are all masked (not with 'off')."
        },
    )
    atomic_saves: bool = field(
        default=True,
        metadata={
            "help": "Write checkpoints and save_model() output to a hidden staging folder beside the target and "
            "rename it into place when complete, so a kill mid-save never leaves a broken latest checkpoint; "
            "resume_from_checkpoint=True then picks the newest complete one. Off for multi-process runs and "
            "push_to_hub (transformers' own saving)."
        },
    )

    def __post_init__(self) -> None:
        read_numbers(self)
        settings.check_length("max_length", self.max_length)
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing is not None:
            # transformers 5.2x renamed the field; TRL still sets the old one: hand it over without the FutureWarning
            self.activation_checkpointing = self.gradient_checkpointing
            if self.gradient_checkpointing_kwargs is not None and getattr(self, "activation_checkpointing_kwargs", 1) is None:
                self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        for name in settings.SWITCH_VALUES:
            settings.check_value(name, getattr(self, name))
        self.bf16, self.fp16, chosen = settings.mixed_precision(self.bf16, self.fp16, use_cpu=bool(self.use_cpu))
        if chosen:
            logger.warning(chosen)
        self.dataloader_pin_memory = settings.pin_memory(self.dataloader_pin_memory, use_cpu=bool(self.use_cpu))
        super().__post_init__()


def read_numbers(config: Any) -> None:
    """Every int or float field of the dataclass ``config`` (a ``FastSFTConfig``, or the plain ``SFTConfig`` or
    ``TrainingArguments`` a user hands ``FastSFT``) as a number of its type, in place; the conversions said in one
    warning, anything else a ``SettingError`` (see the module docstring)."""
    fields = type(config).__dataclass_fields__
    converted = []
    for name, (kind, optional) in settings.numeric_fields(type(config)).items():
        value = getattr(config, name)
        number, changed = settings.as_number(name, value, kind, optional, default=fields[name].default)
        if changed:
            setattr(config, name, number)
            converted.append(f"{name}={value!r} (a {type(value).__name__}) read as {number!r}")
    if converted:
        logger.warning(
            "nbkit: %s. Pass numbers, not strings: in YAML, unquoted, a float with a dot (2.0e-4; PyYAML reads 2e-4 "
            "as a string)", "; ".join(converted),
        )


_SWITCH_DEFAULTS = {
    name: f.default for name, f in FastSFTConfig.__dataclass_fields__.items()
    if name not in SFTConfig.__dataclass_fields__
}


def switch(args: Any, name: str) -> Any:
    """A switch of ``FastSFTConfig``, or its default when the run was given a plain ``SFTConfig``."""
    return getattr(args, name, _SWITCH_DEFAULTS[name])
