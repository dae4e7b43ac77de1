"""``FastSFT``: TRL's ``SFTTrainer`` with nbkit's speedups attached for the duration of training.

Contract: same constructor, datasets and behaviour as ``SFTTrainer``. The switches in ``FastSFTConfig`` change speed
and memory only. Each speedup is an object this trainer owns, attached to the model when ``train()`` (or
``evaluate()``) starts and detached when it ends, so the model a user gets back is a plain transformers/PEFT model.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from . import speedups
from .config import switch as _switch
from .reliability import resilience
from .reliability.guards import validate_training_inputs
from .speedups.ledger import Speedup
from .speedups.packed_attention import PackedCollator

logger = logging.getLogger(__name__)


class _TrainStageSpeedups(TrainerCallback):
    """Owns the ``stage="train"`` speedups of one run: attached to the model training starts (transformers has
    enabled gradient checkpointing by then), detached by the trainer when ``train()`` ends."""

    def __init__(self) -> None:
        self.pending: list[Speedup] = []
        self.attached: list[Speedup] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001 - TrainerCallback's signature
        for speedup in self.pending:
            if speedup.attach(model):
                self.attached.append(speedup)
        self.pending = []

    def detach(self) -> None:
        for speedup in reversed(self.attached):
            speedup.detach()
        self.attached, self.pending = [], []


class FastSFT(SFTTrainer):
    """A drop-in ``SFTTrainer`` (same arguments) that trains faster with the same losses.

    Speedups (each a switch in ``FastSFTConfig``): cached packed-sequence metadata with varlen attention
    (``cached_packing``), offloaded double-buffered checkpointing (``offload_checkpointing``), fast MoE routing
    (``fast_moe_routing``), fused LoRA layers (``fused_lora``), Liger's fused RMSNorm/SwiGLU/RoPE kernels
    (``fused_kernels``), and a live notebook dashboard (``live_dashboard``).

    Reliability (``nbkit.reliability.guards``, ``nbkit.reliability.resilience``): inputs are checked before TRL prepares them
    (``validate_inputs``); an out-of-memory step raises ``TrainingOutOfMemoryError`` naming the step, the memory and
    what to change; a non-finite loss stops or skips per ``on_nonfinite_loss``; checkpoints and ``save_model`` are
    written atomically (``atomic_saves``) and ``train(resume_from_checkpoint=True)`` resumes from the newest complete
    checkpoint.
    """

    def __init__(self, model: Any = None, args: SFTConfig | None = None, data_collator: Any = None, *pargs: Any,
                 **kwargs: Any) -> None:
        self._nbkit_user_collator = data_collator is not None
        self._speedups: list[Speedup] = []
        self._train_stage = _TrainStageSpeedups()
        self._nbkit_active = False
        self.nbkit_attached: list[str] = []  # what the last train()/evaluate() ran with, kept after detach
        self.nbkit_skipped: list[resilience.NonFiniteLoss] = []  # batches on_nonfinite_loss="skip" stepped over
        self._nbkit_micro = 0  # micro-batches run in the current gradient-accumulation window
        self._nbkit_skip_window = False
        self._nbkit_staging: Path | None = None
        self._nbkit_locator: resilience.DocumentLocator | None = None
        self._nbkit_check_inputs(model, args, data_collator, pargs, kwargs)
        super().__init__(model, args, data_collator, *pargs, **kwargs)
        if _switch(self.args, "cached_packing"):
            self._install_packed_collator()
        self.add_callback(self._train_stage)
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

    # -- attach / detach -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def nbkit_speedups(self) -> Iterator[list[Speedup]]:
        """Attach the speedups ``FastSFTConfig`` switches on (``nbkit.speedups.SPEEDUPS``) for the block: the model
        stage now, the train stage when training begins; all of them detached, in reverse, when it ends."""
        if self._nbkit_active:  # nested (evaluate() inside train()): already attached
            yield self._speedups
            return
        packed = getattr(self, "_nbkit_packing_enabled", False)
        self._nbkit_active = True
        self._speedups = []
        try:
            for speedup in speedups.build("model", self.args, packed):
                if speedup.attach(self.model):
                    self._speedups.append(speedup)
            self.nbkit_attached = self.active_speedups
            self._train_stage.pending = speedups.build("train", self.args, packed)
            yield self._speedups
        finally:
            self.nbkit_attached = self.active_speedups
            self._train_stage.detach()
            for speedup in reversed(self._speedups):
                speedup.detach()
            self._speedups = []
            self._nbkit_active = False

    @property
    def active_speedups(self) -> list[str]:
        """Names of the speedups attached right now (for logs and tests)."""
        return [f"{s.name}({s.kernel})" if getattr(s, "kernel", None) else s.name
                for s in self._speedups + self._train_stage.attached]

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``SFTTrainer.train`` with the speedups attached; ``resume_from_checkpoint=True`` picks the newest complete
        checkpoint, and an out-of-memory error outside the step (optimizer, evaluation, save) is explained too."""
        resume_from_checkpoint = self._nbkit_prepare_resume(resume_from_checkpoint)
        self._nbkit_micro, self._nbkit_skip_window = 0, False
        with self.nbkit_speedups():
            try:
                result = super().train(resume_from_checkpoint, *args, **kwargs)
            except torch.OutOfMemoryError as error:
                if isinstance(error, resilience.TrainingOutOfMemoryError):
                    raise
                original = resilience.forget_exception(error)
            else:
                if self.nbkit_skipped:
                    logger.warning(resilience.skip_summary(self.nbkit_skipped))
                return result
        raise self._nbkit_oom_error(original, "the optimizer step, an evaluation or a save") from None

    def evaluate(self, *args: Any, **kwargs: Any):
        with self.nbkit_speedups():
            return super().evaluate(*args, **kwargs)

    # -- reliability: input checks, OOM, non-finite loss (nbkit.reliability.guards, nbkit.reliability.resilience) ----------------------------
    def _nbkit_check_inputs(self, model: Any, args: Any, data_collator: Any, pargs: tuple, kwargs: dict) -> None:
        """Validate the raw datasets and settings before TRL prepares them; keep what locating rows needs later."""
        given = inspect.signature(SFTTrainer.__init__).bind(self, model, args, data_collator, *pargs, **kwargs).arguments
        self._nbkit_raw_train = given.get("train_dataset")
        self._nbkit_formatting_func = given.get("formatting_func")
        if self._nbkit_raw_train is None or not _switch(args, "validate_inputs"):
            return  # TRL raises its own error for a missing train_dataset
        validate_training_inputs(
            args,
            self._nbkit_raw_train,
            eval_dataset=given.get("eval_dataset"),
            processing_class=given.get("processing_class"),
            data_collator=data_collator,
            formatting_func=self._nbkit_formatting_func,
        )

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        """TRL's step; an out-of-memory error frees the step's memory and is re-raised with what to change."""
        self._nbkit_micro += 1
        self._nbkit_pending_loss = None
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except torch.OutOfMemoryError as error:
            if isinstance(error, resilience.TrainingOutOfMemoryError):
                raise
            original = resilience.forget_exception(error)  # its frames hold the step's activations
        else:
            self._nbkit_check_loss(inputs)
            self._nbkit_end_micro_batch()
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

    def _nbkit_oom_error(self, original: str, where: str) -> resilience.TrainingOutOfMemoryError:
        resilience.free_memory(self.model)
        return resilience.out_of_memory_error(
            original,
            step=self.state.global_step + 1,
            micro_batch=self._nbkit_micro or None,
            accumulation=self.args.gradient_accumulation_steps,
            where=where,
            args=self.args,
            model=self.model,
            device=self.args.device,
        )

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        """TRL's loss; in training it is kept for the non-finite check made after its backward (``on_nonfinite_loss``).

        The check is not made here: reading the loss on the host between forward and backward stalls the GPU queue
        (measured on an H200, Qwen3-1.7B QLoRA 16K: 590 ms vs 499 ms per step). After the backward, transformers reads
        the loss anyway (``logging_nan_inf_filter``), and nothing has touched the weights yet.
        """
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if self.model.training and _switch(self.args, "on_nonfinite_loss") != "off":
            self._nbkit_pending_loss = (result[0] if return_outputs else result).detach()
        return result

    def _nbkit_check_loss(self, inputs: dict[str, Any]) -> None:
        """After a micro-batch's backward, before any optimizer step: stop or skip on a non-finite loss."""
        loss, self._nbkit_pending_loss = getattr(self, "_nbkit_pending_loss", None), None
        if loss is None:
            return
        finite = torch.isfinite(loss).all()
        if self.accelerator.num_processes > 1:  # every rank must take the same branch: collectives follow
            finite = self.accelerator.reduce((~finite).to(torch.int32), reduction="sum") == 0
        if bool(finite):  # one host read per micro-batch, where transformers makes its own
            return
        self._nbkit_nonfinite(loss, inputs, _switch(self.args, "on_nonfinite_loss"))

    def _nbkit_nonfinite(self, loss: torch.Tensor, inputs: dict[str, Any], mode: str) -> None:
        """Raise (``stop``), or record the event and mark the window so its gradients are dropped (``skip``)."""
        documents, spans = resilience.batch_documents(inputs)
        locator = self._nbkit_document_locator()
        rows = locator.locate(documents) if locator is not None else None
        single = self.accelerator.num_processes == 1
        local = bool(torch.isfinite(loss.detach()).all())
        event = resilience.NonFiniteLoss(
            step=self.state.global_step + 1,
            micro_batch=max(1, self._nbkit_micro),
            accumulation=self.args.gradient_accumulation_steps,
            value=float(loss.detach().float().cpu()),
            rows=rows,
            spans=spans,
            culprits=self._nbkit_nonfinite_documents(inputs, spans) if single else None,  # no lone forwards
            note="; ".join(n for n in (locator.note if locator is not None else "",
                                       "" if not local else "finite here, non-finite on another process") if n),
        )
        if mode == "stop":
            self.model.zero_grad(set_to_none=True)  # the window's partial gradients must not reach a later step
            last = resilience.last_complete_checkpoint(self.args.output_dir) if self.args.output_dir else None
            kept = f"; the last checkpoint, {last}, is intact" if last else ""
            held = f"the weights of step {event.step - 1}" if event.step > 1 else "its initial weights"
            raise resilience.NonFiniteLossError(
                f"nbkit: {event.describe()}. Training stopped after this batch's backward, before any optimizer step: the model holds {held}"
                f"{kept}. Look at those rows (an extreme or corrupt example), lower learning_rate or set "
                "max_grad_norm, or set on_nonfinite_loss='skip' to step over such batches.",
                event,
            )
        logger.warning("nbkit: %s; skipping optimizer step %d (on_nonfinite_loss='skip')", event.describe(), event.step)
        self.nbkit_skipped.append(event)
        # The backward still runs (DDP and FSDP expect one after every forward); then either the GradScaler (fp16)
        # finds the non-finite gradients and skips the step itself, or the window's gradients are dropped.
        self._nbkit_skip_window = self.accelerator.scaler is None

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

    def _nbkit_document_locator(self) -> resilience.DocumentLocator | None:
        """Maps a batch's documents to rows of the user's train_dataset, built on first use (see resilience)."""
        if self._nbkit_locator is None and self._nbkit_raw_train is not None:
            args = copy.copy(self.args)
            args.max_length, args.shuffle_dataset = None, False  # whole documents, in dataset order

            def prepare(dataset):
                return self._prepare_dataset(dataset, self.processing_class, args, False, self._nbkit_formatting_func,
                                             "nbkit row lookup")

            self._nbkit_locator = resilience.DocumentLocator(self._nbkit_raw_train, prepare)
        return self._nbkit_locator

    # -- reliability: atomic checkpoints and saves, resume -------------------------------------------------------------
    def _nbkit_atomic(self) -> bool:
        """Staged saves need one writer and a local rename: single process, no Hub push, no DeepSpeed/FSDP."""
        return bool(_switch(self.args, "atomic_saves")) and not self.args.push_to_hub and self.args.world_size == 1 \
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
        staging = resilience.new_staging_dir(run_dir, name)
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
        resilience.publish_directory(written, run_dir / name)
        shutil.rmtree(staging, ignore_errors=True)
        if self.args.should_save:
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; a user's call writes to a staging folder first (``resilience.atomic_directory``)."""
        if _internal_call or not self._nbkit_atomic():
            return super().save_model(output_dir, _internal_call)
        target = output_dir if output_dir is not None else self.args.output_dir
        with resilience.atomic_directory(target) as staging:
            super().save_model(str(staging), _internal_call)

    def _nbkit_prepare_resume(self, resume: str | bool | None) -> str | bool | None:
        """Tidy what a kill left in output_dir; turn ``True`` into the newest complete checkpoint. Without atomic
        saves (switched off, several processes, DeepSpeed/FSDP layouts) transformers' own choice stands."""
        output_dir = self.args.output_dir
        if not output_dir or not self._nbkit_atomic():
            return resume
        for done in resilience.recover_interrupted(output_dir):
            logger.warning("nbkit: %s in %s", done, output_dir)
        if resume is not True:
            return resume
        skipped: list[tuple[str, str]] = []
        found = resilience.last_complete_checkpoint(output_dir, skipped)
        for path, why in skipped:
            logger.warning("nbkit: not resuming from %s: %s", path, why)
        if found is None:
            extra = f" ({len(skipped)} incomplete: {', '.join(p for p, _ in skipped)})" if skipped else ""
            raise ValueError(f"resume_from_checkpoint=True, but {output_dir} holds no complete checkpoint{extra}: "
                             "start without resume_from_checkpoint, or point output_dir at the run's folder")
        logger.info("nbkit: resuming from %s", found)
        return found
