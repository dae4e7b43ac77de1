"""``load_model``: a causal LM ready for (Q)LoRA fine-tuning, and its tokenizer, in one call.

Decisions, and why:

- **Compute dtype by compute capability** (``pick_compute_dtype``): bf16 on sm80+ (A100, L4, H100...), fp16 on
  older GPUs (the T4 of free Colab/Kaggle is sm75; ``torch.cuda.is_bf16_supported()`` says True there because
  bf16 is emulated, which is slow, so it is not asked), fp32 on CPU (no fast half-precision matmuls there).
- **4-bit base = NF4 with double quantization** (the QLoRA recipe): NF4 suits normally distributed weights, and
  quantizing the quantization constants saves ~0.4 bit per weight. Matmuls run in the compute dtype.
- **``prepare_model_for_kbit_training`` only when the compute dtype is not bf16.** It upcasts every non-4-bit
  weight (embeddings, norms, lm_head) to fp32: needed for fp16 (norms and fp16 gradient scaling are fragile) and
  free on CPU (already fp32), but in bf16 it only costs memory (a 150K-token vocabulary's embedding and lm_head
  in fp32 is ~3 GB on a 14B model) for no accuracy that matters. In bf16 the base is frozen directly instead.
- **LoRA on every linear projection of the blocks** (``target_modules="all-linear"``: q, k, v, o, gate, up, down
  in a Llama-like block; PEFT leaves the output layer out). On MoE models PEFT keeps the transformers-4 meaning
  of "all-linear": the fused experts (LoRA on the 3-D expert weights) and the router are adapted too.
  ``lora_alpha`` defaults to ``lora_r`` (scale alpha/r = 1), a common, safe default.
- **Gradient checkpointing, non-reentrant**: the reentrant variant needs the inputs to require grad (a hook on
  the embeddings) and breaks with frozen inputs; non-reentrant needs neither. ``use_cache`` is turned off with it.
- **Device**: the current CUDA device when there is one (bitsandbytes quantizes as weights land there), else CPU
  (bitsandbytes >= 0.45 runs NF4 on CPU).
- **Pad token** (``load_tokenizer``): kept if the tokenizer has one; else a dedicated pad-like token already in the
  vocabulary (Llama 3.1's ``<|finetune_right_pad_id|>``, ``<pad>``, ...), else ``unk``, else ``eos``. A token is never
  added: that would need a resized embedding, which a 4-bit checkpoint cannot get cleanly.
- **4-bit on CPU stays trainable after an eval** (``keep_4bit_trainable``): bitsandbytes 0.50, on CPUs with
  AVX512-BF16, repacks a 4-bit layer's weight for fast inference the first time it runs in eval mode without
  grad, and from then on its matmul has no backward, even in train mode: generating before training silently
  drops the gradient through the frozen base (the model still trains, badly). Models loaded here keep the
  trainable layout (inference on CPU is a little slower).
- **Not found**: a name that is neither a local folder nor reachable (cache, or the Hub when online) raises
  ``ModelNotFoundError`` (an ``OSError``) naming the model and what to do. With ``HF_HUB_OFFLINE=1`` this is
  immediate; online, huggingface_hub's own retries apply (about 25 s without DNS).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .compat import enable_activation_checkpointing, quiet_peft_wrap
from .settings import check_length, pick_compute_dtype

logger = logging.getLogger(__name__)

# Pad-like tokens some tokenizers have without declaring a pad token, best first.
_PAD_CANDIDATES = ("<|finetune_right_pad_id|>", "<|pad|>", "<pad>", "[PAD]", "<|padding|>", "<|endoftext|>")


class ModelNotFoundError(OSError):
    """The model (or its tokenizer) could not be found locally, in the cache, or (when online) on the Hub."""


def _is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in {"1", "true", "yes", "on"}


def _looks_like_path(name: str) -> bool:
    """A Hub id is "name" or "owner/name"; anything else is meant as a folder."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


_WHAT = {"model": "model", "weights": "the weights of model", "tokenizer": "the tokenizer of model"}


def _not_found(name: str, what: str, error: BaseException) -> ModelNotFoundError:
    if _looks_like_path(name):
        hint = (
            f"It looks like a path, but no loadable {what} is there: check the path, and that the folder was "
            "written with save_pretrained."
        )
    elif _is_offline():
        hint = (
            "HF_HUB_OFFLINE=1 is set, so nothing is downloaded and it is not in the local Hugging Face cache. "
            "Pass the path of a local folder holding config.json and the weights (one saved with "
            "save_pretrained), download it once while online, or unset HF_HUB_OFFLINE."
        )
    else:
        hint = (
            "It is not a local folder, not in the Hugging Face cache, and the Hub could not provide it: check the "
            "repo id, your network, and (for gated or private models) `huggingface-cli login` / HF_TOKEN. "
            "Or pass the path of a local folder saved with save_pretrained."
        )
    return ModelNotFoundError(f"Could not load {_WHAT[what]} {name!r}. {hint} ({type(error).__name__}: {error})")


