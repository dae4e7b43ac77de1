"""Shared by the parity tests of FastSFT's switches: the LoRA gradients of every optimizer step, and their distance."""

from __future__ import annotations

import torch
from transformers import TrainerCallback


class StepGrads(TrainerCallback):
    """The gradients of every optimizer step (in fp32: bf16 runs compare to fp32 tolerances), before the step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                           if p.grad is not None})


def max_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest of each tensor's max |a - b| over its max |b|."""
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)) for n in b)
