"""The rules of nbkit's settings, in one place: the values each switch accepts, the combinations that cannot work
together, and the defaults chosen from the hardware when the user chose none.

Why one home: a rule written twice drifts. ``FastSFTConfig`` checks values and fills the hardware defaults when it
is built; ``nbkit.reliability.guards`` checks combinations before training (they need the dataset's format and the
collator, and ``validate_inputs=False`` turns them off); a speedup constructor checks its own argument with
``check_value``, so a speedup built by hand fails with the same words as the config.

Contract:

- ``value_problem(name, value)`` says why ``value`` is not one of ``SWITCH_VALUES[name]`` (None when it is);
  ``check_value`` raises ``SettingError`` (a ``ValueError``) with that message.
- ``combination_problem(args, custom_collator=..., data_format=...)`` names the first combination of settings that
  cannot work together (None when there is none). ``data_format`` is the ``DataFormat`` guards detected (``kind``,
  ``conversational``, ``label``); without it, the checks that need the data are skipped.
- ``mixed_precision(bf16, fp16, use_cpu)``: the user's choice stands; a choice left open (None) is filled from the
  hardware training will run on: bf16 where it is fast, fp16 on GPUs without fast bf16 (a T4), fp32 on a CPU. It
  returns the pair and, when nbkit chose, the one line to log.
- ``trainable_dtype(bf16, fp16, compute)``: the lowest precision trainable weights may hold: fp32 under fp16 mixed
  precision (the gradient scaler unscales fp32 gradients only), bf16 under bf16 mixed precision, else the model's
  own compute dtype (fp32 on a CPU): never lower than what the run computes in.
- ``pin_memory(value, use_cpu)``: the user's choice stands; left open, pinning is on only with an accelerator to
  copy to (pinned memory without one does nothing and torch warns about it every epoch).
- ``length_problem(name, value)``: the one rule for a length or size (``max_length``, ``max_seq_length``, the
  ``POSITIVE_INT`` switches): an int >= 1 (not a bool), or None where None is allowed.
- ``numeric_fields(cls)`` / ``as_number(name, value, kind, optional)``: every field of a config dataclass typed int
  or float (alone or with None), read from its types; the number a value given to one stands for, or
  ``SettingError``. Numeric strings are converted (see ``as_number`` for why), anything else is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from typing import Any, Optional

from .switches import AUTO_BOOL, POSITIVE_INT, switch_values

# name -> the values the switch accepts, for the switches whose values are a fixed set: read from their rows in
# nbkit.switches (POSITIVE_INT in a switch's values: any int >= 1, not a bool, is allowed too)
SWITCH_VALUES: dict[str, tuple[Any, ...]] = switch_values()
_BFD = ("bfd", "bfd_split", "bfd-requeue")  # TRL's packing strategies that pack padding-free


class SettingError(ValueError):
    """A switch given a value it does not accept; the message names the switch and the values it does."""


def length_problem(name: str, value: Any, *, optional: bool = True) -> Optional[str]:
    """Why ``value`` is not a length or size ``name`` can take (an int >= 1, not a bool; None when ``optional``),
    or None. The unit in the message is bytes for a name ending in ``_bytes``, else tokens."""
    if value is None and optional:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    unit = "bytes" if name.endswith("_bytes") else "tokens"
    return f"{name}={value!r}: use {'None or ' if optional else ''}a positive int (a number of {unit})"


def check_length(name: str, value: Any, *, optional: bool = True) -> None:
    """Raise ``SettingError`` when ``value`` is not a length ``name`` can take (``length_problem``)."""
    problem = length_problem(name, value, optional=optional)
    if problem is not None:
        raise SettingError(problem)


def value_problem(name: str, value: Any) -> Optional[str]:
    """Why ``value`` is not allowed for switch ``name``, or None."""
    allowed = SWITCH_VALUES[name]
    if POSITIVE_INT in allowed:
        return length_problem(name, value, optional=None in allowed)
    if any(value is a or (isinstance(a, str) and value == a) for a in allowed):
        return None
    if allowed == AUTO_BOOL:
        return f"{name}={value!r}: use True, False or 'auto'"
    return f"{name}={value!r}: choose one of {', '.join(repr(a) for a in allowed)}"


def check_value(name: str, value: Any) -> None:
    """Raise ``SettingError`` when ``value`` is not allowed for switch ``name``."""
    problem = value_problem(name, value)
    if problem is not None:
        raise SettingError(problem)


# --------------------------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------------------------
@functools.cache
def numeric_fields(cls: type) -> dict[str, tuple[type, bool]]:
    """name -> (int or float, whether None is allowed) for every field of dataclass ``cls`` typed int or float,
    alone or with None (``Optional[int]``, ``float | None``; ``int | float`` counts as float). Fields whose type
    allows anything else (``int | str``, lists) are not numbers to check."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a hint that cannot be resolved: read the ones that are types already
        hints = {f.name: f.type for f in dataclasses.fields(cls) if isinstance(f.type, type)}
    found = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        members = set(typing.get_args(hint)) or {hint}
        optional = type(None) in members
        members.discard(type(None))
        if members and members <= {int, float}:
            found[f.name] = (float if float in members else int, optional)
    return found


