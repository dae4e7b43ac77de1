"""``ReliableTraining``: what happens when something goes wrong, as a mixin for TRL's ``SFTTrainer``.

Used as ``class FastSFT(ReliableTraining, SFTTrainer)``; the mixin relies on ``SFTTrainer``'s internals (its
``_prepare_dataset``, transformers' ``_save_checkpoint`` / ``_get_output_dir`` / ``_init_training_state``), so it is
meant for that base and no other. None of it changes the numbers of a run that goes right.

- Inputs: the raw datasets and settings are checked before TRL prepares them (``guards``; ``validate_inputs``).
- Out of memory: an OOM in the step frees what the step held and raises ``TrainingOutOfMemoryError`` naming the step,
  the memory and what to change (``oom``); one outside the step (optimizer, evaluation, save) is explained too.
- Non-finite loss: flagged at each micro-batch, and no optimizer update is applied for a window with a non-finite
  loss; ``on_nonfinite_loss`` stops or skips (``nonfinite``). On one process without a gradient scaler the flags
  stay on the device and are read after the step (``deferred_check``: no host read inside the step); otherwise
  they are read after each micro-batch's backward. The same flags find batches whose labels are all masked (nothing
  to train on), warned about with their rows.
- Saves: checkpoints and ``save_model`` are written into a hidden staging folder and renamed into place
  (``checkpoints``; ``atomic_saves``); ``train(resume_from_checkpoint=True)`` resumes from the newest complete
  checkpoint (its files checked, so one damaged by another writer is passed over with a warning; a damaged one named
  explicitly is an error), and resuming a run that already reached ``max_steps`` trains no further step.
"""

from __future__ import annotations

import copy
import inspect
import logging
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..model_parts import unwrap_model
from ..switches import switch
from . import checkpoints, nonfinite, oom
from .deferred_check import DeferredLossCheck, MicroBatch, filtered_loss, found_inf_supported
from .guards import validate_training_inputs
from .stop_token import ROWS_CHECKED, StopTokenCheck, check_stop_token

logger = logging.getLogger(__name__)

MASKED_WARNINGS = 3  # masked batches warned about one by one; the rest are counted in one line at the end


