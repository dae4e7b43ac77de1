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
from pathlib import Path
from typing import Any, Optional, Sequence

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


def _near_folder(name: str) -> Optional[str]:
    """A folder next to where ``name`` points whose name is close to it (a typo of a local folder taken for a Hub
    id, e.g. "tiny-modle" for "tiny-model"); None when none is."""
    import difflib

    parent, base = os.path.split(os.path.expanduser(name.rstrip("/")))
    try:
        names = [e.name for e in os.scandir(parent or ".") if e.is_dir()]
    except OSError:
        return None
    close = difflib.get_close_matches(base, names, n=1, cutoff=0.8)
    return os.path.join(parent, close[0]) if close else None


def _not_found(name: str, what: str, error: BaseException) -> ModelNotFoundError:
    near = None if os.path.isdir(os.path.expanduser(name)) else _near_folder(name)
    if near is not None:
        hint = f"There is no folder {name!r} here, but there is {near!r}: did you mean that one?"
    elif _looks_like_path(name):
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
            "repo id, your network, and (for gated or private models) `hf auth login` / HF_TOKEN. "
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


# keyword arguments ``from_pretrained`` itself reads (beyond its signature); anything else would reach the model's
# ``__init__`` as a TypeError that names neither load_model nor the argument meant
_FROM_PRETRAINED_KEYS = frozenset({
    "adapter_kwargs", "adapter_name", "device_mesh", "distributed_config", "experts_implementation",
    "generation_config", "gguf_file", "kernel_config", "key_mapping", "low_cpu_mem_usage", "max_memory",
    "offload_buffers", "offload_folder", "offload_state_dict", "output_loading_info", "proxies", "quantization_config",
    "state_dict", "subfolder", "tp_plan", "tp_size", "use_kernels", "variant",
})
# names other libraries use for one of load_model's arguments -> the name here
_ALIASES = {
    "lora_r": "r", "rank": "r", "lora_rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout",
    "torch_dtype": "dtype", "max_length": "max_seq_length", "max_len": "max_seq_length", "model_id": "model_name",
    "model": "model_name", "pretrained_model_name_or_path": "model_name", "seed": "random_state",
    "lora_bias": "bias", "use_rs_lora": "use_rslora",
}
# Unsloth's arguments this loader does not have, and what to do instead
_UNSUPPORTED = {
    "load_in_8bit": "8-bit (LLM.int8) bases are not supported: use load_in_4bit=True (NF4) or load_in_4bit=False "
                    "(16-bit)",
    "fast_inference": "vLLM inference is not supported: chat and generation use nbkit.chat / model.generate",
    "max_lora_rank": "is vLLM's (fast_inference), which is not supported",
    "gpu_memory_utilization": "is vLLM's (fast_inference), which is not supported",
}
_UNSET: Any = object()


def _pretrained_keys() -> set[str]:
    import inspect

    from transformers import PreTrainedModel

    return set(inspect.signature(PreTrainedModel.from_pretrained).parameters) | _FROM_PRETRAINED_KEYS


def check_arguments(function: str, given: dict[str, Any], own: Sequence[str]) -> None:
    """Raise nbkit's ``TypeError`` for a keyword ``function`` does not take, naming the one meant where it can.

    ``own``: ``function``'s own argument names; ``given``: the extra keywords, which may only be ``from_pretrained``'s.
    """
    import difflib

    allowed = _pretrained_keys()
    for name in given:
        if name in allowed:
            continue
        if name in _UNSUPPORTED:
            raise TypeError(f"{function}(): {name}= is not supported: {_UNSUPPORTED[name]}")
        if name in _ALIASES and _ALIASES[name] in own:
            hint = f"; did you mean {_ALIASES[name]}=?"
        else:
            close = difflib.get_close_matches(name, list(own) + sorted(allowed), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]}=?" if close else ""
        raise TypeError(
            f"{function}() got an unexpected keyword argument {name!r}{hint} (its arguments: {', '.join(own)}; "
            "other keywords go to transformers' from_pretrained, which does not take this one either)"
        )


def gradient_checkpointing_value(value: bool | str) -> bool:
    """Unsloth's ``use_gradient_checkpointing`` (True, False or "unsloth") as on/off; ``ValueError`` otherwise."""
    if value in (True, False):
        return bool(value)
    if value == "unsloth":
        # the same non-reentrant checkpointing; FastSFT's offload_checkpointing switch moves the saved activations to
        # the CPU as Unsloth's "unsloth" mode does
        return True
    raise ValueError(f"use_gradient_checkpointing={value!r}: use True, False or \"unsloth\"")


def adapter_folder(name: str) -> Path | None:
    """The local folder ``name`` when it holds a saved adapter (``adapter_config.json``), else None."""
    folder = Path(name).expanduser()
    return folder if (folder / "adapter_config.json").is_file() else None