def _example(kind: type, default: Any) -> str:
    if isinstance(default, numbers.Real) and not isinstance(default, bool):
        return repr(kind(default))
    return "1" if kind is int else "0.1"


def as_number(name: str, value: Any, kind: type, optional: bool = False, default: Any = None) -> tuple[Any, bool]:
    """(the number ``value`` stands for as field ``name`` of type ``kind``, whether it was converted).

    Numbers of the field's type pass unchanged (an int where a float is expected too). A string that reads as a
    number of the field's type is converted, and so is a whole float for an int field (``2.0``, ``"1e3"``): that is
    what TRL users get from TRL's own YAML path (``TrlParser --config`` hands YAML values to argparse, which
    converts them with the field's type), and PyYAML reads ``2e-4`` as a string (YAML 1.1 needs a dot:
    ``2.0e-4``), so a config built from ``yaml.safe_load`` meant the number. The caller says what was converted.
    Refused with ``SettingError``, naming the field, the value, its type and what to pass: a bool, a string that is
    no number, a number with a fraction for an int field, None where None is not allowed, anything else.
    """
    if value is None and optional:
        return value, False
    if isinstance(value, bool):
        number: Any = None
    elif isinstance(value, numbers.Integral) or (kind is float and isinstance(value, numbers.Real)):
        return value, False
    elif isinstance(value, numbers.Real):
        number = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)  # exact for big ints, which float() would round
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = None
    else:
        number = None
    what = "an int" if kind is int else "a float"
    expected = f"{name}={_example(kind, default)} ({what}{', or None' if optional else ''})"
    article = "an" if type(value).__name__[0] in "aeiou" else "a"
    given = f"{name}={value!r}" + ("" if value is None else f" ({article} {type(value).__name__})")
    if number is None:
        raise SettingError(f"{given} is not a number: pass {expected}")
    if kind is float:
        return float(number), True
    if isinstance(number, float) and not (math.isfinite(number) and number.is_integer()):
        raise SettingError(f"{given} is not {what}: pass {expected}")
    return int(number), True


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def combination_problem(args: Any, *, custom_collator: bool = False, data_format: Any = None) -> Optional[str]:
    """The first combination of settings (and data format) that cannot work together, said with what to change."""
    if args is None:
        return None
    packing, strategy = _get(args, "packing", False), _get(args, "packing_strategy", "bfd")
    padding_free = _get(args, "padding_free", False) or (packing and strategy in _BFD)
    if custom_collator and padding_free:
        setting = f"packing=True (packing_strategy={strategy!r})" if packing else "padding_free=True"
        return (f"{setting} cannot be combined with a custom data_collator: packed, padding-free batches need TRL's "
                "collator to keep each document's boundaries (position ids, cu_seqlens), which yours cannot know. "
                "Drop data_collator, or set packing=False and padding_free=False")
    kind = getattr(data_format, "kind", None)
    if _get(args, "completion_only_loss") is True and kind in ("text", "messages"):
        better = "assistant_only_loss=True" if kind == "messages" else "a prompt-completion dataset"
        return (f"completion_only_loss=True but the dataset is {data_format.label}, which has no completion to "
                f"restrict the loss to: TRL would silently train on every token. Use {better}, or leave "
                "completion_only_loss unset")
    chat_needed = data_format is not None and not data_format.conversational and kind not in ("tokenized", "formatted")
    if _get(args, "assistant_only_loss", False) and chat_needed:
        return (f"assistant_only_loss=True needs conversational data ('messages'), but the dataset is "
                f"{data_format.label}. Use completion_only_loss for prompt-completion data")
    kernel = _get(args, "attention_kernel", "auto")
    if kernel != "auto" and _get(args, "cached_packing", True) is False:
        return (f"attention_kernel={kernel!r} has no effect with cached_packing=False (the kernel belongs to nbkit's "
                "packed attention): set cached_packing=True, or leave attention_kernel='auto'")
    if _get(args, "offload_checkpointing", "auto") is True and not _get(args, "gradient_checkpointing", False):
        return ("offload_checkpointing=True needs gradient_checkpointing=True (it offloads the inputs that "
                "checkpointing keeps): turn gradient checkpointing on, or offloading off")
    return None


