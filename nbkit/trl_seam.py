"""The seam to TRL, transformers, PEFT and bitsandbytes: every private member nbkit relies on, in one place.

Why: nbkit is a drop-in ``SFTTrainer`` with speedups, so it reaches past the libraries' public API in a few places
(underscore names, classes imported from modules a package does not export, instance attributes set by a
trainer's ``__init__`` or training loop, methods it overrides). None of those is promised to last from one release
to the next; written down here, a release that moves one shows as one failing test (``tests/test_trl_seam.py``
checks each entry against the installed versions: that it exists, and for a method nbkit calls or overrides, the
parameters nbkit passes or takes) instead of as a wrong number in a run.

Contract: ``MEMBERS`` names each private member nbkit relies on, with the nbkit modules that use it and why.
The importable ones are attributes of this module under the name nbkit's modules use (``from ..trl_seam import
DataCollatorForLanguageModeling``), imported on first use: a library missing one raises ``ImportError`` there, as
the plain import would. Attribute and method names nbkit sets or overrides are listed only (the code names them).
``fingerprint`` / ``mirror_differs``: how a speedup that reproduces one library function tells that the installed
release changed it (see ``nbkit.speedups.sync_free_loss``).

Not here: torch's own private calls (``nbkit/ops`` sits below this layer, and each is guarded where it is made), and
what a library documents as public though it lives in a submodule (``tests/test_trl_seam.py`` lists those it allows).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Member:
    """One private member: ``where`` is ``"module:Qualified.name"``.

    ``kind``: "import" (nbkit imports or reads it), "call" (a method or function nbkit calls), "override" (a method
    nbkit's trainer overrides; ``params`` empty, the test compares nbkit's override with it), "trainer" (an instance
    attribute of the trainer during training), "model" (an attribute of a model, its decoder layers or its config).
    ``params``: the parameters nbkit passes, in its order (positional calls name them as the library does).
    ``optional``: nbkit checks for it and keeps its plain path when absent (the test still expects it here).
    """

    where: str
    kind: str
    users: tuple[str, ...]
    why: str
    params: tuple[str, ...] = ()
    optional: bool = False

    @property
    def module(self) -> str:
        return self.where.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.where.partition(":")[2]


_SFT = "trl.trainer.sft_trainer:SFTTrainer"
_TRAINER = "transformers.trainer:Trainer"
_TRL_UTILS = "trl.trainer.utils"

MEMBERS: tuple[Member, ...] = (
    # -- TRL --------------------------------------------------------------------------------------------------------
    Member("trl.trainer.sft_trainer:DataCollatorForLanguageModeling", "import",
           ("trainer", "speedups.packed_attention"),
           "SFTTrainer's collator (not exported by trl): FastSFT recognizes the one TRL built and rebuilds it "
           "padding-free for cached packing; PackedCollator wraps it"),
    Member(f"{_SFT}._prepare_dataset", "call", ("reliability.trainer_mixin",),
           "tokenizes the user's rows exactly as training did, to name the row behind a non-finite loss",
           ("dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name")),
    Member(f"{_SFT}._metrics", "trainer", ("speedups.sync_free_loss",),
           "the per-mode metric lists TRL averages at each log: sync_free_metrics appends device tensors to them"),
    Member(f"{_SFT}._total_train_tokens", "trainer", ("speedups.sync_free_loss", "dashboard.callback"),
           "TRL's running token count: sync_free_metrics adds to it without a host read; the dashboard shows it"),
    Member(f"{_SFT}._tp_size", "trainer", ("speedups.sync_free_loss",),
           "the tensor-parallel size TRL divides the token count by"),
    Member(f"{_SFT}.compute_loss", "call", ("speedups.sync_free_loss",),
           "mirrored by sync_free_metrics (checked by its source fingerprint) and its fallback",
           ("model", "inputs", "return_outputs", "num_items_in_batch")),
    Member(f"{_TRL_UTILS}:_use_triton", "call", ("speedups.labelled_head",),
           "whether TRL's fused head selects labelled positions on this device (else it scores every position)",
           ("device",)),
    Member(f"{_TRL_UTILS}:_CHUNKED_LOGPROB_CHUNK_SIZE", "import", ("speedups.labelled_head",),
           "the chunk size TRL's fused head runs its kernel with: the labelled head uses the same"),
    Member(f"{_TRL_UTILS}:maybe_gather_lm_head_ctx", "call", ("speedups.labelled_head",),
           "the context TRL's head gathers a sharded LM head in", ("params",)),
    Member(f"{_TRL_UTILS}:FusedCausalLMOutput", "call", ("speedups.labelled_head",),
           "the output TRL's fused head returns; the labelled head returns the same fields",
           ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask", "aux_loss")),
    Member(f"{_TRL_UTILS}:add_fused_lm_head", "import", ("speedups.labelled_head",),
           "the patch whose closure (``_fused_forward``: backbone_attr, temperature, ...) the labelled head reads"),
    Member("trl.kernels:ChunkedLogProbFunction.forward", "call", ("speedups.labelled_head",),
           "TRL's chunked log-prob kernel, called with TRL's settings over the host-listed positions",
           ("ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
            "logit_scale", "outputs")),
    # -- transformers: the trainer ------------------------------------------------------------------------------------
    Member(f"{_TRAINER}._save_checkpoint", "override", ("reliability.trainer_mixin",),
           "atomic checkpoints: transformers' checkpoint written into a staging folder, then renamed whole"),
    Member(f"{_TRAINER}._get_output_dir", "override", ("reliability.trainer_mixin",),
           "points transformers' checkpoint writer at the staging folder"),
    Member(f"{_TRAINER}._init_training_state", "override", ("reliability.trainer_mixin",),
           "a resumed run already at max_steps trains no further step"),
    Member(f"{_TRAINER}._tr_loss", "trainer", ("reliability.trainer_mixin",),
           "the loss accumulated since the last log, for logging_nan_inf_filter's replacement of a non-finite loss"),
    Member(f"{_TRAINER}._globalstep_last_logged", "trainer", ("reliability.trainer_mixin",),
           "the step of the last log, with _tr_loss"),
    Member(f"{_TRAINER}._clip_grad_norm", "call", ("speedups.step_walks",),
           "step_walks sets its clip over the trainable parameters on the trainer instance; transformers' is the "
           "fallback", ("model",)),
    Member(f"{_TRAINER}._has_mixed_mesh_grads", "call", ("speedups.step_walks",),
           "mixed-mesh gradients keep transformers' own clip", ("model",), optional=True),
    Member(f"{_TRAINER}.floating_point_ops", "call", ("speedups.step_flops",),
           "mirrored by step_flops (6 x tokens x parameters without embeddings), checked by its source fingerprint",
           ("inputs",)),
    Member("transformers.trainer_utils:rotate_checkpoints", "call", ("reliability.trainer_mixin",),
           "the checkpoint rotation atomic saves run after renaming a staged checkpoint (keywords)",
           ("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime")),
    Member("transformers.trainer_utils:PREFIX_CHECKPOINT_DIR", "import", ("reliability.trainer_mixin",),
           "the name of transformers' checkpoint folders"),
    Member("transformers.utils.notebook:NotebookProgressCallback", "import", ("dashboard.callback",),
           "the notebook progress bar the dashboard replaces"),
    # -- transformers: models ---------------------------------------------------------------------------------------
    Member("transformers.modeling_layers:GradientCheckpointingLayer", "import", ("model_parts",),
           "the base class of decoder layers: how nbkit finds a model's layers"),
    Member("transformers.modeling_layers:GradientCheckpointingLayer._gradient_checkpointing_func", "model",
           ("speedups.layer_runner", "speedups.offload"),
           "the per-layer checkpoint function transformers sets (the user's kwargs bound in); the layer runner calls "
           "it itself for the layers its plan keeps checkpointed, and the offload reads its kwargs"),
    Member("transformers.modeling_utils:PreTrainedModel._can_set_attn_implementation", "call",
           ("speedups.packed_attention",), "whether a model dispatches its attention through AttentionInterface"),
    Member("transformers.configuration_utils:PretrainedConfig._attn_implementation", "model",
           ("speedups.packed_attention", "speedups.layer_runner", "decode.graphed"),
           "the attention a model runs (read; set through set_attn_implementation)"),
    Member("transformers.configuration_utils:PretrainedConfig._experts_implementation", "model", ("speedups.moe",),
           "the experts implementation a MoE model runs"),
    Member("transformers.configuration_utils:PretrainedConfig._experts_implementation_internal", "model",
           ("speedups.moe",), "the field behind _experts_implementation, set on sub-configs the model's setter misses"),
    Member("transformers.modeling_utils:PreTrainedModel._tp_size", "model", ("speedups.moe",),
           "tensor-parallel models keep their own experts", optional=True),
    Member("transformers.modeling_utils:PreTrainedModel._tied_weights_keys", "model", ("export.source",),
           "the weights tied to others, left out of a merged export", optional=True),
    Member("transformers.integrations.moe:_default_apply_gate", "import", ("speedups.moe",),
           "tells a SwiGLU experts gate from others"),
    Member("transformers.integrations.moe:ALL_EXPERTS_FUNCTIONS", "import", ("speedups.moe",),
           "the registry nbkit's experts forward is registered in"),
    Member("transformers.integrations.moe:ExpertsInterface", "import", ("speedups.moe",),
           "registers nbkit's experts forward under 'nbkit'"),
    Member("transformers.models.gpt_oss.modeling_gpt_oss:GptOssExperts._apply_gate", "import", ("speedups.moe",),
           "tells gpt-oss's clamped gate from others"),
    Member("transformers.activations:SiLUActivation", "import", ("speedups.moe",),
           "the activation of a SwiGLU experts gate"),
    Member("transformers.cache_utils:DynamicLayer", "import", ("decode.graphed",),
           "the cache layer graphed decoding subclasses (update, get_seq_length, get_mask_sizes, get_max_length)"),
    Member("transformers.masking_utils:ALL_MASK_ATTENTION_FUNCTIONS", "import", ("decode.graphed",),
           "graphed decoding registers its attention with the original's masks"),
    Member("transformers.integrations.gguf.gguf_tokenizer_mapping:GGUF_PRE_TOKENIZER_SPLITS", "import",
           ("export.gguf_vocab",), "llama.cpp's pre-tokenizer names by split pattern", optional=True),
    # -- PEFT -------------------------------------------------------------------------------------------------------
    Member("peft.tuners.lora.layer:Linear", "import", ("speedups.fused_lora",), "PEFT's LoRA Linear the fused "
           "LoRA kernel replaces the forward of"),
    Member("peft.tuners.lora.bnb:Linear4bit", "import", ("speedups.fused_lora",), "PEFT's LoRA over a 4-bit Linear"),
    Member("peft.tuners.lora.layer:ParamWrapper", "import", ("speedups.moe",),
           "PEFT's LoRA on expert parameters, read as low-rank factors per expert", optional=True),
    Member("peft.tuners.lora:LoraLayer", "import", ("decode.dense_weights",), "finds the LoRA layers to merge for decoding"),
    Member("peft.tuners.tuners_utils:BaseTunerLayer", "import", ("decode.dense_weights", "decode.shared"),
           "any PEFT tuner layer (its base layer, its adapters)"),
    Member("peft.utils.constants:EMBEDDING_LAYER_NAMES", "import", ("loading",),
           "the module names PEFT treats as embeddings: whether a LoRA model trains a tied embedding"),
    Member("peft.utils.integrations:dequantize_module_weight", "call", ("decode.dense_weights",),
           "a 4-bit base weight dequantized for the dense decoding copy", ("module",)),
    # -- bitsandbytes -------------------------------------------------------------------------------------------------
    Member("bitsandbytes.functional:_convert_weight_packed_for_cpu_inverse", "call", ("loading",),
           "undoes bitsandbytes' CPU inference repacking, which the backward cannot use", ("packed_weight", "quant_state")),
)

# the names nbkit's modules import from here, and where each comes from
_IMPORTS = {
    "DataCollatorForLanguageModeling": "trl.trainer.sft_trainer:DataCollatorForLanguageModeling",
    "_use_triton": f"{_TRL_UTILS}:_use_triton",
    "_CHUNKED_LOGPROB_CHUNK_SIZE": f"{_TRL_UTILS}:_CHUNKED_LOGPROB_CHUNK_SIZE",
    "maybe_gather_lm_head_ctx": f"{_TRL_UTILS}:maybe_gather_lm_head_ctx",
    "FusedCausalLMOutput": f"{_TRL_UTILS}:FusedCausalLMOutput",
    "ChunkedLogProbFunction": "trl.kernels:ChunkedLogProbFunction",
    "GradientCheckpointingLayer": "transformers.modeling_layers:GradientCheckpointingLayer",
    "_default_apply_gate": "transformers.integrations.moe:_default_apply_gate",
    "ALL_EXPERTS_FUNCTIONS": "transformers.integrations.moe:ALL_EXPERTS_FUNCTIONS",
    "ExpertsInterface": "transformers.integrations.moe:ExpertsInterface",
    "GptOssExperts": "transformers.models.gpt_oss.modeling_gpt_oss:GptOssExperts",
    "SiLUActivation": "transformers.activations:SiLUActivation",
    "DynamicLayer": "transformers.cache_utils:DynamicLayer",
    "ALL_MASK_ATTENTION_FUNCTIONS": "transformers.masking_utils:ALL_MASK_ATTENTION_FUNCTIONS",
    "NotebookProgressCallback": "transformers.utils.notebook:NotebookProgressCallback",
    "GGUF_PRE_TOKENIZER_SPLITS": "transformers.integrations.gguf.gguf_tokenizer_mapping:GGUF_PRE_TOKENIZER_SPLITS",
    "LoraLinear": "peft.tuners.lora.layer:Linear",
    "LoraLinear4bit": "peft.tuners.lora.bnb:Linear4bit",
    "ParamWrapper": "peft.tuners.lora.layer:ParamWrapper",
    "LoraLayer": "peft.tuners.lora:LoraLayer",
    "BaseTunerLayer": "peft.tuners.tuners_utils:BaseTunerLayer",
    "dequantize_module_weight": "peft.utils.integrations:dequantize_module_weight",
    "EMBEDDING_LAYER_NAMES": "peft.utils.constants:EMBEDDING_LAYER_NAMES",
    "_convert_weight_packed_for_cpu_inverse": "bitsandbytes.functional:_convert_weight_packed_for_cpu_inverse",
}


def lookup(where: str) -> Any:
    """The object at ``"module:Qualified.name"``; ``ImportError`` when the module or any part of the name is gone."""
    module_name, _, qualname = where.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        try:
            obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
        except AttributeError:
            raise ImportError(f"cannot import {where}: {part!r} is not there in this release") from None
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
    return obj


def __getattr__(name: str) -> Any:
    """``from nbkit.trl_seam import NAME``: the library object, imported on first use."""
    where = _IMPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return lookup(where)


# -- mirrored functions ---------------------------------------------------------------------------------------------
def fingerprint(func: Any) -> str:
    """A short hash of ``func``'s source, without its docstring, comments, blank lines and indentation: equal for two
    releases whose code is the same, whatever their formatting; pure text processing, so the same on every Python.
    ``"unavailable"`` where the source cannot be read."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return "unavailable"
    return source_fingerprint(source)


