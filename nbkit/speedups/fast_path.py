"""Which of nbkit's speedups a run can take, decided once, from the model, the adapter and the settings, before
anything changes.

Why: a speedup that finds out late that it cannot apply leaves the run half changed (the packed collator already
swapped in when packed attention refuses the family at attach; padding-free batches reaching a short convolution
that cannot keep documents apart). Deciding everything up front, from what ``SFTTrainer.__init__`` built (the
model as it will train, PEFT wrapper included, and TRL's collator), means a run either takes a speedup whole or
keeps TRL's own path for it, and says why in one line.

Contract: ``decide(model, args, collator, user_collator=..., compute_metrics=...)`` returns a ``FastPath``:

- ``plain``: the model or adapter is one nbkit's speedups were not built for; no speedup is attached, the collator
  and batches are TRL's, so the run is ``SFTTrainer``'s. Known cases: decoder layers that mix the sequence with
  something other than softmax attention (short convolutions, Mamba/SSM mixers, linear attention: LFM2, Nemotron-H,
  Mamba, Jamba, Bamba, Zamba, GraniteMoeHybrid, Qwen3-Next, ...; read from the config's layer types and mixer
  settings and from the modules themselves, not a list of names), and PEFT prompt learning (prompt tuning,
  P-tuning, prefix tuning: virtual tokens or key/values the packed boundaries do not hold).
- ``no_checkpointing``: why gradient checkpointing must stay off for the run to train at all, or None. Prefix tuning
  hands every layer the prefix's key/values as a cache, which transformers' checkpointed layers drop (their recompute
  would append to it twice) while the mask still counts it: with checkpointing on, ``SFTTrainer`` fails at its first
  step; without, it trains. FastSFT trains it without checkpointing, as ``SFTTrainer`` does with it off.
- ``packed``: nbkit's packed collator and packed attention (``cached_packing``) apply together, or neither: off
  with the switch, with a user's collator or one other than TRL's language-modeling collator (vision-language
  processors), for a model without transformers' ``AttentionInterface`` dispatch, for a family whose packed
  attention is not validated (``packed_attention.SUPPORTED_FAMILIES``).
- ``packed_eval``: the packed collator also builds evaluation batches, unless ``compute_metrics`` or
  ``preprocess_logits_for_metrics`` read the logits (whose shape would then be the flattened batch's, not TRL's).
- ``off``: speedups turned off for this run although their switch is on, each with its reason (``fused_kernels``
  under TRL's own ``use_liger_kernel``: Liger's kernels are patched in already).
- ``reason``: the one line to log when anything fell back (None when every switched-on speedup applies), at
  ``level``: a warning where the whole run keeps TRL's path or the user's own collator turned packing off; an info
  line where a speedup quietly keeps TRL's path for the model (a family packed attention does not cover: the run
  is TRL's there, and a TRL user gets no warning for it).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..model_parts import unwrap_model
from ..switches import switch

# Layer kinds of softmax attention (and layers without a sequence mixer) as configs name them; any other kind
# ("conv", "linear_attention", "mamba", "recurrent", ...) mixes the sequence some other way.
ATTENTION_LAYER_KINDS = frozenset({
    "full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local", "moe", "mlp", "dense",
})
_LAYER_KIND_FIELDS = ("layer_types", "layers_block_type", "layer_block_types", "block_types")
# Config fields that only a convolution or state-space mixer has (conv_L_cache, mamba_d_conv, ssm_state_size, ...).
_MIXER_FIELD = re.compile(r"(^|_)(conv|ssm|mamba)(_|$)|conv_l_cache|d_conv|^mamba|hybrid_override_pattern")
_SSM_PARAMETERS = ("A_log", "dt_bias")  # Mamba/SSM state parameters


@dataclass(frozen=True)
class FastPath:
    """What this run takes (see the module docstring)."""

    plain: bool = False
    no_checkpointing: Optional[str] = None
    packed: bool = False
    packed_eval: bool = False
    off: dict[str, str] = field(default_factory=dict)
    reason: Optional[str] = None
    level: int = logging.INFO

    def allows(self, name: str) -> bool:
        """Whether the speedup ``name`` (a ``SPEEDUPS`` row) may be built for this run."""
        return not self.plain and name not in self.off


def sequence_mixer(model: Any) -> Optional[str]:
    """What mixes the sequence in ``model``'s layers besides softmax attention, in a few words; None when only
    attention does. Read from the text config (layer kinds, mixer fields) and from the modules (a 1-d convolution,
    SSM state parameters), so that a family not seen before is recognised by what it has."""
    base = unwrap_model(model)
    config = getattr(base, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for name in _LAYER_KIND_FIELDS:
            kinds = getattr(text, name, None)
            if isinstance(kinds, (list, tuple)):
                other = sorted({str(k) for k in kinds} - ATTENTION_LAYER_KINDS)
                if other:
                    return f"{'/'.join(other)} layers"
        pattern = getattr(text, "hybrid_override_pattern", None)
        if isinstance(pattern, str) and pattern.strip("*-"):
            return f"hybrid layer pattern {pattern!r}"
        try:
            fields = text.to_dict()
        except Exception:  # a config that cannot be serialised: the modules still tell
            fields = {}
        mixers = sorted(k for k in fields if _MIXER_FIELD.search(k.lower()))
        if mixers:
            return f"convolution/state-space mixers ({', '.join(mixers[:2])})"
    if isinstance(base, torch.nn.Module):
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Conv1d):
                return f"a 1-d convolution ({name})"
        for name, _ in base.named_parameters():
            if name.rsplit(".", 1)[-1] in _SSM_PARAMETERS:
                return f"state-space parameters ({name})"
    return None


def prompt_learning(model: Any) -> Optional[str]:
    """The PEFT prompt-learning method of ``model``'s active adapter (``"PROMPT_TUNING"``, ``"P_TUNING"``,
    ``"PREFIX_TUNING"``, ...), or None."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return None
    config = configs.get(getattr(model, "active_adapter", "default"))
    if config is None or not getattr(config, "is_prompt_learning", False):
        return None
    kind = getattr(config, "peft_type", None)
    return str(getattr(kind, "value", kind) or type(config).__name__)


