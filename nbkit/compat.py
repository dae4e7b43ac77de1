"""What differs between the versions nbkit supports, in one place: transformers 5.15 (Colab's) to the newest 5.x,
and ipywidgets 7.7 (Colab's 7.7.1) to 8.

transformers 5.2x renamed gradient checkpointing to activation checkpointing and deprecated the old names (a
FutureWarning on every call). nbkit's own calls use the new name where it exists and the old one elsewhere; where a
dependency still reads an old name on nbkit's behalf, ``quiet_peft_wrap`` keeps that one warning out of sight.
ipywidgets 7 shows a widget through ``_ipython_display_``, 8 through ``_repr_mimebundle_``: ``widget_mimebundle``
gives the bundle on both.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any, Iterator, Optional

import torch

# transformers' warning when ``model.is_gradient_checkpointing`` (renamed ``is_activation_checkpointing``) is read
PEFT_CHECKPOINTING_PROBE = r"`is_gradient_checkpointing` is deprecated"


def _fused_pattern_warning(attribute: str, fused: str) -> str:
    """The message (a regex matching exactly it) of PEFT's warning that the ``attribute`` (rank_pattern,
    alpha_pattern) key its own MoE conversion writes for the fused expert weight ``fused`` matched no module."""
    key = rf".*\.{re.escape(fused)}"  # as peft.utils.transformers_weight_conversion writes it
    text = f"The following {attribute} keys did not match any targeted module and were ignored: {[key]}."
    return re.escape(text) + r"\Z"


# PEFT maps LoRA on transformers 4's separate expert projections onto transformers 5's fused expert weights
# (Mixtral's w1/w3, Qwen-MoE's gate/up -> gate_up_proj: a parameter target, with rank and alpha doubled by a
# pattern). PEFT 0.21 then warns that the pattern matched no *module*: it applies to the parameter all the same.
# PEFT 0.22 matches pattern keys against parameters too and no longer warns.
PEFT_FUSED_EXPERT_PATTERNS = [_fused_pattern_warning(attribute, "gate_up_proj")
                              for attribute in ("rank_pattern", "alpha_pattern")]


def enable_activation_checkpointing(model: torch.nn.Module, kwargs: Optional[dict[str, Any]] = None) -> None:
    """``activation_checkpointing_enable`` (newer transformers) or ``gradient_checkpointing_enable`` (older)."""
    kwargs = {"use_reentrant": False} if kwargs is None else kwargs
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_args(enabled: bool, kwargs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``TrainingArguments`` keywords that switch checkpointing, under the name this transformers uses."""
    from transformers import TrainingArguments

    new = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    prefix = "activation_checkpointing" if new else "gradient_checkpointing"
    out: dict[str, Any] = {prefix: enabled}
    if kwargs is not None:
        out[f"{prefix}_kwargs"] = kwargs
    return out


@contextlib.contextmanager
def quiet_peft_wrap() -> Iterator[None]:
    """A block in which PEFT wraps a model (``get_peft_model``, ``PeftModel.from_pretrained``) without two warnings
    about PEFT's own workings, which the caller can neither act on nor change.

    - transformers' FutureWarning about ``is_gradient_checkpointing``: PEFT 0.21 reads it of every model it wraps, a
      property transformers 5.2x deprecated for ``is_activation_checkpointing`` (PEFT 0.22 reads the new name).
    - PEFT's RuntimeWarning that the rank_pattern / alpha_pattern key its MoE conversion writes for a fused expert
      weight (``PEFT_FUSED_EXPERT_PATTERNS``) matched no targeted module: PEFT 0.21 matches the key against modules
      only, while it applies to the fused weight, a parameter target (that weight's LoRA gets the doubled rank).

    On PEFT 0.22 neither warning is raised, and the block changes nothing.

    Contract: only those messages (a user's own unmatched pattern key still warns), only inside the block (the
    filters are restored on exit, so the same warnings anywhere else still show); every other warning passes.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_CHECKPOINTING_PROBE, category=FutureWarning)
        for message in PEFT_FUSED_EXPERT_PATTERNS:
            warnings.filterwarnings("ignore", message=message, category=RuntimeWarning)
        yield


# the mime type of a widget's view in a notebook output (the same in ipywidgets 7 and 8)
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"


def widget_mimebundle(widget: Any) -> Any:
    """The mime bundle that shows ``widget`` in a notebook output, as ipywidgets 8's ``_repr_mimebundle_`` gives it.

    Why: ipywidgets 7 (Colab ships 7.7.1) has no ``_repr_mimebundle_``: a widget there shows itself through
    ``_ipython_display_``, which publishes its own output at once, so nothing can add other renderings (HTML, plain
    text) to that output for frontends without a widget manager.
    Contract: on ipywidgets 8, the widget's own bundle, unchanged (a dict, or a ``(data, metadata)`` tuple); on 7,
    the bundle its ``_ipython_display_`` would publish (``text/plain`` and ``WIDGET_VIEW_MIME``: its view spec), and
    its on-displayed callbacks run as that display runs them. A closed widget (7 or 8) gives ``text/plain`` alone.
    """
    own = getattr(widget, "_repr_mimebundle_", None)
    if own is not None:
        return own()
    data = {"text/plain": repr(widget)}
    if getattr(widget, "_ipython_display_", None) is None or getattr(widget, "_view_name", None) is None:
        return data  # closed (both versions unset their display method on close), or a widget without a view
    data[WIDGET_VIEW_MIME] = widget.get_view_spec()
    widget._handle_displayed()
    return data
