"""``FastLanguageModel`` (and ``FastModel``): Unsloth's loading calls over ``nbkit.loading``.

Why: a notebook written for Unsloth loads in two calls, ``from_pretrained`` (the base) and ``get_peft_model`` (the
adapters), with Unsloth's argument names; these keep the calls and run nbkit's loader under them.

Contract:

- ``FastLanguageModel.from_pretrained(model_name, max_seq_length=None, dtype=None, load_in_4bit=True, token=None,
  load_in_8bit=False, full_finetuning=False, ...)``: ``nbkit.loading.load_base`` -- the base, frozen (every weight
  trainable with ``full_finetuning``), and its tokenizer; a saved adapter folder gives its base with the adapter.
  ``load_in_8bit=True`` and vLLM's ``fast_inference`` say by name that they are not supported; an unknown keyword
  is nbkit's ``TypeError`` naming the one meant.
- ``FastLanguageModel.get_peft_model(model, r=16, target_modules=[...], lora_alpha=16, lora_dropout=0, bias="none",
  use_gradient_checkpointing="unsloth", random_state=3407, use_rslora=False, loftq_config=None,
  modules_to_save=None)``: ``nbkit.loading.add_lora``, with checkpointing as asked (True and ``"unsloth"``:
  non-reentrant checkpointing; FastSFT's ``offload_checkpointing`` switch is what offloads). ``FastModel``'s
  ``finetune_attention_modules`` / ``finetune_mlp_modules`` pick the projections when ``target_modules`` is not given;
  ``finetune_vision_layers=True`` is not supported (text models only). A model that already has adapters is
  returned as it is, with a warning.
- ``for_inference(model)``: eval mode, KV cache on; ``for_training(model)``: train mode, cache off. Both return the
  model.
- The models these return carry Unsloth's saving methods (``nbkit.unsloth.saving``), and their ``generate`` also
  takes ``input_ids=`` a ``BatchEncoding`` (what ``apply_chat_template(tokenize=True, return_tensors="pt")`` gives
  in transformers 5; a tensor in the transformers 4 Unsloth's notebooks were written for): only these objects, not
  every model nbkit loads.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import torch

from ..loading import add_lora, check_arguments, load_base, set_checkpointing
from ..loading import gradient_checkpointing_value as checkpointing_value
from . import saving

logger = logging.getLogger(__name__)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

_FROM_PRETRAINED_ARGS = ("model_name", "max_seq_length", "dtype", "load_in_4bit", "load_in_8bit", "full_finetuning",
                         "token", "device_map", "trust_remote_code", "attn_implementation", "revision", "cache_dir")
_PEFT_ARGS = ("r", "target_modules", "lora_alpha", "lora_dropout", "bias", "use_gradient_checkpointing",
              "random_state", "use_rslora", "loftq_config", "modules_to_save", "max_seq_length",
              "finetune_vision_layers", "finetune_language_layers", "finetune_attention_modules",
              "finetune_mlp_modules")


class FastLanguageModel:
    """Unsloth's loading entry point, over nbkit's loader (module docstring)."""

    @staticmethod
    def from_pretrained(model_name: str = "unsloth/Llama-3.2-1B-Instruct", max_seq_length: Optional[int] = None,
                        dtype: Any = None, load_in_4bit: bool = True, token: Optional[str] = None,
                        load_in_8bit: bool = False, full_finetuning: bool = False, **kwargs: Any) -> tuple[Any, Any]:
        """The base model (frozen unless ``full_finetuning``) and its tokenizer."""
        if load_in_8bit:
            raise TypeError("FastLanguageModel.from_pretrained(): load_in_8bit=True is not supported: 8-bit "
                            "(LLM.int8) bases are not; use load_in_4bit=True (NF4) or load_in_4bit=False (16-bit)")
        check_arguments("FastLanguageModel.from_pretrained", kwargs, _FROM_PRETRAINED_ARGS)
        if token is not None:
            kwargs["token"] = token
        model, tokenizer = load_base(model_name, load_in_4bit=load_in_4bit and not full_finetuning,
                                     max_seq_length=max_seq_length, dtype=dtype,
                                     gradient_checkpointing=full_finetuning, full_finetuning=full_finetuning,
                                     **kwargs)
        return _accept_encoded_inputs(saving.attach(model)), tokenizer

    @staticmethod
    def get_peft_model(model: Any, r: int = 16, target_modules: Optional[Sequence[str] | str] = None,
                       lora_alpha: int = 16, lora_dropout: float = 0.0, bias: str = "none",
                       use_gradient_checkpointing: bool | str = "unsloth", random_state: Optional[int] = 3407,
                       use_rslora: bool = False, loftq_config: Any = None,
                       modules_to_save: Optional[list[str]] = None, max_seq_length: Optional[int] = None,
                       finetune_vision_layers: bool = False, finetune_language_layers: bool = True,
                       finetune_attention_modules: bool = True, finetune_mlp_modules: bool = True,
                       **kwargs: Any) -> Any:
        """``model`` with LoRA adapters (nbkit's ``add_lora``) and checkpointing as asked."""
        check_arguments("FastLanguageModel.get_peft_model", kwargs, _PEFT_ARGS)
        if kwargs:
            raise TypeError(f"FastLanguageModel.get_peft_model(): {sorted(kwargs)} are from_pretrained's, not "
                            "get_peft_model's")
        if finetune_vision_layers:
            raise TypeError("get_peft_model(): finetune_vision_layers=True is not supported: nbkit trains text "
                            "models (vision towers are left out)")
        if hasattr(model, "peft_config"):
            logger.warning("get_peft_model: the model already has LoRA adapters (a saved adapter was loaded); "
                           "training goes on with those")
            return _accept_encoded_inputs(saving.attach(model))
        if target_modules is None:
            if not finetune_language_layers:
                raise ValueError("get_peft_model(): finetune_language_layers=False leaves nothing to train")
            target_modules = (ATTENTION if finetune_attention_modules else []) + (MLP if finetune_mlp_modules else [])
            if not target_modules:
                raise ValueError("get_peft_model(): neither attention nor MLP modules chosen: nothing to train")
        set_checkpointing(model, checkpointing_value(use_gradient_checkpointing))
        if max_seq_length is not None:
            logger.info("get_peft_model: max_seq_length is from_pretrained's (and the trainer's) here")
        peft = add_lora(model, r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
                        modules_to_save=modules_to_save, bias=bias, use_rslora=use_rslora,
                        loftq_config=loftq_config, random_state=random_state)
        return _accept_encoded_inputs(saving.attach(peft))

    @staticmethod
    def for_inference(model: torch.nn.Module) -> torch.nn.Module:
        """Eval mode with the KV cache on, for ``model.generate``."""
        model.eval()
        for config in _configs(model):
            config.use_cache = True
        return model

    @staticmethod
    def for_training(model: torch.nn.Module, use_gradient_checkpointing: bool = True) -> torch.nn.Module:
        """Train mode with the KV cache off (checkpointing, set when loaded, stays as it was)."""
        model.train()
        for config in _configs(model):
            config.use_cache = False
        return model


FastModel = FastLanguageModel


def _generate(model: Any, *args: Any, **kwargs: Any) -> Any:
    encoded = kwargs.get("input_ids")
    if isinstance(encoded, Mapping):  # transformers 5's apply_chat_template(tokenize=True) gives a BatchEncoding
        kwargs = {**kwargs, **encoded}
    return type(model).generate(model, *args, **kwargs)


def _accept_encoded_inputs(model: Any) -> Any:
    """``model.generate(input_ids=tokenizer.apply_chat_template(..., return_tensors="pt"))``, as Unsloth's notebooks
    (written for transformers 4, where that call gives a tensor) call it, on this model object only."""
    model.generate = types.MethodType(_generate, model)
    return model


def _configs(model: torch.nn.Module) -> list[Any]:
    config = getattr(model, "config", None)
    return [c for c in (config, getattr(model, "generation_config", None)) if c is not None]


def is_bfloat16_supported() -> bool:
    """Whether nbkit computes in bf16 here (sm80+ GPUs; not a T4, where bf16 is emulated, nor the CPU)."""
    from ..settings import pick_compute_dtype

    return pick_compute_dtype() == torch.bfloat16
