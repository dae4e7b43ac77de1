"""``chat``: talk to the model you just trained (the entry point notebooks import; the code is ``nbkit.decode``).

``chat(model, tokenizer, "question")`` streams a greedy answer; ``temperature=``, ``top_p=``, ``top_k=``,
``min_p=`` and ``seed=`` sample instead. See ``nbkit.decode.chat`` for the contract.
"""

from __future__ import annotations

import torch

from .decode.chat import Answer, answer, chat, prompt_ids
from .decode.choose import decoders_of, dense_reason, release_decoders
from .decode.config import GenerationSettings, greedy_config
from .decode.dense import DenseDecoder


def dense_decoder(model: torch.nn.Module) -> DenseDecoder:
    """The dense decoder kept for ``model`` (made on first use)."""
    return decoders_of(model).dense


__all__ = ["Answer", "GenerationSettings", "answer", "chat", "decoders_of", "dense_decoder", "dense_reason",
           "greedy_config", "prompt_ids", "release_decoders"]
