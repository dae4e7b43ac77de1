"""A decoder's draws on the device: the filters' values, a seeded generator and the noise a step reads.

Why static tensors: a captured step reads its inputs where they were at capture, so the sampling parameters and the
noise live in tensors made once per decoder state and refilled per call (``load``) and per step (``refill``: one
``exponential_`` on the device, no host read). The draw itself is ``nbkit.ops.sampling.sample``.
"""

from __future__ import annotations

import torch

from ..ops import sampling
from .config import GenerationSettings


class Draws:
    """Static sampling inputs for ``rows`` rows over a vocabulary of ``vocab`` tokens on ``device``."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.noise = torch.ones((rows, vocab), dtype=torch.float32, device=device)
        self.params = GenerationSettings(max_new_tokens=1).sampling_tensors(device)
        self.sort = True
        self.generator = torch.Generator(device=device)

    def load(self, settings: GenerationSettings) -> None:
        """This call's filters and seed (the tensors keep their memory: a captured step reads the new values)."""
        for name, value in settings.sampling_tensors(self.noise.device).items():
            self.params[name].copy_(value)
        self.sort = settings.needs_sort
        self.generator.manual_seed(settings.generator_seed())

    def refill(self) -> None:
        """New noise for the next draw."""
        self.noise.exponential_(generator=self.generator)

    def choose(self, logits: torch.Tensor, sort: bool | None = None) -> torch.Tensor:
        """One token a row from ``logits`` (rows, vocab) and the current noise (``sort``: default ``self.sort``)."""
        return sampling.sample(logits, self.noise, sort=self.sort if sort is None else sort, **self.params)
