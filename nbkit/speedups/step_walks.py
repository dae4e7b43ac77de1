"""The optimizer step's gradient clip and ``zero_grad`` over the trainable parameters only, listed once per run, and
the per-micro-step ``model.train()`` over a flat list of the modules.

Why: after every optimizer step transformers' ``Trainer`` calls ``accelerator.clip_grad_norm_(model.parameters())``
(which builds the list of all parameters twice, to compare it with the model's) and ``model.zero_grad()`` (which
walks every module and parameter): thousands of tensors for a QLoRA model, almost all of them frozen, each step. And
every micro-step begins with ``model.train()``, which recurses through every module and sets its flag through
``Module.__setattr__``. On a short, host-bound row that walking is host time the GPU waits for.

``model.train()`` (mode True) during ``train()`` reads each module's ``training`` flag from a list made at its first
call and returns when all are on (every micro-step but the first after an evaluation): what ``Module.train(True)``
would leave, without its walk. Otherwise, and for ``train(False)`` / ``eval()``, the model's own ``train`` runs; a
model with a module whose class has a ``train`` other than torch's or transformers' (which only set flags when
nothing changes) keeps its own throughout.

Contract: the same gradient norm, the same clipped gradients and the same cleared gradients as transformers'. The
trainable parameters (``requires_grad`` at the first clip, after the first backward: every speedup attached by then)
are the only ones autograd gives a gradient,
and ``clip_grad_norm_`` / ``zero_grad`` skip parameters without one. Only where accelerate clips by a plain
``torch.nn.utils.clip_grad_norm_`` (one process, or DDP); FSDP, DeepSpeed, XLA, SageMaker and mixed-mesh setups keep
transformers' own path. Attached to the trainer (``stage="trainer"``) for a ``train()`` or ``evaluate()`` call:
``zero_grad`` and ``train`` are set on the trained model and ``_clip_grad_norm`` on the trainer (instance
attributes, through the ledger; the classes' own are the fallback) and removed by ``detach``; modules added to the
model during a run are not in the list (none is, by nbkit).

The clip reproduces transformers' ``Trainer._clip_grad_norm``: ``CLIP_MIRRORS`` holds its source fingerprints
(``trl_seam.fingerprint``) in the releases checked (5.15 to 5.25); on a transformers whose code differs the clip stays
transformers' own (``zero_grad`` and ``train``, which reproduce torch's, stay), said once per process, by name.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..say_once import SayOnce
from ..trl_seam import mirror_differs
from .ledger import PatchLedger

logger = logging.getLogger(__name__)

_PLAIN_CLIP = ("NO", "MULTI_GPU", "MULTI_CPU")
# transformers' Trainer._clip_grad_norm: 5.15-5.16 (no mixed-mesh branch), 5.17-5.25 (with it)
CLIP_MIRRORS = {"transformers.trainer:Trainer._clip_grad_norm": frozenset({"3ad5ed1909e0bd39", "d22c80c34bf1881b"})}
SAY_ONCE = SayOnce(logger, "nbkit: step_walks")


class CachedTrainableWalks:
    """Gradient clip and ``zero_grad`` over the trainable parameters, listed once per attach; ``model.train`` flat."""

    name = "step_walks"

    def __init__(self) -> None:
        self._ledger = PatchLedger(self.name)
        self.trainable: list[torch.nn.Parameter] | None = None

    def attach(self, trainer: Any) -> bool:
        self.detach()
        model = trainer.model
        if not isinstance(model, torch.nn.Module):
            return False
        if "zero_grad" not in vars(model):
            self._ledger.set(model, "zero_grad", self._zero_grad(model))
        flat = _flat_train(model) if "train" not in vars(model) else None
        if flat is not None:
            self._ledger.set(model, "train", flat)
        if mirror_differs(CLIP_MIRRORS):
            import transformers

            SAY_ONCE("clip", f"transformers {transformers.__version__}'s Trainer._clip_grad_norm differs from the "
                     "releases this reproduces; its own gradient clip is used")
            return True
        own_clip = trainer._clip_grad_norm

        def clip_grad_norm(model: torch.nn.Module) -> Any:
            accelerator = getattr(trainer, "accelerator", None)
            kind = getattr(getattr(accelerator, "distributed_type", None), "name", None)
            mixed = getattr(trainer, "_has_mixed_mesh_grads", None)
            if (kind not in _PLAIN_CLIP or getattr(trainer.args, "fp16", False) and _sagemaker_mp()
                    or (mixed is not None and mixed(model))):
                return own_clip(model)
            return accelerator.clip_grad_norm_(self._trainable_params(model), trainer.args.max_grad_norm)

        self._ledger.set(trainer, "_clip_grad_norm", clip_grad_norm)
        return True

    def detach(self) -> None:
        self._ledger.undo()
        self.trainable = None

    def _zero_grad(self, model: torch.nn.Module) -> Any:
        def zero_grad(set_to_none: bool = True) -> None:
            params = self.trainable
            if params is None:  # before the first clip: speedups attached at train begin may add parameters
                torch.nn.Module.zero_grad(model, set_to_none)
            elif set_to_none:
                for p in params:
                    p.grad = None
            else:
                for p in params:
                    if p.grad is not None:
                        p.grad.detach_().zero_()

        return zero_grad

    def _trainable_params(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        if self.trainable is None:
            self.trainable = [p for p in model.parameters() if p.requires_grad]
        return self.trainable


def _no_op_when_unchanged() -> tuple:
    """The ``train`` methods that do nothing but set flags when no module's mode changes: torch's, and
    transformers' (which re-applies hub kernels only when the mode changed)."""
    known: list = [torch.nn.Module.train]
    try:
        from transformers import PreTrainedModel

        known.append(PreTrainedModel.train)
    except ImportError:  # pragma: no cover - transformers is a requirement
        pass
    return tuple(known)


def _flat_train(model: torch.nn.Module) -> Any:
    """``model.train`` for the run (see the module docstring): in mode True, when every module is training already
    (a list of them made at the first call), nothing to do; otherwise the model's own ``train``. None when a module's
    class has another ``train``, which might do more than set flags."""
    known = _no_op_when_unchanged()
    if any(type(m).train not in known for m in model.modules()):
        return None
    modules: list[torch.nn.Module] = []
    own = type(model).train

    def train(mode: bool = True) -> torch.nn.Module:
        if mode is True:
            if not modules:
                modules.extend(model.modules())
            if all(m.training for m in modules):
                return model
        return own(model, mode)

    return train


def _sagemaker_mp() -> bool:
    try:
        from transformers.utils import is_sagemaker_mp_enabled
    except ImportError:  # pragma: no cover - transformers always has it today
        return False
    return bool(is_sagemaker_mp_enabled())