def load_base(
    name_or_path: str,
    load_in_4bit: bool = True,
    max_seq_length: int | None = None,
    dtype: str | torch.dtype | None = "auto",
    gradient_checkpointing: bool = True,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    device_map: Any = None,
    full_finetuning: bool = False,
    **from_pretrained_kwargs: Any,
) -> tuple[torch.nn.Module, Any]:
    """The base model, frozen (every weight trainable with ``full_finetuning``), and its tokenizer: no adapters.

    What ``load_model`` adds LoRA to (``add_lora``); loaded, quantized and prepared as the module docstring says.
    A folder holding a saved adapter (``adapter_config.json``) loads its base (named there, found as the export
    finds it) with the adapter on it, trainable, and the tokenizer saved beside the adapter when there is one.
    """
    from transformers import AutoModelForCausalLM

    check_length("max_seq_length", max_seq_length)
    if load_in_4bit and full_finetuning:
        raise ValueError("a 4-bit base cannot be trained in full: pass load_in_4bit=False for full fine-tuning")
    adapter = adapter_folder(name_or_path)
    if adapter is not None:
        return _load_adapter(adapter, load_in_4bit=load_in_4bit, max_seq_length=max_seq_length, dtype=dtype,
                             gradient_checkpointing=gradient_checkpointing, trust_remote_code=trust_remote_code,
                             attn_implementation=attn_implementation, device_map=device_map,
                             **from_pretrained_kwargs)
    hub_keys = ("revision", "token", "cache_dir")
    hub_kwargs = {k: from_pretrained_kwargs[k] for k in hub_keys if k in from_pretrained_kwargs}
    config = _load_config(name_or_path, trust_remote_code, hub_kwargs)

    if device_map is None and torch.cuda.is_available():
        device_map = {"": torch.cuda.current_device()}
    device = next(iter(device_map.values())) if isinstance(device_map, dict) and device_map else None
    compute_dtype = pick_compute_dtype(device if isinstance(device, (int, torch.device)) else None)
    weights_dtype = _resolve_dtype("auto" if dtype is None else dtype, compute_dtype)

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
    elif not full_finetuning:
        model.requires_grad_(False)
    set_checkpointing(model, gradient_checkpointing)
    return model, tokenizer


