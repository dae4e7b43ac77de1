"""Logit comparisons between two models on the same prompts: how an export proves it kept the model.

Figures, over every position of every prompt (logits in float32):
- ``max_abs``: the largest absolute difference;
- ``rel``: ``max_abs`` divided by the largest absolute reference logit (a scale-free figure: a model whose logits
  span +-30 and one whose logits span +-0.3 get comparable numbers);
- ``top1``: the share of positions whose argmax token agrees.

``check`` raises ``ExportCheckError`` when ``rel`` is past the stated tolerance, so an export that changed the
model fails loudly instead of writing a file that answers differently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Reverse the words: red fox moon",
)


class ExportCheckError(RuntimeError):
    """An exported model's logits differ from the reference's by more than the stated tolerance."""


@dataclass
class LogitCheck:
    """One comparison: the figures, the tolerance on ``rel`` (None: informational), and whether it passed."""

    what: str
    max_abs: float
    rel: float
    top1: float
    tolerance: float | None
    positions: int

    @property
    def ok(self) -> bool:
        return self.tolerance is None or self.rel <= self.tolerance

    def line(self) -> str:
        bound = f" (tolerance {self.tolerance:.1e}: {'ok' if self.ok else 'FAILED'})" if self.tolerance else ""
        return (f"{self.what}: max |diff| {self.max_abs:.3e}, relative {self.rel:.3e}, top-1 agreement "
                f"{self.top1:.1%} over {self.positions} positions{bound}")

    def as_dict(self) -> dict:
        return dict(asdict(self), ok=self.ok)


def prompt_batches(tokenizer: Any, prompts: Sequence[str] | None = None) -> list[list[int]]:
    """Token ids of each prompt, as a chat turn with its answer's start when the tokenizer has a template."""
    rows = []
    for text in prompts or DEFAULT_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
            ids = list(enc["input_ids"])
        else:
            ids = tokenizer(text)["input_ids"]
        rows.append(ids)
    return rows


@torch.no_grad()
def logits_of(model: torch.nn.Module, rows: list[list[int]]) -> list[torch.Tensor]:
    """Float32 logits (on the CPU) of ``model`` for each row of ids, one forward per row (no padding)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        return [model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu() for ids in rows]
    finally:
        model.train(was_training)


def compare(what: str, reference: list[torch.Tensor], other: list[torch.Tensor],
            tolerance: float | None) -> LogitCheck:
    ref, got = torch.cat(reference), torch.cat(other)
    if ref.shape != got.shape:
        raise ExportCheckError(f"{what}: logits of shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    diff = (ref - got).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(ref.abs().max()) or 1.0
    top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean()) if ref.numel() else 1.0
    return LogitCheck(what, max_abs, max_abs / scale, top1, tolerance, int(ref.shape[0]))


def check(result: LogitCheck) -> LogitCheck:
    """``result``, after printing its line; raises ``ExportCheckError`` if it failed its tolerance."""
    print(result.line(), flush=True)
    if not result.ok:
        raise ExportCheckError(
            f"{result.line()}. The exported model does not reproduce the reference; nothing it wrote should be used."
        )
    return result
