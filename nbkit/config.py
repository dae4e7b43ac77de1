"""``FastSFTConfig``: TRL's ``SFTConfig`` plus one switch per nbkit speedup.

Each switch's default, help and accepted values are its row in ``nbkit.switches``; this module gives each its type.
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
from .switches import config_field

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

    # -- nbkit's switches: the default and the help of each come from its row in nbkit.switches (the one place a switch
    # is described); the types stay here, where transformers' HfArgumentParser (TrlParser) reads them.
    cached_packing: bool = config_field("cached_packing")
    attention_kernel: str = config_field("attention_kernel")
    offload_checkpointing: AutoBool = config_field("offload_checkpointing")
    offload_double_buffer: bool = config_field("offload_double_buffer")
    offload_min_bytes: int = config_field("offload_min_bytes")
    offload_max_host_bytes: Optional[int] = config_field("offload_max_host_bytes")
    selective_checkpointing: AutoBool = config_field("selective_checkpointing")
    cuda_graphs: AutoBool = config_field("cuda_graphs")
    cuda_graphs_checkpointed: bool = config_field("cuda_graphs_checkpointed")
    fast_moe_routing: bool = config_field("fast_moe_routing")
    fused_lora: bool = config_field("fused_lora")
    expandable_segments: AutoBool = config_field("expandable_segments")
    dequant_cache: AutoBool = config_field("dequant_cache")
    fused_kernels: AutoBool = config_field("fused_kernels")
    tiled_mlp: AutoBool = config_field("tiled_mlp")
    tiled_mlp_tokens: Optional[int] = config_field("tiled_mlp_tokens")
    sync_free_metrics: bool = config_field("sync_free_metrics")
    live_dashboard: AutoBool = config_field("live_dashboard")

    # -- reliability (nbkit.reliability): these change what happens when something goes wrong, never the numbers of
    # a run that goes right.
    validate_inputs: bool = config_field("validate_inputs")
    on_nonfinite_loss: str = config_field("on_nonfinite_loss")
    atomic_saves: bool = config_field("atomic_saves")

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


