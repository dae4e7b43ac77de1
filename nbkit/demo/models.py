"""Tiny models of real architectures, built from configs in code (no download).

Tests, benchmarks and the demo need models that exercise each family's real code path (grouped-query attention,
sliding windows, soft-capping, attention sinks, MoE routing) yet run in milliseconds on a CPU. Every family here
keeps its own defaults for what makes it special and shrinks only the sizes:

- hidden 128, 4 layers, 4 query heads and 2 key/value heads (GQA) of head_dim 32, MLP 256;
- sliding windows of 16 tokens, so that short test documents already cross a window edge;
- alternating sliding/full layers where the family alternates (gemma2, gemma3, gpt_oss);
- MoE: 4 experts, 2 per token.

``tiny_config(family, vocab_size, **overrides)`` returns the config; ``tiny_model`` builds a randomly initialised
model from it with its own seeded RNG (the caller's global RNG is left untouched).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

SLIDING_WINDOW = 16

_COMMON: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)

# Per family: the transformers model_type and what differs from _COMMON. Entries are what a real checkpoint of the
# family has (Gemma ties embeddings and soft-caps; Mistral slides everywhere), scaled down.
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # q/k/v biases are built into the qwen2 modeling code
    "qwen3": ("qwen3", {}),  # q/k RMS norms
    "mistral": ("mistral", {"sliding_window": SLIDING_WINDOW}),
    "gemma2": (
        "gemma2",
        {
            "tie_word_embeddings": True,
            "sliding_window": SLIDING_WINDOW,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 32,
            "_alternate": True,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "tie_word_embeddings": True,
            "sliding_window": SLIDING_WINDOW,
            "query_pre_attn_scalar": 32,
            "_alternate": True,
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True},
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128}),
    "gpt_oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "sliding_window": SLIDING_WINDOW,
            # YaRN as in the real model, with the original context shrunk so factor * original == 2048 positions
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
            "_alternate": True,
        },
    ),
}

FAMILIES: tuple[str, ...] = tuple(_FAMILIES)
MOE_FAMILIES: tuple[str, ...] = ("qwen3_moe", "mixtral", "gpt_oss")


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """A small config of ``family`` (one of ``FAMILIES``) with ``vocab_size`` tokens; ``overrides`` win over all.

    Special-token ids a family defaults to (e.g. Gemma's pad=0, bos=2, eos=1) are dropped when they do not fit in
    ``vocab_size``; pass ``pad_token_id`` / ``bos_token_id`` / ``eos_token_id`` to match a tokenizer.
    """
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}: choose one of {', '.join(FAMILIES)}")
    model_type, extra = _FAMILIES[family]
    kwargs = {**_COMMON, **extra, "vocab_size": vocab_size}
    alternate = kwargs.pop("_alternate", False)
    kwargs.update(overrides)
    if alternate and "layer_types" not in overrides:
        # sliding, full, sliding, full ...: both kinds appear even with 2 layers (the real default patterns of
        # gemma3 -- 5 sliding then 1 full -- would leave a 4-layer model with no full-attention layer)
        kwargs["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(kwargs["num_hidden_layers"])
        ]
    config = AutoConfig.for_model(model_type, **kwargs)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if key not in overrides and isinstance(value, int) and not 0 <= value < vocab_size:
            setattr(config, key, None)
    return config


def tiny_model(
    family: str, vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> torch.nn.Module:
    """A randomly initialised causal LM of ``tiny_config(family, vocab_size, **overrides)``, in ``dtype``.

    The same ``seed`` gives the same weights; the global torch RNG is not consumed.
    """
    config = tiny_config(family, vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()  # like from_pretrained; Trainer switches to train mode itself
