"""``FastSFT``: TRL's ``SFTTrainer`` with nbkit's speedups attached for the duration of training.

Contract: same constructor, datasets and behaviour as ``SFTTrainer``. The switches in ``FastSFTConfig`` change speed
and memory only. Each speedup is an object this trainer owns, attached to the model when ``train()`` (or
``evaluate()``) starts and detached when it ends, so the model a user gets back is a plain transformers/PEFT model.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from .config import FastSFTConfig
from .packing import PackedAttention, PackedCollator
from .speedup import Speedup

logger = logging.getLogger(__name__)

_SWITCH_DEFAULTS = {
    name: f.default for name, f in FastSFTConfig.__dataclass_fields__.items() if name not in SFTConfig.__dataclass_fields__
}


def _switch(args: Any, name: str) -> Any:
    """A switch from FastSFTConfig, or its default when the user passed a plain SFTConfig."""
    return getattr(args, name, _SWITCH_DEFAULTS[name])


class _AttachAtTrainBegin(TrainerCallback):
    """Attaches the speedups that need the model as training starts it (after gradient checkpointing is enabled)."""

    def __init__(self, trainer: "FastSFT") -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - TrainerCallback's signature
        self.trainer._attach_training_speedups()


class FastSFT(SFTTrainer):
    """A drop-in ``SFTTrainer`` (same arguments) that trains faster with the same losses.

    Speedups (each a switch in ``FastSFTConfig``): cached packed-sequence metadata with varlen attention
    (``cached_packing``), offloaded double-buffered checkpointing (``offload_checkpointing``), fast MoE routing
    (``fast_moe_routing``), and a live notebook dashboard (``live_dashboard``).
    """

    def __init__(self, model: Any = None, args: SFTConfig | None = None, data_collator: Any = None, *pargs: Any,
                 **kwargs: Any) -> None:
        self._nbkit_user_collator = data_collator is not None
        self._speedups: list[Speedup] = []
        self._training_speedups: list[Speedup] = []
        self._nbkit_active = False
        self.nbkit_attached: list[str] = []  # what the last train()/evaluate() ran with, kept after detach
        super().__init__(model, args, data_collator, *pargs, **kwargs)
        if _switch(self.args, "cached_packing"):
            self._install_packed_collator()
        self.add_callback(_AttachAtTrainBegin(self))
        self._maybe_add_dashboard()

    # -- setup ---------------------------------------------------------------------------------------------------------
    def _install_packed_collator(self) -> None:
        """Make every batch padding-free with host-built boundaries (TRL's own collator underneath)."""
        collator = self.data_collator
        if self._nbkit_user_collator or not isinstance(collator, DataCollatorForLanguageModeling):
            if self._nbkit_user_collator:
                logger.warning("nbkit: a custom data_collator was given; cached packing is off (plain path)")
            self._nbkit_packing_enabled = False
            return
        if not collator.padding_free:
            # Packing off: TRL already truncated rows to max_length; flattening them changes no numbers.
            collator = DataCollatorForLanguageModeling(
                pad_token_id=collator.pad_token_id,
                padding_free=True,
                pad_to_multiple_of=collator.pad_to_multiple_of,
                return_tensors=collator.return_tensors,
            )
        self.data_collator = PackedCollator(collator)
        self._nbkit_packing_enabled = True

    def _maybe_add_dashboard(self) -> None:
        mode = _switch(self.args, "live_dashboard")
        if mode is False:
            return
        try:
            from .dashboard import LiveDashboard, in_notebook
        except ImportError:  # the dashboard module is optional at this layer
            return
        if mode == "auto" and not in_notebook():
            return
        LiveDashboard().attach(self)

    def _packing_speedup(self) -> Speedup | None:
        if not getattr(self, "_nbkit_packing_enabled", False):
            return None
        return PackedAttention(kernel=_switch(self.args, "attention_kernel"))

    def _moe_speedup(self) -> Speedup | None:
        if not _switch(self.args, "fast_moe_routing"):
            return None
        try:
            from .moe import FastMoERouting
        except ImportError:
            return None
        return FastMoERouting()

    def _offload_speedup(self) -> Speedup | None:
        mode = _switch(self.args, "offload_checkpointing")
        if mode is False or not self.args.gradient_checkpointing:
            return None
        try:
            from .offload import OffloadedCheckpointing
        except ImportError:
            return None
        return OffloadedCheckpointing(
            mode=mode,
            double_buffer=_switch(self.args, "offload_double_buffer"),
            min_bytes=_switch(self.args, "offload_min_bytes"),
        )

    # -- attach / detach -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def nbkit_speedups(self) -> Iterator[list[Speedup]]:
        """Attach the model-level speedups (packed attention, MoE routing) for the duration of the block."""
        if self._nbkit_active:  # nested (evaluate() inside train()): already attached
            yield self._speedups
            return
        attached: list[Speedup] = []
        self._nbkit_active = True
        try:
            for speedup in (self._packing_speedup(), self._moe_speedup()):
                if speedup is not None and speedup.attach(self.model):
                    attached.append(speedup)
            self._speedups = attached
            self.nbkit_attached = self.active_speedups
            yield attached
        finally:
            for speedup in reversed(attached + self._training_speedups):
                speedup.detach()
            self._speedups, self._training_speedups = [], []
            self._nbkit_active = False

    def _attach_training_speedups(self) -> None:
        speedup = self._offload_speedup()
        if speedup is not None and speedup.attach(self.model):
            self._training_speedups.append(speedup)
            self.nbkit_attached = self.active_speedups

    @property
    def active_speedups(self) -> list[str]:
        """Names of the speedups attached right now (for logs and tests)."""
        return [f"{s.name}({s.kernel})" if getattr(s, "kernel", None) else s.name
                for s in self._speedups + self._training_speedups]

    def train(self, *args: Any, **kwargs: Any):
        with self.nbkit_speedups():
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        with self.nbkit_speedups():
            return super().evaluate(*args, **kwargs)
