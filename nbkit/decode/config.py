"""The one generation config every decoding path reads: greedy or sampling, how many tokens, the seed.

Why one: ``chat``'s three paths (the dense copy, the graphed step, ``model.generate``) must decode the same thing
from the same arguments; each reads a ``GenerationSettings`` and the transformers ``GenerationConfig`` built from it
(stop ids, pad id), and nothing else.

Contract of ``GenerationSettings``:
- ``do_sample=None`` samples when any of ``temperature``, ``top_p``, ``top_k``, ``min_p`` is given, and decodes
  greedily otherwise; ``temperature=0`` is greedy (as llama.cpp and Unsloth's users write it).
- Sampling follows transformers' processors in ``generate``'s order: temperature, top-k (``None`` or 0: off; unlike
  ``generate``, whose unset ``top_k`` is 50), top-p (1.0: off), min-p (``None`` or 0: off).
- ``seed``: the draws repeat for the same seed on the same path; ``None`` draws the generator's seed from torch's
  global generator (so ``torch.manual_seed`` makes a run repeat too). On the ``generate`` path the seed is set as
  ``torch.manual_seed(seed)`` before ``generate`` (torch's global state is restored afterwards), so its tokens are
  ``generate``'s own for that seed.
- Greedy decoding is exactly what it was before sampling existed: ``greedy_config``'s transformers config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..model_parts import unwrap_model
from ..reliability.stop_token import stop_token_ids

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


@dataclass(frozen=True)
class GenerationSettings:
    """How to pick each new token (see the module docstring)."""

    max_new_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    do_sample: bool | None = None

    def __post_init__(self) -> None:
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {self.max_new_tokens}")
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], not {self.min_p}")
        if self.top_k is not None and (int(self.top_k) != self.top_k or self.top_k < 0):
            raise ValueError(f"top_k must be a whole number >= 0, not {self.top_k}")
        if self.sampling and self.temperature == 0:
            raise ValueError("do_sample=True with temperature=0: pass a temperature above 0, or do_sample=False")

    @property
    def sampling(self) -> bool:
        """Whether tokens are drawn (else the argmax)."""
        if self.do_sample is not None:
            return bool(self.do_sample)
        if self.temperature == 0:
            return False
        return any(v is not None for v in (self.temperature, self.top_p, self.top_k, self.min_p))

    @property
    def needs_sort(self) -> bool:
        """Whether top-k or top-p filter (they sort the vocabulary; min-p alone does not)."""
        return bool(self.top_k) or (self.top_p is not None and self.top_p < 1.0)

    def generator_seed(self) -> int:
        """The seed of this call's generator: ``seed``, else a draw from torch's global generator."""
        if self.seed is not None:
            return int(self.seed)
        return int(torch.randint(0, 2**62, (), dtype=torch.long))

    def sampling_tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The filters' values as the tensors ``nbkit.ops.sampling.sample`` reads (off: their neutral values)."""
        values = {
            "temperature": (float(self.temperature or 1.0), torch.float32),
            "top_k": (int(self.top_k or 2**62), torch.long),
            "top_p": (float(self.top_p if self.top_p is not None else 1.0), torch.float32),
            "min_p": (float(self.min_p or 0.0), torch.float32),
        }
        return {name: torch.tensor([v], dtype=dtype, device=device) for name, (v, dtype) in values.items()}


def greedy_config(model: torch.nn.Module, tokenizer: Any, max_new_tokens: int) -> Any:
    """The model's generation config for greedy decoding that stops at the template's end-of-turn token."""
    base = unwrap_model(model)
    config = copy.deepcopy(base.generation_config)
    config.do_sample = False
    for name in _SAMPLING_FIELDS:  # unused when greedy; cleared so generate does not warn about them
        if hasattr(config, name):
            setattr(config, name, None)
    stops = stop_token_ids(tokenizer, base.generation_config)
    config.eos_token_id = stops or None
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or [None])[0]
    config.max_new_tokens = max_new_tokens
    config.use_cache = True
    return config


def chat_config(model: torch.nn.Module, tokenizer: Any, settings: GenerationSettings) -> Any:
    """The transformers config ``chat`` decodes with: ``greedy_config``, or with sampling its filters set to
    ``settings``' (top-k 0 when off, so ``generate``'s default of 50 does not apply)."""
    config = greedy_config(model, tokenizer, settings.max_new_tokens)
    if settings.sampling:
        config.do_sample = True
        config.temperature = float(settings.temperature or 1.0)
        config.top_k = int(settings.top_k or 0)
        config.top_p = float(settings.top_p if settings.top_p is not None else 1.0)
        config.min_p = float(settings.min_p) if settings.min_p else None
    return config


def batch_config(model: torch.nn.Module, tokenizer: Any, max_new_tokens: int) -> Any:
    """What ``generate_answers``' batches decode with: greedy, the tokenizer's eos and pad ids."""
    config = copy.deepcopy(unwrap_model(model).generation_config)
    config.do_sample, config.max_new_tokens, config.use_cache = False, max_new_tokens, True
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    return config