def _load_config(name: str, trust_remote_code: bool, hub_kwargs: dict[str, Any]):
    """The model's config; the first file fetched, so a missing model fails here, fast and clearly."""
    from transformers import AutoConfig

    if _looks_like_path(name) and not os.path.isdir(os.path.expanduser(name)):
        raise _not_found(name, "model", FileNotFoundError(f"no such folder: {name}"))
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **hub_kwargs)
    except ModelNotFoundError:
        raise
    except (OSError, ValueError) as error:  # OSError covers huggingface_hub's HTTP and cache errors
        raise _not_found(name, "model", error) from error


def set_pad_token(tokenizer) -> None:
    """Give ``tokenizer`` a pad token if it has none (see the module docstring for the order); never adds one."""
    if tokenizer.pad_token is not None:
        return
    vocab = tokenizer.get_vocab()
    for candidate in _PAD_CANDIDATES:
        if candidate in vocab and candidate != tokenizer.eos_token:
            tokenizer.pad_token = candidate
            return
    if tokenizer.unk_token is not None:
        tokenizer.pad_token = tokenizer.unk_token
    elif tokenizer.eos_token is not None:
        # Safe with TRL (labels come from the data, not from pad positions); with collators that mask every pad
        # id in the labels it would also mask the real eos, so the model would not learn to stop.
        tokenizer.pad_token = tokenizer.eos_token
    else:
        raise ValueError(
            f"{type(tokenizer).__name__} has no pad, unk or eos token to pad with: set tokenizer.pad_token to a "
            "token of its vocabulary"
        )


def load_tokenizer(
    name_or_path: str, trust_remote_code: bool = False, max_seq_length: int | None = None, **kwargs: Any
):
    """The tokenizer of ``name_or_path`` with a pad token (``set_pad_token``) and, if given, ``max_seq_length``."""
    from transformers import AutoTokenizer

    check_length("max_seq_length", max_seq_length)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as error:
        raise _not_found(name_or_path, "tokenizer", error) from error
    set_pad_token(tokenizer)
    if max_seq_length is not None:
        tokenizer.model_max_length = max_seq_length
    return tokenizer


def keep_4bit_trainable(model: torch.nn.Module) -> int:
    """Stop bitsandbytes' CPU inference repacking on ``model``'s 4-bit layers (undoing any already done).

    See the module docstring for why. Returns the number of layers changed. Scoped to these modules; the
    attribute set is the one bitsandbytes itself reads (``support_avx512bf16_for_cpu``).
    """
    try:
        from bitsandbytes.nn import Linear4bit

        from .trl_seam import _convert_weight_packed_for_cpu_inverse
    except ImportError:
        return 0
    changed = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit):
            continue
        state = getattr(module.weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            # private in bitsandbytes 0.50, but the only way back to the layout the backward needs
            module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                module.weight.data, state
            )
            changed += 1
        elif getattr(module, "support_avx512bf16_for_cpu", False):
            changed += 1
        module.support_avx512bf16_for_cpu = False
    return changed