# --------------------------------------------------------------------------------------------------------------------
# Defaults from the hardware
# --------------------------------------------------------------------------------------------------------------------
def pick_compute_dtype(device: Any = None) -> Any:
    """The compute dtype (a ``torch.dtype``) for ``device`` (a torch.device, "cuda:1", an int): bf16 on CUDA compute
    capability >= 8.0, fp16 on older CUDA GPUs, fp32 elsewhere (CPU, MPS, ...). ``device=None`` means the current CUDA
    device when CUDA is available, else the CPU. ``nbkit.load_model`` and the mixed-precision default both follow it.
    """
    import torch

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    major, _minor = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def hardware_precision(use_cpu: bool = False) -> tuple[str, str]:
    """("bf16" | "fp16" | "fp32", why) for the device training will run on.

    CUDA: by compute capability, as ``nbkit.load_model`` picks the compute dtype (bf16 on sm80+, fp16 below: a T4
    emulates bf16, slowly). Other accelerators: bf16 when transformers says it is supported. A CPU: fp32 (no fast
    half-precision matmuls there).
    """
    import torch

    if not use_cpu and torch.cuda.is_available():
        index = torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        if pick_compute_dtype(index) == torch.bfloat16:
            return "bf16", f"{name} runs bf16 natively"
        return "fp16", f"{name} has no fast bf16"
    if not use_cpu:
        from transformers.utils import is_torch_bf16_gpu_available

        accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        if accelerator is not None and accelerator.type != "cpu" and is_torch_bf16_gpu_available():
            return "bf16", f"the {accelerator.type} device supports bf16"
    return "fp32", "training runs on the CPU" if use_cpu else "no GPU: training runs on the CPU"


def mixed_precision(bf16: Optional[bool], fp16: Optional[bool], use_cpu: bool = False,
                    hardware: Optional[tuple[str, str]] = None) -> tuple[bool, bool, Optional[str]]:
    """(bf16, fp16, the line to log when nbkit chose); ``None`` means the user did not choose.

    ``hardware``: ``hardware_precision(use_cpu)``'s answer, read when needed if not given.
    """
    if bf16 is not None and fp16 is not None:
        return bool(bf16), bool(fp16), None
    if bf16 is not None:
        return bool(bf16), False, None
    if fp16:
        return False, True, None
    kind, why = hardware if hardware is not None else hardware_precision(use_cpu)
    if fp16 is False and kind == "fp16":
        kind = "fp32"  # fp16 refused by the user: bf16 is not fast here, so full precision
    chosen = {"bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision", "fp32": "fp32 (no mixed precision)"}
    unset = "bf16 and fp16 were" if fp16 is None else "bf16 was"
    line = f"nbkit: training in {chosen[kind]}: {why}; {unset} not set (pass bf16= or fp16= to choose)"
    return kind == "bf16", kind == "fp16", line


def trainable_dtype(bf16: bool, fp16: bool, compute: Any) -> Any:
    """The lowest precision (a ``torch.dtype``) trainable weights may hold in a run with these mixed-precision
    settings and a model computing in ``compute`` without them (see the module docstring)."""
    import torch

    if fp16:
        return torch.float32
    if bf16:
        return torch.bfloat16
    return compute


def pin_memory(value: Optional[bool], use_cpu: bool = False) -> bool:
    """``dataloader_pin_memory``: the user's value, else on only when batches are copied to an accelerator."""
    if value is not None:
        return bool(value)
    if use_cpu:
        return False
    import torch

    if hasattr(torch, "accelerator"):
        return torch.accelerator.is_available()
    return torch.cuda.is_available()
