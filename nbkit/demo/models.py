"""Tiny models of real architectures, built from configs in code (no download).

Tests, benchmarks and the demo need models that exercise each family's real code path (grouped-query attention,
sliding windows, soft-capping, attention sinks, MoE routing) yet run in milliseconds on a CPU. Every family here
keeps its own defaults for what makes it special and shrinks only the sizes:

- hidden 128, 4 layers, 4 query heads and 2 key/value heads (GQA) of head_dim 32, MLP 256;
- sliding windows of 16 tokens, so that short test documents already cross a window edge;
- alternating sliding/full layers where the family alternates (gemma2, gemma3, gpt_oss);
- MoE: 4 experts, 2 per token.

``tiny_config(family, vocab_size, **overrides)`` returns the config; ``tiny_model`` builds a randomly initialised
model from it with its own seeded RNG (the caller's global RNG is left untouched); ``build_base`` saves one, sized to
the shipped demo tokenizer, with that tokenizer, as a folder any ``from_pretrained`` call loads.

``TINY_RECIPE`` is how such a model is trained so that it learns the demo task: ``python -m nbkit demo``'s defaults,
and what the notebooks use when they train a tiny model. A random-init model learns the skill as a sudden drop of the
loss (it learns to copy from the prompt) after 100-200 optimizer steps, whatever the tokens per step: the recipe is
many small steps at a high learning rate, with the embeddings and head trained in full beside LoRA (a random base
has no token representations for LoRA to steer). Fewer, larger steps do not make up for it: 60 steps of 4 x 512
tokens (more tokens than the recipe's 300 x 2 x 256) end at a few percent exact match.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
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


def build_base(folder: Path | str, family: str, seed: int) -> Any:
    """Save a random tiny ``family`` model and the demo tokenizer to ``folder``; return the tokenizer."""
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tokenizer = load_demo_tokenizer()
    model = tiny_model(
        family,
        vocab_size=len(tokenizer),
        seed=seed,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return tokenizer


@dataclass(frozen=True)
class Recipe:
    """Training settings: optimizer steps, peak learning rate, packed rows per step, tokens per packed row, and the
    modules trained in full beside LoRA."""

    max_steps: int
    learning_rate: float
    batch_size: int
    max_length: int
    modules_to_save: tuple[str, ...] = ()

    def but(self, **given: Any) -> Recipe:
        """This recipe with each ``given`` value that is not None in place of its own (notebook parameters left at
        None keep the recipe's)."""
        return dataclasses.replace(self, **{key: value for key, value in given.items() if value is not None})


TINY_RECIPE = Recipe(max_steps=300, learning_rate=3e-3, batch_size=2, max_length=256,
                     modules_to_save=("embed_tokens", "lm_head"))