def _resolve_dtype(dtype: str | torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    if dtype == "auto":
        return compute_dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.replace("torch.", ""), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype={dtype!r}: use 'auto', a torch dtype, or its name ('bfloat16', ...)")
        return resolved
    return dtype


def load_model(
    name_or_path: str,
    load_in_4bit: bool = True,
    lora_r: int | None = 16,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    max_seq_length: int | None = None,
    dtype: str | torch.dtype = "auto",
    gradient_checkpointing: bool = True,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    device_map: Any = None,
    modules_to_save: list[str] | None = None,
    **from_pretrained_kwargs: Any,
) -> tuple[torch.nn.Module, Any]:
    """Load ``name_or_path`` (a local folder or a Hub id) for (Q)LoRA training; return ``(model, tokenizer)``.

    - ``load_in_4bit``: NF4 double-quantized base (QLoRA); else the base in ``dtype``.
    - ``lora_r``: LoRA rank on ``target_modules``; ``None`` or 0 returns the base without adapters, every weight
      trainable (full fine-tuning; not possible on a 4-bit base).
    - ``lora_alpha``: defaults to ``lora_r``. ``modules_to_save``: modules trained in full beside the adapters
      (e.g. ``["embed_tokens", "lm_head"]`` when the vocabulary must move, as for a new chat format).
    - ``dtype``: ``"auto"`` = ``pick_compute_dtype()``; also the dtype of the weights that stay unquantized.
    - ``max_seq_length``: recorded as ``tokenizer.model_max_length``; a warning if beyond the model's positions.
      A positive int or None (``nbkit.settings.length_problem``, the rule ``FastSFTConfig.max_length`` follows),
      checked before anything is loaded: ``SettingError`` (a ``ValueError``) otherwise.
    - Everything else goes to ``AutoModelForCausalLM.from_pretrained``.

    Raises ``ModelNotFoundError`` when the model cannot be found (see the module docstring).
    """
    from transformers import AutoModelForCausalLM

    check_length("max_seq_length", max_seq_length)
    if load_in_4bit and not lora_r:
        raise ValueError("a 4-bit base cannot be trained in full: pass lora_r > 0, or load_in_4bit=False")
    hub_keys = ("revision", "token", "cache_dir")
    hub_kwargs = {k: from_pretrained_kwargs[k] for k in hub_keys if k in from_pretrained_kwargs}
    config = _load_config(name_or_path, trust_remote_code, hub_kwargs)

    if device_map is None and torch.cuda.is_available():
        device_map = {"": torch.cuda.current_device()}
    device = next(iter(device_map.values())) if isinstance(device_map, dict) and device_map else None
    compute_dtype = pick_compute_dtype(device if isinstance(device, (int, torch.device)) else None)
    weights_dtype = _resolve_dtype(dtype, compute_dtype)

    kwargs: dict[str, Any] = dict(config=config, dtype=weights_dtype, trust_remote_code=trust_remote_code)
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if load_in_4bit:
        try:
            import importlib

            from transformers import BitsAndBytesConfig

            importlib.import_module("bitsandbytes")
        except ImportError as error:
            raise ImportError("load_in_4bit=True needs bitsandbytes: pip install bitsandbytes") from error
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    kwargs.update(from_pretrained_kwargs)
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as error:  # config found but weights missing (e.g. an incomplete folder)
        raise _not_found(name_or_path, "weights", error) from error

    if load_in_4bit:
        keep_4bit_trainable(model)
    tokenizer = load_tokenizer(
        name_or_path, trust_remote_code=trust_remote_code, max_seq_length=max_seq_length, **hub_kwargs
    )
    _sync_special_tokens(model, tokenizer)
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_seq_length is not None and limit is not None and max_seq_length > limit:
        logger.warning(
            "max_seq_length=%d exceeds %s's max_position_embeddings=%d; no RoPE scaling is applied",
            max_seq_length, name_or_path, limit,
        )  # fmt: skip

    if load_in_4bit and compute_dtype != torch.bfloat16:
        from peft import prepare_model_for_kbit_training

        # freezes the base and upcasts unquantized weights to fp32; checkpointing is enabled below (non-reentrant
        # needs no input-grad hook), under the name this transformers uses
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    elif lora_r:
        model.requires_grad_(False)
    if gradient_checkpointing:
        enable_activation_checkpointing(model, {"use_reentrant": False})
    if gradient_checkpointing:
        model.config.use_cache = False  # the cache is useless in training and conflicts with checkpointing

    if lora_r:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=lora_r,
            lora_alpha=lora_r if lora_alpha is None else lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=target_modules,
            modules_to_save=modules_to_save,
            # tied embeddings stay tied when one is trained; PEFT warns if asked where none is (or on an untied model)
            ensure_weight_tying=_trains_tied_embedding(model, modules_to_save, target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        with quiet_peft_wrap():  # PEFT reads a checkpointing name transformers deprecated
            model = get_peft_model(model, lora_config)
    return model, tokenizer


def _trains_tied_embedding(model: torch.nn.Module, modules_to_save: list[str] | None,
                           target_modules: str | list[str] | None) -> bool:
    """Whether the model ties its input embedding and output head and the adapter trains one of them (in
    ``modules_to_save`` or ``target_modules``, named as PEFT's own tying check names them): only then has PEFT's
    ``ensure_weight_tying`` anything to tie, and asked otherwise it warns."""
    import re

    from .trl_seam import EMBEDDING_LAYER_NAMES

    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return False
    if isinstance(target_modules, str):  # a regex over module names, or "all-linear" (which leaves the head out)
        targeted = any(re.fullmatch(target_modules, name) for name in EMBEDDING_LAYER_NAMES)
    else:
        targeted = any(name.split(".")[-1] in EMBEDDING_LAYER_NAMES for name in target_modules or [])
    return targeted or any(name.split(".")[-1] in EMBEDDING_LAYER_NAMES for name in modules_to_save or [])


def _sync_special_tokens(model: torch.nn.Module, tokenizer) -> None:
    """Make the model's config and generation config agree with the tokenizer's pad (and eos if unset)."""
    configs = [model.config.get_text_config(), model.config]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        configs.append(generation_config)
    for config in configs:
        config.pad_token_id = tokenizer.pad_token_id
        if getattr(config, "eos_token_id", None) is None and tokenizer.eos_token_id is not None:
            config.eos_token_id = tokenizer.eos_token_id