def source_fingerprint(source: str) -> str:
    """``fingerprint`` of one function's source text (a ``def``, its decorators, its body)."""
    source = textwrap.dedent(source)
    lines = source.splitlines()
    node = ast.parse(source).body[0]
    body = getattr(node, "body", None) or []
    doc = body[0] if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
        and isinstance(body[0].value.value, str) else None
    skip = set(range(doc.lineno - 1, doc.end_lineno)) if doc is not None and doc.end_lineno is not None else set()
    kept = []
    for i, line in enumerate(lines):
        text = line.strip()
        if i in skip or not text or text.startswith("#"):
            continue
        kept.append(text)
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def mirror_differs(mirrors: dict[str, frozenset[str]]) -> list[str]:
    """The members of ``mirrors`` (``where`` -> the fingerprints of the releases a speedup reproduces) whose
    installed code has another fingerprint; empty when the speedup may run."""
    return [where for where, known in mirrors.items() if _fingerprint_of_current(where) not in known]


def _fingerprint_of_current(where: str) -> str:
    """The fingerprint of what is installed at ``where`` now (cached per object: a patched attribute is read anew)."""
    try:
        obj = lookup(where)
    except ImportError:
        return "missing"
    return _fingerprint_cached(inspect.unwrap(getattr(obj, "__func__", obj)))


@functools.lru_cache(maxsize=64)
def _fingerprint_cached(func: Any) -> str:
    return fingerprint(func)
