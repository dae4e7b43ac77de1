"""``FastSFT``: TRL's ``SFTTrainer`` with nbkit's speedups attached for the duration of training.

Contract: same constructor, datasets and behaviour as ``SFTTrainer``. The switches in ``FastSFTConfig`` change speed
and memory only. Each speedup is an object this trainer owns, attached to the model when ``train()`` (or
``evaluate()``) starts and detached when it ends, so the model a user gets back is a plain transformers/PEFT model.
What happens when something goes wrong (bad inputs, OOM, non-finite loss, a kill mid-save, resume) is
``nbkit.reliability.trainer_mixin.ReliableTraining``, which this trainer inherits.

What the run takes is decided once, in ``__init__``, from what ``SFTTrainer.__init__`` built (the model with its
adapter, TRL's collator) and the settings, before nbkit changes anything (``nbkit.speedups.fast_path``): a model or
adapter the speedups were not built for (conv/SSM hybrids, PEFT prompt learning) trains exactly as ``SFTTrainer``
does, and a speedup that cannot apply whole is left out, each said in one line.

Batches: ``trainer.data_collator`` stays TRL's (what ``SFTTrainer`` returns for the same settings). nbkit's
``PackedCollator`` (padding-free batches with host-built boundaries) is given only to the data loaders this trainer
builds for training and evaluation (``get_train_dataloader`` / ``get_eval_dataloader``), when ``cached_packing``
applies.

Precision: trainable weights never sit in a lower precision than the run computes in
(``nbkit.settings.trainable_dtype``). TRL casts a quantized model's trainable weights to bf16 (its QLoRA recipe,
meant for bf16 GPUs); under fp16 mixed precision (a T4) they go back to fp32 (fp16's gradient scaler cannot unscale
bf16 gradients), and without mixed precision (a CPU) to the model's compute dtype, so the trained model runs
outside the trainer (``chat``, ``generate``) as it trained.

One setting TRL changes on the model is handed back too: ``SFTTrainer.__init__`` sets ``output_router_logits=True``
on a MoE config (for the load-balancing loss), with which a padded ``generate`` fails at its first decode step. It
holds TRL's value inside ``train()`` / ``evaluate()`` (the auxiliary loss is unchanged) and the user's outside.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer

from . import speedups
from .chat import release_decoders
from .config import FastSFTConfig, read_numbers
from .model_parts import unwrap_model
from .reliability.trainer_mixin import ReliableTraining
from .settings import trainable_dtype
from .speedups.fast_path import FastPath, decide
from .speedups.labelled_head import LABELLED_KEY
from .speedups.ledger import Speedup
from .speedups.packed_attention import PackedCollator
from .switches import switch as _switch
from .trl_seam import DataCollatorForLanguageModeling

logger = logging.getLogger(__name__)


class _TrainingEvents(TrainerCallback):
    """Hands the training events the speedups attached for one run wait for to them: ``begin_training`` when
    training begins (transformers has enabled gradient checkpointing by then), ``optimizer_stepped`` after each
    optimizer step (the layer plan's second look comes after the first)."""

    def __init__(self) -> None:
        self.speedups: list[Speedup] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # TrainerCallback's signature
        for speedup in self.speedups:
            begin = getattr(speedup, "begin_training", None)
            if begin is not None:
                begin(model)

    def on_optimizer_step(self, args, state, control, **kwargs):
        for speedup in self.speedups:
            stepped = getattr(speedup, "optimizer_stepped", None)
            if stepped is not None:
                stepped()


class FastSFT(ReliableTraining, SFTTrainer):
    """A drop-in ``SFTTrainer`` (same arguments) that trains faster with the same losses.

    Speedups (each a switch in ``FastSFTConfig``): cached packed-sequence metadata with varlen attention
    (``cached_packing``), offloaded double-buffered checkpointing (``offload_checkpointing``), fast MoE routing
    (``fast_moe_routing``), fused LoRA layers (``fused_lora``), Liger's fused RMSNorm/SwiGLU/RoPE kernels
    (``fused_kernels``), the MLP tiled over the sequence (``tiled_mlp``), the last layers left un-checkpointed where
    their activations fit (``selective_checkpointing``), the frozen 4-bit weights kept dequantized where memory is
    to spare (``dequant_cache``), the CUDA allocator's expandable segments (``expandable_segments``), the
    un-checkpointed layers replayed as CUDA graphs (``cuda_graphs``), TRL's step metrics read at logging time, not
    after every forward, and its LM head over positions the collator lists (``sync_free_metrics``), and a live
    notebook dashboard (``live_dashboard``). Always on:
    the FLOPs estimate transformers logs takes the model's parameter count once per run (``step_flops``), and the
    step's gradient clip and ``zero_grad`` walk the trainable parameters only (``step_walks``).

    The decoder layers' switches (``selective_checkpointing``, ``offload_checkpointing``, ``cuda_graphs``,
    ``tiled_mlp``, ``dequant_cache``) are modes of one ``LayerRunner`` (``speedups.layer_runner``), the only nbkit
    wrapper on a layer: one plan per layer from one memory budget, said in one line; ``nbkit_layer_stats`` keeps
    the last run's plan and the modes' counters.

    What wraps a run is written once, in ``train``: see ``_nbkit_run``. What the run takes was decided when it was
    built: ``nbkit_path`` (a ``fast_path.FastPath``); ``nbkit_collator`` is the packed collator its own data loaders
    use (None where ``cached_packing`` does not apply), ``data_collator`` TRL's.

    Reliability (``ReliableTraining``, ``nbkit.reliability``): inputs are checked before TRL prepares them
    (``validate_inputs``); an out-of-memory step raises ``TrainingOutOfMemoryError`` naming the step, the memory and
    what to change; a non-finite loss stops or skips per ``on_nonfinite_loss``; checkpoints and ``save_model`` are
    written atomically (``atomic_saves``) and ``train(resume_from_checkpoint=True)`` resumes from the newest complete
    checkpoint.
    """

    def __init__(self, model: Any = None, args: SFTConfig | None = None, data_collator: Any = None, *pargs: Any,
                 **kwargs: Any) -> None:
        if args is not None and not isinstance(args, FastSFTConfig):
            read_numbers(args)  # a plain SFTConfig checks no types: "2e-4" would fail inside torch's optimizer
        self._nbkit_user_collator = data_collator is not None
        self._speedups: list[Speedup] = []
        self._training_events = _TrainingEvents()
        self._nbkit_active = False
        self.nbkit_attached: list[str] = []  # what the last train()/evaluate() ran with, kept after detach
        self.nbkit_layer_stats: dict[str, Any] = {}  # the last run's layer plan (its line) and the modes' counters
        router = _router_setting(model)
        super().__init__(model, args, data_collator, *pargs, **kwargs)
        self._nbkit_router = router if router is not None else _router_setting(self.model, given_by_name=True)
        if self._nbkit_router is not None:  # (config, the user's value, TRL's value): the user's from now on
            config, user, _ = self._nbkit_router
            self._nbkit_router = (config, user, config.output_router_logits)
            config.output_router_logits = user
        reads_logits = self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None
        self.nbkit_path: FastPath = decide(self.model, self.args, self.data_collator,
                                           user_collator=self._nbkit_user_collator, compute_metrics=reads_logits)
        if self.nbkit_path.reason:
            logger.log(self.nbkit_path.level, self.nbkit_path.reason)
        if self.nbkit_path.no_checkpointing:
            self._no_checkpointing()
        self._trainable_precision()
        self.nbkit_collator: PackedCollator | None = self._packed_collator() if self.nbkit_path.packed else None
        self._nbkit_trl_collator = self.data_collator  # one set later by the user is theirs: never swapped
        self.add_callback(self._training_events)
        self._maybe_add_dashboard()

    # -- setup ---------------------------------------------------------------------------------------------------------
    def _trainable_precision(self) -> None:
        """Trainable weights in no lower a precision than the run computes in (``settings.trainable_dtype``)."""
        floor = trainable_dtype(bool(self.args.bf16), bool(self.args.fp16), _compute_dtype(self.model))
        for param in self.model.parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype.itemsize < floor.itemsize:
                param.data = param.data.to(floor)

    def _no_checkpointing(self) -> None:
        """Gradient checkpointing off for this run (``FastPath.no_checkpointing`` says why), in the settings under
        both of transformers' names and on the model if it was on already."""
        for name in ("gradient_checkpointing", "activation_checkpointing"):
            if getattr(self.args, name, None):
                setattr(self.args, name, False)
        base = unwrap_model(self.model)
        if getattr(base, "is_gradient_checkpointing", False):
            base.gradient_checkpointing_disable()

    def _packed_collator(self) -> PackedCollator:
        """Padding-free batches with host-built boundaries, TRL's own collator underneath."""
        collator = self.data_collator
        if not collator.padding_free:
            # Packing off: TRL already truncated rows to max_length; flattening them changes no numbers.
            collator = DataCollatorForLanguageModeling(
                pad_token_id=collator.pad_token_id,
                padding_free=True,
                pad_to_multiple_of=collator.pad_to_multiple_of,
                return_tensors=collator.return_tensors,
            )
        labelled = bool(_switch(self.args, "sync_free_metrics")) and self.nbkit_path.allows("sync_free_metrics")
        return PackedCollator(collator, labelled=labelled)

    def get_train_dataloader(self):
        """Transformers' training data loader, its batches collated by nbkit's packed collator where it applies."""
        with self._nbkit_batches(self.nbkit_collator):
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None):
        """Transformers' evaluation data loader; packed batches where the packed collator applies and no metric reads
        the logits (their shape is TRL's batch's)."""
        with self._nbkit_batches(self.nbkit_collator if self.nbkit_path.packed_eval else None):
            return super().get_eval_dataloader(eval_dataset)

    @contextlib.contextmanager
    def _nbkit_batches(self, collator: PackedCollator | None) -> Iterator[None]:
        """``collator`` as ``self.data_collator`` while a data loader is built (it keeps the collator it was given);
        TRL's again after. A collator the user set after construction is left to build the batches."""
        if collator is None or self.data_collator is not self._nbkit_trl_collator:
            yield
            return
        trl_collator, self.data_collator = self.data_collator, collator
        try:
            yield
        finally:
            self.data_collator = trl_collator

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        """TRL's loss; the collator's list of labelled positions is for ``sync_free_metrics`` only, never the model's."""
        inputs.pop(LABELLED_KEY, None)
        return super().compute_loss(model, inputs, *args, **kwargs)

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

    # -- what wraps a run -----------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``SFTTrainer.train`` inside ``_nbkit_run``; ``resume_from_checkpoint=True`` picks the newest complete
        checkpoint (a damaged one named explicitly fails here, before anything is attached)."""
        resume_from_checkpoint = self.nbkit_prepare_resume(resume_from_checkpoint)
        release_decoders(self.model)  # a dense copy kept by chat() takes memory training needs
        with self._nbkit_run():
            return self.nbkit_reliably(super().train, resume_from_checkpoint, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        with self._nbkit_run():
            return super().evaluate(*args, **kwargs)

    @contextlib.contextmanager
    def _nbkit_run(self) -> Iterator[None]:
        """Everything that wraps a ``train()`` or ``evaluate()`` call, outermost first:

        1. ``nbkit_speedups``: the speedups, model stage and trainer stage (the layer runner takes over the
           checkpointed layers when training begins);
        2. ``_trl_router_setting``: TRL's MoE ``output_router_logits`` instead of the user's;
        3. inside ``train`` only, ``ReliableTraining.nbkit_reliably``: out-of-memory errors explained, the skipped
           and masked batches summed up (its per-step checks are ``training_step``'s).

        A call nested in another (``evaluate()`` inside ``train()``) finds it all in place."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.nbkit_speedups())
            stack.enter_context(self._trl_router_setting())
            yield

    @contextlib.contextmanager
    def nbkit_speedups(self) -> Iterator[list[Speedup]]:
        """Attach the speedups ``FastSFTConfig`` switches on (``nbkit.speedups.SPEEDUPS``) for the block: the model
        stage to the model and the trainer stage to this trainer; the training events they wait for handed on
        (``_TrainingEvents``); all of them detached, in reverse, when it ends."""
        if self._nbkit_active:  # nested (evaluate() inside train()): already attached
            yield self._speedups
            return
        path = self.nbkit_path
        packed = path.packed
        self._nbkit_active = True
        self._speedups = []
        try:
            for stage, target in (("model", self.model), ("trainer", self)):
                for speedup in speedups.build(stage, self.args, packed, self.train_dataset, path):
                    if speedup.attach(target):
                        self._speedups.append(speedup)
            self.nbkit_attached = self.active_speedups
            self._training_events.speedups = self._speedups
            yield self._speedups
        finally:
            self.nbkit_attached = self.active_speedups
            runner = next((s for s in self._speedups if s.name == speedups.LAYERS), None)
            if runner is not None:
                self.nbkit_layer_stats = runner.stats()
            self._training_events.speedups = []
            for speedup in reversed(self._speedups):
                speedup.detach()
            self._speedups = []
            self._nbkit_active = False

    @property
    def active_speedups(self) -> list[str]:
        """Names of the switched speedups attached right now and not disengaged by their own first-step decision (the
        always-on ones, ``speedups.ALWAYS_ON``, are not a choice and not listed)."""
        names = []
        for s in self._speedups:
            modes = getattr(s, "engaged_modes", None)
            if modes is not None:
                names += modes()
            elif getattr(s, "engaged", True) and s.name not in speedups.ALWAYS_ON:
                names.append(f"{s.name}({s.kernel})" if getattr(s, "kernel", None) else s.name)
        return names

    @contextlib.contextmanager
    def _trl_router_setting(self) -> Iterator[None]:
        """MoE ``output_router_logits``: TRL's value inside the block, the one before it after."""
        if self._nbkit_router is None:
            yield
            return
        config, _, trl_value = self._nbkit_router
        before = config.output_router_logits  # nested (evaluate() inside train()): TRL's value already
        config.output_router_logits = trl_value
        try:
            yield
        finally:
            config.output_router_logits = before


def _compute_dtype(model: Any) -> torch.dtype:
    """The dtype ``model``'s matmuls run in without mixed precision: a quantized base's compute dtype, else the dtype
    most of its frozen floating-point weights hold, else its own."""
    base = unwrap_model(model)
    quantization = getattr(getattr(base, "config", None), "quantization_config", None)
    compute = getattr(quantization, "bnb_4bit_compute_dtype", None) if quantization is not None else None
    if isinstance(quantization, dict):
        compute = quantization.get("bnb_4bit_compute_dtype")
    if isinstance(compute, str):
        compute = getattr(torch, compute.replace("torch.", ""), None)
    if isinstance(compute, torch.dtype):
        return compute
    sizes: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point():
            sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    if sizes:
        return max(sizes, key=sizes.__getitem__)
    return getattr(base, "dtype", torch.float32)


def _router_setting(model: Any, given_by_name: bool = False) -> tuple[Any, Any, Any] | None:
    """(the text config, the user's ``output_router_logits``, its value now) of a MoE model; None for other models.

    ``given_by_name``: TRL loaded the model and set the value already; the user's is the config class's default.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return None
    text_config = config.get_text_config()
    if not hasattr(text_config, "output_router_logits"):
        return None
    user = text_config.output_router_logits
    if given_by_name:
        try:
            user = bool(getattr(type(text_config)(), "output_router_logits", False))
        except Exception:  # a config class that cannot be built without arguments
            user = False
    return text_config, user, text_config.output_router_logits
