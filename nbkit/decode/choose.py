"""The one chooser: which path decodes a call (the dense copy, then the graphed step, then ``generate``), and where
the decoders a model has made are kept.

Why kept here and not on the model: a decoder holds GPU memory (a dense copy of the weights, key/value buffers,
captured graphs) and must outlive one call (a second ``chat`` reuses it) but not the model, and it must not change
the user's object (its ``__dict__``, what ``copy`` or ``pickle`` of the model carry). So ``decoders_of(model)`` keeps
them in a ``weakref.WeakKeyDictionary`` keyed by the transformers model under any PEFT or accelerate wrapper
(``unwrap_model``: a wrapper and its base share them); they go when the model goes, and ``release_decoders(model)``
frees their memory at once (``FastSFT.train`` calls it before training).

Contract of ``choose(model, total_len, batch, settings, ...)``: ``(path, reason)`` with ``path`` one of
``"dense"``, ``"graphed"``, ``"generate"``; the decoder of that path is prepared (copy made, step captured) when a
fast path is returned. ``reason``: why the path before it was not taken (None for the dense path). A fast path not
taken is logged once per model: the dense path at INFO (the graphed one still applies), the fall to ``generate``
as a WARNING.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch

from ..model_parts import unwrap_model
from .config import GenerationSettings
from .dense import DenseDecoder, signature_of
from .graphed import GraphedDecoder
from .plain import PlainDecoder
from .shared import Unsupported

logger = logging.getLogger(__name__)

PATHS = ("dense", "graphed", "generate")


@dataclass
class Decoders:
    """The decoders of one model, one per path."""

    dense: DenseDecoder = field(default_factory=DenseDecoder)
    graphed: GraphedDecoder = field(default_factory=GraphedDecoder)
    plain: PlainDecoder = field(default_factory=PlainDecoder)

    def release(self) -> None:
        """Free what the fast paths hold (the dense copy, buffers, captured steps); made again on the next call."""
        self.dense.release()
        self.graphed.release()


_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, Decoders] = weakref.WeakKeyDictionary()


def decoders_of(model: torch.nn.Module) -> Decoders:
    """The decoders kept for ``model`` (made on first use; see the module docstring)."""
    key = unwrap_model(model)
    kept = _KEPT.get(key)
    if kept is None:
        kept = _KEPT[key] = Decoders()
    return kept


def kept_decoders(model: torch.nn.Module) -> Decoders | None:
    """The decoders kept for ``model``, or None where none were made."""
    return _KEPT.get(unwrap_model(model))


def release_decoders(model: torch.nn.Module) -> None:
    """Free the memory ``chat`` and ``generate_answers`` keep for ``model`` for fast decoding (the dense copy, the
    captured steps and their buffers)."""
    kept = kept_decoders(model)
    if kept is not None:
        kept.release()


def dense_reason(model: torch.nn.Module, total_len: int, batch: int, signature: tuple | None = None,
                 settings: GenerationSettings | None = None) -> str | None:
    """None when the dense path applies to ``model`` here (its copy made and its step captured), else why (logged
    once per model). ``signature``: the model's ``signature_of``, taken once a call by the caller."""
    decoder = decoders_of(model).dense
    reason = decoder.check(model, total_len, batch, signature)
    if reason is None:
        try:
            decoder.prepare(model, batch, total_len, signature, settings)
        except Unsupported as error:
            reason = str(error)
    if reason is not None and not decoder.reported:
        logger.info("nbkit: fast decoding without a dense copy: %s", reason)
        decoder.reported = True
    return reason


def graphed_reason(model: torch.nn.Module, total_len: int) -> str | None:
    """None when the graphed path applies (its step captured), else why."""
    decoder = decoders_of(model).graphed
    reason = decoder.check(model, total_len)
    if reason is None:
        try:
            decoder.prepare(model, total_len)
        except Unsupported as error:
            reason = str(error)
    return reason


def choose(model: torch.nn.Module, total_len: int, batch: int = 1, settings: GenerationSettings | None = None,
           fast: bool = True, exact: bool = False, signature: tuple | None = None,
           graphed: bool = True) -> tuple[str, str | None]:
    """The path for ``batch`` rows of up to ``total_len`` positions (see the module docstring). ``exact`` skips the
    dense path (its tokens may differ from ``generate``'s at near-ties); ``fast=False`` is ``generate``. The
    graphed path decodes one row at a time: a batch, or a caller that passes ``graphed=False``, goes dense or to
    ``generate`` (without a warning: the dense path's reason was logged)."""
    if not fast:
        return "generate", "fast=False"
    reason = None
    if not exact:
        reason = dense_reason(model, total_len, batch, signature or signature_of(model), settings)
        if reason is None:
            return "dense", None
    if batch > 1 or not graphed:
        return "generate", reason
    why = graphed_reason(model, total_len)
    if why is None:
        return "graphed", reason
    decoder = decoders_of(model).graphed
    if not decoder.reported:
        logger.warning("nbkit chat: decoding with model.generate: %s", why)
        decoder.reported = True
    return "generate", why  # why generate (the graphed path's reason says why not dense too)
