"""The path every model takes: ``model.generate`` with the config ``chat`` built, seeded where a seed is given.

Contract, the same three calls as the fast paths: ``check`` (always None: ``generate`` decodes anything the model
does), ``prepare`` (nothing to make), ``generate`` (the new tokens of each row, pads after a stop included, as
``generate`` returns them). Sampling with ``settings.seed`` runs under ``torch.manual_seed(seed)`` with torch's
global random state put back afterwards, so its tokens are ``generate``'s own for that seed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .config import GenerationSettings


@contextlib.contextmanager
def seeded(settings: GenerationSettings | None, device: torch.device) -> Iterator[None]:
    """torch's global generators seeded with ``settings.seed`` inside (CPU, and ``device``'s when CUDA), as they
    were outside; nothing changes without a seed."""
    if settings is None or settings.seed is None or not settings.sampling:
        yield
        return
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(settings.seed))
        yield


class PlainDecoder:
    """``model.generate``, behind the interface the fast paths share."""

    reported = False  # nothing to report: this path always applies

    def check(self, model: torch.nn.Module, total_len: int, batch: int = 1) -> str | None:
        return None

    def prepare(self, model: torch.nn.Module, total_len: int, batch: int = 1) -> None:
        return None

    def release(self) -> None:
        return None

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, input_ids: torch.Tensor, config: Any,
                 attention_mask: torch.Tensor | None = None, streamer: Any = None,
                 settings: GenerationSettings | None = None, **model_kwargs: Any) -> list[list[int]]:
        """The new tokens of each row of ``input_ids`` (B, P) under the transformers ``config``."""
        with seeded(settings, input_ids.device):
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                 streamer=streamer, **model_kwargs)
        return out[:, input_ids.shape[1]:].tolist()