def set_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Non-reentrant gradient checkpointing on (and the KV cache off, useless in training), or left off."""
    if enabled:
        enable_activation_checkpointing(model, {"use_reentrant": False})
        model.config.use_cache = False  # the cache is useless in training and conflicts with checkpointing


def add_lora(
    model: torch.nn.Module,
    r: int = 16,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    modules_to_save: list[str] | None = None,
    bias: str = "none",
    use_rslora: bool = False,
    loftq_config: Any = None,
    random_state: int | None = None,
) -> torch.nn.Module:
    """``model`` (a frozen base from ``load_base``) with LoRA adapters of rank ``r``: PEFT's ``get_peft_model``.

    ``lora_alpha`` defaults to ``r``; ``bias`` ("none", "all", "lora_only") and ``use_rslora`` (scale alpha/sqrt(r))
    are PEFT's; ``random_state`` seeds the adapters' initialisation (``transformers.set_seed``, as Unsloth does);
    ``loftq_config`` (a dict or PEFT ``LoftQConfig``; None or ``{}``: none) initialises the adapters with LoftQ,
    which needs the base unquantized (PEFT quantizes it itself for that).
    """
    from peft import LoftQConfig, LoraConfig, get_peft_model

    if not r or r < 0:
        raise ValueError(f"r={r!r}: the LoRA rank must be a positive int")
    loftq: dict[str, Any] = {}
    if loftq_config:
        if getattr(getattr(model, "config", None), "quantization_config", None) is not None:
            raise ValueError("loftq_config needs the base unquantized: load it with load_in_4bit=False (LoftQ "
                             "quantizes it itself), or pass loftq_config=None")
        config = loftq_config if isinstance(loftq_config, LoftQConfig) else LoftQConfig(**dict(loftq_config))
        loftq = dict(init_lora_weights="loftq", loftq_config=config)
    if random_state is not None:
        from transformers import set_seed

        set_seed(random_state)
    lora_config = LoraConfig(
        r=r,
        lora_alpha=r if lora_alpha is None else lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        modules_to_save=modules_to_save,
        # tied embeddings stay tied when one is trained; PEFT warns if asked where none is (or on an untied model)
        ensure_weight_tying=_trains_tied_embedding(model, modules_to_save, target_modules),
        bias=bias,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
        **loftq,
    )
    with quiet_peft_wrap():  # PEFT reads a checkpointing name transformers deprecated
        return get_peft_model(model, lora_config)


def _load_adapter(folder: Path, **base_kwargs: Any) -> tuple[torch.nn.Module, Any]:
    """A saved adapter on its base (``adapter_config.json``'s ``base_model_name_or_path``), adapters trainable."""
    from peft import PeftModel

    from .export.source import describe

    source = describe(folder)
    if not source.base:
        raise ValueError(f"{folder / 'adapter_config.json'} names no base model (base_model_name_or_path)")
    model, tokenizer = load_base(source.base, **base_kwargs)
    with quiet_peft_wrap():
        model = PeftModel.from_pretrained(model, str(folder), is_trainable=True)
    if (folder / "tokenizer_config.json").is_file():
        tokenizer = load_tokenizer(str(folder), trust_remote_code=base_kwargs.get("trust_remote_code", False),
                                   max_seq_length=base_kwargs.get("max_seq_length"))
    return model, tokenizer


_LOAD_MODEL_ARGS = (
    "model_name", "load_in_4bit", "r", "lora_alpha", "lora_dropout", "target_modules", "max_seq_length", "dtype",
    "use_gradient_checkpointing", "gradient_checkpointing", "trust_remote_code", "attn_implementation", "device_map",
    "modules_to_save", "bias", "random_state", "use_rslora", "loftq_config", "full_finetuning", "lora_r",
    "name_or_path", "token", "revision", "cache_dir",
)


def load_model(
    name_or_path: str | None = None,
    load_in_4bit: bool = True,
    lora_r: int | None = 16,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    max_seq_length: int | None = None,
    dtype: str | torch.dtype | None = "auto",
    gradient_checkpointing: bool = True,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    device_map: Any = None,
    modules_to_save: list[str] | None = None,
    *,
    model_name: str | None = None,
    r: int | None = _UNSET,
    bias: str = "none",
    use_gradient_checkpointing: bool | str = _UNSET,
    random_state: int | None = None,
    use_rslora: bool = False,
    loftq_config: Any = None,
    full_finetuning: bool = False,
    **from_pretrained_kwargs: Any,
) -> tuple[torch.nn.Module, Any]:
    """Load ``name_or_path`` (a local folder or a Hub id) for (Q)LoRA training; return ``(model, tokenizer)``.

    - ``model_name``: the same as ``name_or_path`` (Unsloth's name; either, as a keyword).
    - ``load_in_4bit``: NF4 double-quantized base (QLoRA); else the base in ``dtype``.
    - ``r`` (or ``lora_r``): LoRA rank on ``target_modules``; ``None`` or 0 (or ``full_finetuning=True``) returns
      the base without adapters, every weight trainable (full fine-tuning; not possible on a 4-bit base).
    - ``lora_alpha``: defaults to the rank. ``modules_to_save``: modules trained in full beside the adapters
      (e.g. ``["embed_tokens", "lm_head"]`` when the vocabulary must move, as for a new chat format). ``bias``,
      ``use_rslora``, ``loftq_config``, ``random_state``: see ``add_lora``.
    - ``dtype``: ``"auto"`` or None = ``pick_compute_dtype()``; also the dtype of the weights that stay unquantized.
    - ``max_seq_length``: recorded as ``tokenizer.model_max_length``; a warning if beyond the model's positions.
      A positive int or None (``nbkit.settings.length_problem``, the rule ``FastSFTConfig.max_length`` follows),
      checked before anything is loaded: ``SettingError`` (a ``ValueError``) otherwise.
    - ``gradient_checkpointing`` (or Unsloth's ``use_gradient_checkpointing``: True, False or "unsloth", which is
      the same non-reentrant checkpointing here; FastSFT's ``offload_checkpointing`` is the offloading part).
    - A folder holding a saved adapter (``adapter_config.json``): its base, named there, with the adapter on it,
      trainable (``load_base``); the LoRA arguments are the adapter's own then.
    - Other keywords go to ``AutoModelForCausalLM.from_pretrained`` if it reads them; any other is a ``TypeError``
      naming the argument meant where it can (``check_arguments``), and Unsloth's ``load_in_8bit=True`` and vLLM
      arguments say they are not supported.

    Raises ``ModelNotFoundError`` when the model cannot be found (see the module docstring).
    """
    if model_name is not None and name_or_path is not None and model_name != name_or_path:
        raise TypeError(f"load_model(): name_or_path={name_or_path!r} and model_name={model_name!r} differ: give one")
    name = model_name if model_name is not None else name_or_path
    if name is None:
        raise TypeError("load_model() needs the model: load_model(\"folder or hub id\") or model_name=...")
    if "load_in_8bit" in from_pretrained_kwargs and not from_pretrained_kwargs["load_in_8bit"]:
        from_pretrained_kwargs.pop("load_in_8bit")  # False: what happens anyway
    check_arguments("load_model", from_pretrained_kwargs, _LOAD_MODEL_ARGS)
    rank = lora_r if r is _UNSET else r
    if full_finetuning:
        rank = None
    checkpointing = gradient_checkpointing if use_gradient_checkpointing is _UNSET else gradient_checkpointing_value(
        use_gradient_checkpointing)
    check_length("max_seq_length", max_seq_length)
    if load_in_4bit and not rank and adapter_folder(name) is None:
        raise ValueError("a 4-bit base cannot be trained in full: pass r (lora_r) > 0, or load_in_4bit=False")
    model, tokenizer = load_base(
        name, load_in_4bit=load_in_4bit, max_seq_length=max_seq_length, dtype=dtype,
        gradient_checkpointing=checkpointing, trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation, device_map=device_map,
        full_finetuning=not rank and adapter_folder(name) is None,
        **from_pretrained_kwargs,
    )  # fmt: skip
    if rank and adapter_folder(name) is None:
        model = add_lora(model, rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules,
                         modules_to_save=modules_to_save, bias=bias, use_rslora=use_rslora,
                         loftq_config=loftq_config, random_state=random_state)
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