def _packed_attention_problem(model: Any) -> Optional[str]:
    """Why nbkit's packed attention cannot run on ``model`` (None when it can); the rules ``PackedAttention.attach``
    applies, read before anything changes."""
    from .packed_attention import SUPPORTED_FAMILIES, PackedAttention

    base = unwrap_model(model)
    config = getattr(base, "config", None)
    if config is None or PackedAttention._find_decoder(base) is None \
            or not getattr(base, "_can_set_attn_implementation", lambda: False)():
        return f"{type(base).__name__} has no AttentionInterface dispatch"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = getattr(text, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        return f"packed attention is not validated for model family {family!r}"
    return None


def _checkpointing(args: Any) -> bool:
    return bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False))


def decide(model: Any, args: Any, collator: Any, *, user_collator: bool = False,
           compute_metrics: bool = False) -> FastPath:
    """The run's ``FastPath``, from the model TRL built (PEFT wrapper included), its settings and TRL's collator."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    mixer = sequence_mixer(model)
    prompt = prompt_learning(model)
    if mixer or prompt:
        why = (f"the model mixes the sequence with {mixer}" if mixer
               else f"the adapter is PEFT prompt learning ({prompt})")
        no_checkpointing = None
        if prompt == "PREFIX_TUNING" and _checkpointing(args):
            no_checkpointing = ("gradient checkpointing off: checkpointed layers drop the prefix's key/values (with it "
                                "on, SFTTrainer fails at the first step)")
        also = f"; {no_checkpointing}" if no_checkpointing else ""
        return FastPath(plain=True, no_checkpointing=no_checkpointing, level=logging.WARNING,
                        reason=f"nbkit: {why}, which nbkit's speedups were not built for; training exactly as "
                               f"SFTTrainer does (its collator, batches and loss){also}")
    off: dict[str, str] = {}
    if getattr(args, "use_liger_kernel", False) and switch(args, "fused_kernels") is not False:
        off["fused_kernels"] = "use_liger_kernel=True patches Liger's kernels in already"
    packed = bool(switch(args, "cached_packing"))
    if packed:
        problem = None
        if user_collator:
            problem = "a custom data_collator was given"
        elif not isinstance(collator, DataCollatorForLanguageModeling):
            problem = f"TRL's collator is a {type(collator).__name__}, not its language-modeling one"
        else:
            problem = _packed_attention_problem(model)
        if problem is not None:
            off["cached_packing"] = problem
            packed = False
    reason = None
    if off:
        said = "; ".join(f"{name} off ({why})" for name, why in off.items())
        reason = f"nbkit: {said}: TRL's own path for {'it' if len(off) == 1 else 'them'}"
    level = logging.WARNING if user_collator and "cached_packing" in off else logging.INFO
    return FastPath(packed=packed, packed_eval=packed and not compute_metrics, off=off, reason=reason, level=level)