class ReliableTraining:
    """Input checks, OOM and non-finite-loss handling, atomic saves and resume for an ``SFTTrainer`` subclass.

    After ``train()``: ``nbkit_skipped`` lists the non-finite batches ``on_nonfinite_loss="skip"`` stepped over,
    ``nbkit_masked`` the micro-batches that had no label to train on.
    """

    def __init__(self, model: Any = None, args: Any = None, data_collator: Any = None, *pargs: Any,
                 **kwargs: Any) -> None:
        self.nbkit_skipped: list[nonfinite.NonFiniteLoss] = []
        self.nbkit_masked: list[nonfinite.MaskedBatch] = []
        self._nbkit_micro = 0  # micro-batches run in the current gradient-accumulation window
        self._nbkit_skip_window = False
        self._nbkit_staging: Path | None = None
        self._nbkit_locator: nonfinite.DocumentLocator | None = None
        self._nbkit_deferred: DeferredLossCheck | None = None  # set for a train() call that defers its reads
        self._nbkit_nan_filter = False  # transformers' logging_nan_inf_filter, computed on the device meanwhile
        self._nbkit_check_inputs(model, args, data_collator, pargs, kwargs)
        super().__init__(model, args, data_collator, *pargs, **kwargs)
        self.add_callback(_DeferredReads(self))
        self.nbkit_stop_token: StopTokenCheck | None = None
        if switch(self.args, "validate_inputs") and self.train_dataset is not None:
            self.nbkit_stop_token = self._nbkit_check_stop_token()

    # -- input checks --------------------------------------------------------------------------------------------------
    def _nbkit_check_inputs(self, model: Any, args: Any, data_collator: Any, pargs: tuple, kwargs: dict) -> None:
        """Validate the raw datasets and settings before TRL prepares them; keep what locating rows needs later."""
        given = inspect.signature(super().__init__).bind(model, args, data_collator, *pargs, **kwargs).arguments
        self._nbkit_raw_train = given.get("train_dataset")
        self._nbkit_formatting_func = given.get("formatting_func")
        if self._nbkit_raw_train is None or not switch(args, "validate_inputs"):
            return  # TRL raises its own error for a missing train_dataset
        validate_training_inputs(
            args,
            self._nbkit_raw_train,
            eval_dataset=given.get("eval_dataset"),
            processing_class=given.get("processing_class"),
            data_collator=data_collator,
            formatting_func=self._nbkit_formatting_func,
        )

    def _nbkit_check_stop_token(self) -> StopTokenCheck | None:
        """Warn before training when no prepared row trains the end-of-turn / eos token (the model would never stop)."""
        dataset = self.train_dataset
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__") or self.processing_class is None:
            return None  # iterable datasets: reading rows here would consume them
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        rows = (dataset[i] for i in range(min(len(dataset), ROWS_CHECKED)))
        return check_stop_token(tokenizer, rows, getattr(unwrap_model(self.model), "generation_config", None))

    # -- train ---------------------------------------------------------------------------------------------------------
    def nbkit_reliably(self, train: Any, resume_from_checkpoint: str | bool | None, *args: Any, **kwargs: Any) -> Any:
        """``train(resume_from_checkpoint, *args, **kwargs)`` (the trainer's ``train``) with this run's counters
        reset, an out-of-memory error outside the step (optimizer, evaluation, save) explained, and the skipped and
        masked batches summed up at the end. ``resume_from_checkpoint`` goes through ``nbkit_prepare_resume``
        first (the caller does that before anything is attached)."""
        self._nbkit_micro, self._nbkit_skip_window = 0, False
        self.nbkit_masked = []
        nan_filter = self.args.logging_nan_inf_filter
        if self._nbkit_defers_reads():
            self._nbkit_deferred = DeferredLossCheck(self._nbkit_report)
            self._nbkit_nan_filter, self.args.logging_nan_inf_filter = nan_filter, False
        try:
            result = train(resume_from_checkpoint, *args, **kwargs)
        except torch.OutOfMemoryError as error:
            if isinstance(error, oom.TrainingOutOfMemoryError):
                raise
            original = oom.forget_exception(error)
        else:
            if self.nbkit_skipped:
                logger.warning(nonfinite.skip_summary(self.nbkit_skipped))
            if len(self.nbkit_masked) > MASKED_WARNINGS:
                logger.warning(nonfinite.masked_summary(self.nbkit_masked))
            return result
        finally:
            self.args.logging_nan_inf_filter = nan_filter
            self._nbkit_deferred, self._nbkit_nan_filter = None, False
        raise self._nbkit_oom_error(original, "the optimizer step, an evaluation or a save") from None

    def _nbkit_defers_reads(self) -> bool:
        """Whether this run's loss flags can stay on the device (``deferred_check``): one process (every rank would
        have to take the same branch), no gradient scaler (fp16 skips non-finite steps itself), no DeepSpeed."""
        return switch(self.args, "on_nonfinite_loss") != "off" and self.accelerator.num_processes == 1 \
            and self.accelerator.scaler is None and not self.is_deepspeed_enabled

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: str | None, trial: Any) -> tuple[int, int]:
        """transformers' state set-up; a checkpoint that already reached ``max_steps`` leaves no epoch to run.

        transformers checks ``global_step >= max_steps`` only after a step, so resuming a finished run whose last
        epoch is not used up would train one step past ``max_steps`` (and write ``checkpoint-<max_steps + 1>``).
        """
        epochs, steps = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                     resume_from_checkpoint, trial)
        if resume_from_checkpoint is not None and 0 < max_steps <= self.state.global_step:
            logger.warning("nbkit: %s is at step %d of max_steps=%d: the run is complete, no step left to train",
                           resume_from_checkpoint, self.state.global_step, max_steps)
            return num_train_epochs, 0
        return epochs, steps

    # -- the step: out of memory, non-finite loss, masked batches ------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        """TRL's step; an out-of-memory error frees the step's memory and is re-raised with what to change."""
        self._nbkit_micro += 1
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except torch.OutOfMemoryError as error:
            if isinstance(error, oom.TrainingOutOfMemoryError):
                raise
            original = oom.forget_exception(error)  # its frames hold the step's activations
        else:
            deferred = self._nbkit_deferred
            if deferred is not None:
                deferred.record(loss, _all_masked(inputs, loss.device), inputs, self.state.global_step + 1,
                                max(1, self._nbkit_micro))
                deferred.resolve()  # windows before this one: their flags reached the host while this was queued
            elif switch(self.args, "on_nonfinite_loss") != "off":
                self._nbkit_check_loss(loss, inputs)
            self._nbkit_end_micro_batch()
            if self._nbkit_nan_filter:
                return filtered_loss(loss, self._tr_loss, self.state.global_step - self._globalstep_last_logged)
            return loss
        del inputs
        raise self._nbkit_oom_error(original, "the forward/backward pass") from None

    def _nbkit_end_micro_batch(self) -> None:
        if not self.accelerator.sync_gradients:
            return  # more micro-batches to accumulate before the optimizer steps
        if self._nbkit_skip_window:
            # on_nonfinite_loss="skip": apply nothing of this window; torch optimizers leave parameters without a
            # gradient (and their state) untouched
            self.model.zero_grad(set_to_none=True)
        self._nbkit_skip_window = False
        self._nbkit_micro = 0

    def _nbkit_oom_error(self, original: str, where: str) -> oom.TrainingOutOfMemoryError:
        oom.free_memory(self.model)
        return oom.out_of_memory_error(
            original,
            step=self.state.global_step + 1,
            micro_batch=self._nbkit_micro or None,
            accumulation=self.args.gradient_accumulation_steps,
            where=where,
            args=self.args,
            model=self.model,
            device=self.args.device,
        )

    def _nbkit_check_loss(self, loss: torch.Tensor, inputs: dict[str, Any]) -> None:
        """After a micro-batch's backward, before any optimizer step: stop or skip on a non-finite loss, warn about
        a batch with no label to train on. One host read for both.

        ``loss`` is what the step returns (detached; divided by the accumulation steps where transformers divides
        it): it is non-finite exactly when the loss its backward ran on was. Reading it here, not between forward
        and backward, keeps the GPU's queue full; transformers reads it after the backward anyway
        (``logging_nan_inf_filter``), and nothing has touched the weights yet."""
        bad = (~torch.isfinite(loss).all()).to(torch.int32)
        if self.accelerator.num_processes > 1:  # every rank must take the same branch: collectives follow
            bad = self.accelerator.reduce(bad, reduction="sum")
        flags = torch.stack([bad > 0, _all_masked(inputs, loss.device)]).tolist()
        nonfinite_loss, masked = flags
        self._nbkit_act(loss, inputs, self.state.global_step + 1, max(1, self._nbkit_micro), nonfinite_loss, masked,
                        deferred=False)

    def _nbkit_report(self, micro_batch: MicroBatch, nonfinite_loss: bool, masked: bool) -> None:
        """A micro-batch's flags read after its window's optimizer step (``deferred_check``)."""
        self._nbkit_act(micro_batch.loss, micro_batch.inputs, micro_batch.step, micro_batch.micro, nonfinite_loss,
                        masked, deferred=True)

    def _nbkit_act(self, loss: torch.Tensor, inputs: dict[str, Any], step: int, micro: int, nonfinite_loss: bool,
                   masked: bool, deferred: bool) -> None:
        """Warn about a masked batch; on a non-finite loss stop (raise) or skip. ``deferred``: read after the
        window's optimizer step, whose update the flag kept from being applied; else read before it."""
        if masked:
            self._nbkit_masked_batch(inputs, step, micro)
        if not nonfinite_loss:
            return
        event = self._nbkit_nonfinite(loss, inputs, masked, step, micro)
        if switch(self.args, "on_nonfinite_loss") == "stop":
            if not deferred:
                raise self._nbkit_stop(event, "after this batch's backward, before any optimizer step")
            self.state.global_step = min(self.state.global_step, step - 1)  # step `step` applied nothing
            raise self._nbkit_stop(event, f"at this batch; the optimizer update of step {step} was not applied")
        if not deferred:
            # The backward still runs (DDP and FSDP expect one after every forward); then either the GradScaler
            # (fp16) finds the non-finite gradients and skips the step itself, or the window's gradients are dropped.
            self._nbkit_skip_window = self.accelerator.scaler is None

    def _nbkit_masked_batch(self, inputs: dict[str, Any], step: int, micro: int) -> None:
        """Record (and for the first few, warn about, with their rows) a micro-batch with every label masked."""
        documents, spans = nonfinite.batch_documents(inputs)
        warn = len(self.nbkit_masked) < MASKED_WARNINGS
        locator = self._nbkit_document_locator() if warn else None
        event = nonfinite.MaskedBatch(
            step=step,
            micro_batch=micro,
            accumulation=self.args.gradient_accumulation_steps,
            rows=locator.locate(documents) if locator is not None else None,
            spans=spans,
        )
        self.nbkit_masked.append(event)
        if warn:
            logger.warning("nbkit: %s. %s", event.describe(), nonfinite.masked_advice())

    def _nbkit_nonfinite(self, loss: torch.Tensor, inputs: dict[str, Any], masked: bool, step: int,
                         micro: int) -> nonfinite.NonFiniteLoss:
        """The account of a non-finite loss (rows, culprits); under ``skip`` it is recorded and warned about."""
        documents, spans = nonfinite.batch_documents(inputs)
        locator = self._nbkit_document_locator()
        rows = locator.locate(documents) if locator is not None else None
        single = self.accelerator.num_processes == 1
        local = bool(torch.isfinite(loss.detach()).all())
        notes = (locator.note if locator is not None else "",
                 "finite here, non-finite on another process" if local else "",
                 "the batch has no token to train on: every label is masked" if masked else "")
        event = nonfinite.NonFiniteLoss(
            step=step,
            micro_batch=micro,
            accumulation=self.args.gradient_accumulation_steps,
            value=float(loss.detach().float().cpu()),
            rows=rows,
            spans=spans,
            culprits=self._nbkit_nonfinite_documents(inputs, spans) if single else None,  # no lone forwards
            note="; ".join(n for n in notes if n),
        )
        if switch(self.args, "on_nonfinite_loss") == "skip":
            logger.warning("nbkit: %s; skipping optimizer step %d (on_nonfinite_loss='skip')", event.describe(),
                           event.step)
            self.nbkit_skipped.append(event)
        return event

    def _nbkit_stop(self, event: nonfinite.NonFiniteLoss, when: str) -> nonfinite.NonFiniteLossError:
        """The error ``stop`` raises; the gradients held so far are dropped (none may reach a later step)."""
        self.model.zero_grad(set_to_none=True)
        last = checkpoints.last_complete_checkpoint(self.args.output_dir) if self.args.output_dir else None
        kept = f"; the last checkpoint, {last}, is intact" if last else ""
        held = f"the weights of step {event.step - 1}" if event.step > 1 else "its initial weights"
        return nonfinite.NonFiniteLossError(
            f"nbkit: {event.describe()}. Training stopped {when}: the model holds {held}{kept}. Look at those rows "
            "(an extreme or corrupt example), lower learning_rate or set max_grad_norm, or set "
            "on_nonfinite_loss='skip' to step over such batches.",
            event,
        )

    @torch.no_grad()
    def _nbkit_nonfinite_documents(self, inputs: dict[str, Any], spans: list[tuple[int, int, int]]) -> list[int] | None:
        """Which of the batch's documents give a non-finite loss on their own: one no-grad forward each, through
        TRL's fused head (the loss path), with the RNG forked so a skipped run's later steps are unchanged."""
        ids, labels = inputs.get("input_ids"), inputs.get("labels")
        if ids is None or labels is None:
            return None
        devices = [ids.device.index or 0] if ids.is_cuda else []
        culprits = []
        try:
            with torch.random.fork_rng(devices=devices):
                for i, (row, start, end) in enumerate(spans):
                    out = self.model(
                        input_ids=ids[row : row + 1, start:end],
                        labels=labels[row : row + 1, start:end],
                        position_ids=torch.arange(end - start, device=ids.device)[None],
                        fused_lm_head=True,
                        use_cache=False,
                    )
                    if not bool(torch.isfinite(out.log_probs).all()):
                        culprits.append(i)
        except Exception as error:  # a courtesy of the error path: never hide the real error behind it
            logger.warning("nbkit: could not test the documents one by one (%s: %s)", type(error).__name__, error)
            return None
        return culprits

    def _nbkit_document_locator(self) -> nonfinite.DocumentLocator | None:
        """Maps a batch's documents to rows of the user's train_dataset, built on first use (see ``nonfinite``)."""
        if self._nbkit_locator is None and self._nbkit_raw_train is not None:
            args = copy.copy(self.args)
            args.max_length, args.shuffle_dataset = None, False  # whole documents, in dataset order

            def prepare(dataset):
                return self._prepare_dataset(dataset, self.processing_class, args, False, self._nbkit_formatting_func,
                                             "nbkit row lookup")

            self._nbkit_locator = nonfinite.DocumentLocator(self._nbkit_raw_train, prepare)
        return self._nbkit_locator

    # -- atomic checkpoints and saves, resume --------------------------------------------------------------------------
    def _nbkit_atomic(self) -> bool:
        """Staged saves need one writer and a local rename: single process, no Hub push, no DeepSpeed/FSDP."""
        return bool(switch(self.args, "atomic_saves")) and not self.args.push_to_hub and self.args.world_size == 1 \
            and not self.is_deepspeed_enabled and not self.is_fsdp_enabled

    def _get_output_dir(self, trial: Any) -> str:
        """While a checkpoint is being staged, transformers writes it into the staging folder."""
        if self._nbkit_staging is not None:
            return str(self._nbkit_staging)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """transformers' checkpoint, written into a hidden staging folder and renamed to ``checkpoint-N`` whole."""
        if not self._nbkit_atomic():
            return super()._save_checkpoint(model, trial)
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = checkpoints.new_staging_dir(run_dir, name)
        self._nbkit_staging = staging
        try:
            super()._save_checkpoint(model, trial)  # its own rotation runs in the staging folder: nothing to rotate
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            self._nbkit_staging = None
        written = staging / name
        best = self.state.best_model_checkpoint
        if best is not None and Path(best).parent == staging:  # transformers recorded the staging path
            self.state.best_model_checkpoint = str(run_dir / Path(best).name)
            self.state.save_to_json(str(written / "trainer_state.json"))
        checkpoints.publish_directory(written, run_dir / name)
        shutil.rmtree(staging, ignore_errors=True)
        if self.args.should_save:
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; a user's call writes to a staging folder first (``checkpoints.atomic_directory``)."""
        if _internal_call or not self._nbkit_atomic():
            return super().save_model(output_dir, _internal_call)
        target = output_dir if output_dir is not None else self.args.output_dir
        with checkpoints.atomic_directory(target) as staging:
            super().save_model(str(staging), _internal_call)

    def nbkit_prepare_resume(self, resume: str | bool | None) -> str | bool | None:
        """Tidy what a kill left in output_dir; turn ``True`` into the newest complete checkpoint, and check a named one.

        ``True``: checkpoints are tried newest first; each damaged or unfinished one is named in one warning with what
        is wrong (``checkpoints.checkpoint_problem``), and none complete is an error listing them. A named checkpoint
        that is damaged fails here, before any weight is loaded, naming the file and the intact older checkpoint: an
        explicit choice is never swapped for another. Without atomic saves (switched off, several processes,
        DeepSpeed/FSDP layouts) transformers' own choice and loading stand.
        """
        output_dir = self.args.output_dir
        if not output_dir or not self._nbkit_atomic():
            return resume
        for done in checkpoints.recover_interrupted(output_dir):
            logger.warning("nbkit: %s in %s", done, output_dir)
        if isinstance(resume, (str, Path)) and Path(resume).is_dir():
            self._nbkit_check_named_checkpoint(Path(resume))
        if resume is not True:
            return resume
        skipped: list[tuple[str, str]] = []
        found = checkpoints.last_complete_checkpoint(output_dir, skipped)
        for path, why in skipped:
            logger.warning("nbkit: not resuming from %s: %s", path, why)
        if found is None:
            listed = ", ".join(f"{path} ({why})" for path, why in skipped)
            extra = f"; {len(skipped)} incomplete: {listed}" if skipped else ""
            raise ValueError(f"resume_from_checkpoint=True, but {output_dir} holds no complete checkpoint{extra}. "
                             "Start without resume_from_checkpoint, or point output_dir at the run's folder")
        logger.info("nbkit: resuming from %s", found)
        return found

    @staticmethod
    def _nbkit_check_named_checkpoint(path: Path) -> None:
        """Raise, naming what is wrong and the intact older checkpoint beside it, when ``path`` cannot be resumed."""
        problem = checkpoints.checkpoint_problem(path)
        if problem is None:
            return
        step = checkpoints.checkpoint_step(path)
        older = checkpoints.last_complete_checkpoint(path.parent, before=step) if step is not None else None
        instead = (f"The newest intact older checkpoint is {older}: resume from it by name" if older
                   else "No older checkpoint beside it is intact")
        raise ValueError(f"resume_from_checkpoint={str(path)!r} cannot be resumed: {problem}. {instead}")


