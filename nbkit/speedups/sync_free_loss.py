"""TRL's training loss and step metrics without a host sync between forward and backward (``sync_free_metrics``).

Why: TRL's ``SFTTrainer.compute_loss`` reads numbers on the host in every micro-step, right after the forward:
``num_valid > 0`` and the ``.item()`` of the entropy and of the token accuracy (and of the MoE auxiliary loss, and
of the token count of a padded batch). Each read waits for the GPU to finish the forward before the host may queue
the backward, so a short, host-bound step costs host time plus GPU time instead of the larger of the two. The
values are only needed when the trainer logs.

What it does: on TRL's default loss (its fused LM head; ``loss_type`` "nll" or "dft"; no ``compute_loss_func``, no
label smoothing, no sequence parallelism; one process) the same forward, the same loss expression, and the same
metrics kept as device tensors in TRL's ``_metrics`` lists; ``log`` turns them into floats, all in one read, before
TRL averages them. The token count of a padding-free batch comes from its shape (a host number already), of a
padded batch from its attention mask (a device sum, read at the next log).

The LM head itself: TRL's fused head selects the labelled positions with a boolean mask (a read); with packed
batches the collator lists them on the host instead and ``labelled_head.LabelledHead`` stands in for TRL's patched
forward while attached, so the whole forward and backward queue without a read.

Contract: the loss, its gradients and every logged value equal TRL's (tests/test_sync_free_loss.py compares the log
histories of both; tests/gpu/test_sync_free_loss_gpu.py runs the step under ``torch.cuda.set_sync_debug_mode``).
Any other case takes TRL's own ``compute_loss``. So does a TRL whose code differs from the release this mirrors:
``MIRRORS`` holds the source fingerprints (``trl_seam.fingerprint``) of the TRL functions reproduced here, as TRL
1.16.0 has them; where the installed ones differ, ``attach`` attaches nothing and says so, by name, once per process
(the installed TRL does not change while it runs; every ``train()`` builds a new speedup object).

As a speedup it is attached to the trainer (``stage="trainer"``) for a ``train()`` or ``evaluate()`` call: its
``compute_loss`` and ``log`` are set on the trainer instance through its ``PatchLedger`` (the trainer class's own
methods stay, and are what it falls back to); ``detach`` reads any metric still held on the device into floats, so
nothing it kept outlives the call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..model_parts import unwrap_model
from ..say_once import SayOnce
from ..switches import switch
from ..trl_seam import mirror_differs
from .labelled_head import LABELLED_KEY, LabelledHead
from .ledger import PatchLedger

logger = logging.getLogger(__name__)

SAY_ONCE = SayOnce(logger, "nbkit: sync_free_metrics")  # the fallback to another TRL's code, said once per process

# what this reproduces (compute_loss's default branch, the log that averages its metrics, the fused head's patch),
# by source fingerprint, as TRL 1.16.0 has them
MIRRORS = {
    "trl.trainer.sft_trainer:SFTTrainer.compute_loss": frozenset({"6f040d8112032dfd"}),
    "trl.trainer.sft_trainer:SFTTrainer.log": frozenset({"76c6db3f9f34acdd"}),
    "trl.trainer.utils:add_fused_lm_head": frozenset({"c1b7a9c23e7ad579"}),
}
_METRICS_READ = ("entropy", "mean_token_accuracy", "aux_loss", "num_tokens")


def applies(trainer: Any, return_outputs: bool) -> bool:
    """Whether this run's loss takes the sync-free path (else TRL's own ``compute_loss``); the installed TRL's code
    is checked against ``MIRRORS`` once, by ``attach``."""
    args = trainer.args
    parallel = getattr(trainer.accelerator, "parallelism_config", None)
    return (
        switch(args, "sync_free_metrics")
        and not return_outputs
        and getattr(trainer, "compute_loss_func", None) is None
        and getattr(trainer, "label_smoother", None) is None
        and getattr(args, "loss_type", "nll") in ("nll", "dft")
        and not (parallel is not None and getattr(parallel, "sp_enabled", False))
        and trainer.accelerator.num_processes == 1
    )


class SyncFreeLoss:
    """``compute_loss`` and ``log`` of one trainer, as described in the module docstring."""

    name = "sync_free_metrics"

    def __init__(self) -> None:
        self._ledger = PatchLedger(self.name)
        self._trainer: Any = None
        self.head: LabelledHead | None = None  # TRL's fused head over host-listed positions, when it applies

    def attach(self, trainer: Any) -> bool:
        self.detach()
        if not applies(trainer, return_outputs=False):
            return False
        differs = mirror_differs(MIRRORS)
        if differs:
            import trl

            SAY_ONCE(" ".join(differs), f"the installed TRL {trl.__version__} differs from the TRL 1.16.0 this speedup "
                      f"reproduces ({', '.join(w.partition(':')[2] for w in differs)}); TRL's own compute_loss is used")
            return False
        own_loss, own_log = trainer.compute_loss, trainer.log  # the class's methods, bound: the fallback

        def compute_loss(model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None):
            labelled = inputs.pop(LABELLED_KEY, None)
            if not applies(trainer, return_outputs):
                return own_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            return sync_free_loss(trainer, model, inputs, num_items_in_batch,
                                  labelled if self.head is not None else None)

        def log(logs: dict[str, float], start_time: float | None = None) -> None:
            read_metrics(trainer, "train" if trainer.model.training else "eval")
            own_log(logs, start_time)

        self._trainer = trainer
        self._ledger.set(trainer, "compute_loss", compute_loss)
        self._ledger.set(trainer, "log", log)
        causal_lm = unwrap_model(trainer.model)
        settings = LabelledHead.applies(causal_lm)
        if settings is not None:
            self.head = LabelledHead(causal_lm, vars(causal_lm)["forward"], settings)
            self._ledger.set(causal_lm, "forward", self.head)  # an instance attribute: TRL's patch is one too
        return True

    def detach(self) -> None:
        trainer, self._trainer = self._trainer, None
        if trainer is not None:
            for mode in ("train", "eval"):
                read_metrics(trainer, mode)
        self._ledger.undo()
        self.head = None


def sync_free_loss(trainer: Any, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any,
                   labelled: torch.Tensor | None = None) -> Any:
    """TRL's default loss branch, its metrics kept as device tensors (see the module docstring); ``labelled``: the
    host-listed positions for ``LabelledHead`` (attached), else TRL's head selects them."""
    mode = "train" if trainer.model.training else "eval"
    inputs["use_cache"] = False
    if trainer.aux_loss_enabled:
        inputs["output_router_logits"] = True
    extra = {LABELLED_KEY: labelled} if labelled is not None else {}
    outputs = model(**inputs, fused_lm_head=True, **extra)
    per_token_loss = -outputs.log_probs  # zero on ignored positions
    if trainer.args.loss_type == "dft":
        per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
    num_valid = outputs.label_mask.sum()
    num_tokens = num_valid if num_items_in_batch is None else num_items_in_batch
    loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
    if trainer.args.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * (trainer.accelerator.num_processes // trainer.get_tp_size())
    if trainer.aux_loss_enabled:
        steps = trainer.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        loss = loss + trainer.router_aux_loss_coef * outputs.aux_loss / steps

    metrics = trainer._metrics[mode]
    some = num_valid > 0
    metrics["entropy"].append(torch.where(some, outputs.entropy.detach().sum() / num_valid, 0.0))
    metrics["mean_token_accuracy"].append(torch.where(some, outputs.is_top1.sum() / num_valid, 0.0))
    if mode == "train":
        if "attention_mask" in inputs:
            count = inputs["attention_mask"].sum()  # a device sum: read at the next log
        elif "position_ids" in inputs:
            count = inputs["position_ids"].size(1)
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        trainer._total_train_tokens = trainer._total_train_tokens + count // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]
    if trainer.aux_loss_enabled:
        metrics["aux_loss"].append(outputs.aux_loss.detach().mean())
    return loss


def read_metrics(trainer: Any, mode: str) -> None:
    """Replace the device tensors among this mode's metrics (and the token total) by floats, in one read."""
    metrics = trainer._metrics[mode]
    spots = [(key, i) for key in _METRICS_READ for i, v in enumerate(metrics.get(key, ()))
             if isinstance(v, torch.Tensor)]
    if isinstance(trainer._total_train_tokens, torch.Tensor):
        spots.append(("_total", 0))
    if not spots:
        return
    values = [trainer._total_train_tokens if key == "_total" else metrics[key][i] for key, i in spots]
    # float64: exact for the float32 metrics and for token totals up to 2**53
    host = torch.stack([v.detach().double().reshape(()).to(values[0].device) for v in values]).tolist()
    for (key, i), value in zip(spots, host):
        if key == "_total":
            trainer._total_train_tokens = int(value)
        else:
            metrics[key][i] = value
    if "num_tokens" in metrics:
        metrics["num_tokens"] = [trainer._total_train_tokens]