def _all_masked(inputs: dict[str, Any], device: torch.device) -> torch.Tensor:
    """True (a 0-d tensor on ``device``, read with the loss) when the batch has no label to predict."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs.get("labels")
        labels = labels[..., 1:] if labels is not None else None  # the first token is never a target
    if labels is None:
        return torch.zeros((), dtype=torch.bool, device=device)
    return (labels == -100).all().to(device)


class _DeferredReads(TrainerCallback):
    """The optimizer-step side of ``deferred_check`` for one trainer (held weakly: the trainer holds this).

    Before the optimizer step: the window's flag becomes the fused optimizer's ``found_inf`` (else the flags are read
    now and a bad window's gradients dropped). After it: the flags' host copy starts. At a step that logs, saves or
    evaluates, and at the end of training: every unread window is reported first."""

    def __init__(self, trainer: ReliableTraining) -> None:
        self._trainer = weakref.ref(trainer)

    def _check(self) -> tuple[Any, DeferredLossCheck | None]:
        trainer = self._trainer()
        return trainer, (trainer._nbkit_deferred if trainer is not None else None)

    @staticmethod
    def _optimizer(trainer: Any) -> Any:
        optimizer = trainer.optimizer
        return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # TrainerCallback's signature
        trainer, check = self._check()
        if check is None:
            return
        optimizer = self._optimizer(trainer)
        if found_inf_supported(optimizer):
            flag = check.window_flag()
            if flag is not None:
                optimizer.found_inf = flag
        elif check.read_window_now():  # a non-fused optimizer: one read, then the bad window applies nothing
            trainer.model.zero_grad(set_to_none=True)

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer, check = self._check()
        if check is None:
            return
        vars(self._optimizer(trainer)).pop("found_inf", None)
        check.window_done()

    def on_step_end(self, args, state, control, **kwargs):
        _, check = self._check()
        if check is not None and check.unread and (control.should_log or control.should_save
                                                   or control.should_evaluate or control.should_training_stop):
            check.resolve()

    def on_train_end(self, args, state, control, **kwargs):
        _, check = self._check()
        if check is not None:
            check.resolve()
