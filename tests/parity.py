"""The parity harness of the CPU tests: tiny models, LoRA, N steps recorded, and two runs compared.

Why: every optimization is held to the plain path by a parity test (CONTRIBUTING.md, Tests). Those tests all build
the same things -- a tiny model of a family from a config in code, LoRA on it, a few training steps (a trainer's, or
forward and backward by hand) -- record the same things, and compare two such runs. They are built, recorded and
compared here, once, so that a test states only what differs between its two paths and its tolerance.

Contract:

- Building. ``tiny_lm`` is ``nbkit.demo.models.tiny_model`` (a family's config shrunk, weights from a seeded RNG,
  the global RNG untouched), sized to a tokenizer when one is given. ``add_lora`` wraps a model in PEFT LoRA (rank
  ``r``, alpha ``2 r``, dropout 0) with A drawn from a seeded RNG, and B, which PEFT starts at zero, optionally drawn
  too (``random_b``) so that every gradient path counts. ``fast_sft`` builds a FastSFT (or TRL's SFTTrainer) on a
  tiny model, the demo tokenizer and demo data, with the CPU fp32 settings the tests share (``TINY_RUN``).
- Recording. A ``Run`` holds per step the loss and the gradients of every parameter that got one (fp32 copies), and
  the trainable weights at the end. ``run_steps`` drives a model by hand (per batch: zero_grad, forward, backward);
  ``train`` runs a trainer, its gradients caught before each optimizer step (``StepGrads``) when asked.
- Comparing. ``assert_same_run(got, want)`` compares the losses and the gradients of every step, and the weights when
  a tolerance is passed for them; ``assert_same_tensors`` and ``assert_same_series`` compare one dict of tensors or
  one list of numbers. Both sides must hold the same names and steps, and something. The default tolerance is
  ``BITWISE`` (``torch.equal``): right where both paths run the same kernels in the same order, or the optimized one
  restores the same bytes. Pass ``Tol(rtol=, atol=)`` (elementwise, as ``torch.testing.assert_close``:
  ``|got - want| <= atol + rtol |want|``) where a path sums the same terms in another order, or ``Tol(scaled=)``
  (per tensor ``max |got - want| <= scaled * max |want|``) where small entries carry only rounding. A failure names
  the step, the parameter and the gap. ``assert_same_batches(plain, fast)`` compares two trainers' collators and
  first batches (the same type, keys and values).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from nbkit.demo.models import tiny_model

VOCAB = 97  # the vocabulary of tiny models that need no tokenizer


# ---------------------------------------------------------------------------------------------------------------
# tolerances


@dataclass(frozen=True)
class Tol:
    """How close ``got`` must be to ``want``: bitwise (the default), elementwise (``rtol``, ``atol``), or ``scaled``
    (the largest gap over the largest ``|want|`` of the tensor or series)."""

    rtol: float = 0.0
    atol: float = 0.0
    scaled: Optional[float] = None

    def __str__(self) -> str:
        if self.scaled is not None:
            return f"max gap <= {self.scaled:g} x max |want|"
        if self.rtol == self.atol == 0:
            return "bitwise"
        return f"|gap| <= {self.atol:g} + {self.rtol:g} |want|"

    def tensors(self, got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
        """Whether ``got`` is within this tolerance of ``want``, and the gap (scaled: relative; else the largest)."""
        g, w = got.detach().float(), want.detach().float()
        gap = float((g - w).abs().max()) if w.numel() else 0.0
        if self.scaled is not None:
            rel = float((g - w).abs().max() / w.abs().max().clamp_min(1e-12)) if w.numel() else 0.0
            return rel <= self.scaled, rel
        if self.rtol == self.atol == 0:
            return torch.equal(got, want), gap
        return torch.equal(got, want) or bool(((g - w).abs() <= self.atol + self.rtol * w.abs()).all()), gap

    def numbers(self, got: float, want: float, largest: float) -> bool:
        """Whether the number ``got`` is within this tolerance of ``want`` (``largest``: the series' max |want|)."""
        if self.scaled is not None:
            return abs(got - want) <= self.scaled * max(largest, 1e-12)
        if self.rtol == self.atol == 0:
            return got == want
        return got == want or abs(got - want) <= self.atol + self.rtol * abs(want)


BITWISE = Tol()


# ---------------------------------------------------------------------------------------------------------------
# building


def tiny_lm(family: str = "qwen3", vocab_size: int = VOCAB, *, tokenizer: Any = None, seed: int = 0,
            **overrides: Any) -> torch.nn.Module:
    """``nbkit.demo.models.tiny_model(family, ...)``; with a ``tokenizer``: its vocabulary, pad and eos ids."""
    if tokenizer is not None:
        vocab_size = len(tokenizer)
        overrides = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, **overrides}
    return tiny_model(family, vocab_size, seed=seed, **overrides)


def lora_config(r: int = 4, alpha: Optional[int] = None, targets: Any = "all-linear", **config: Any):
    """PEFT's ``LoraConfig``: rank ``r``, alpha ``2 r`` unless given, dropout 0 (a random mask differs per path)."""
    from peft import LoraConfig

    return LoraConfig(**{"r": r, "lora_alpha": alpha or 2 * r, "target_modules": targets, "lora_dropout": 0.0,
                         **config})


def add_lora(model: torch.nn.Module, r: int = 4, alpha: Optional[int] = None, targets: Any = "all-linear", *,
             seed: int = 0, random_b: Optional[float] = None, **config: Any) -> torch.nn.Module:
    """``model`` wrapped in LoRA (``lora_config``), A drawn from ``seed`` (PEFT draws from the global RNG, which is
    left as found); ``random_b``: B drawn from N(0, random_b) too, instead of PEFT's zeros."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(model, lora_config(r, alpha, targets, **config))
    if random_b is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator).mul_(random_b).to(p.dtype))
    return model


TINY_RUN: dict[str, Any] = dict(
    max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1, report_to=[],
    save_strategy="no", use_cpu=True, bf16=False, packing=True, max_length=96, dataloader_num_workers=0,
    disable_tqdm=True,
)
"""The settings every tiny CPU run shares (fp32, no saves, no reports, a log per step); ``fast_sft`` takes others."""


def fast_sft(output_dir: Any, *, family: str = "qwen3", model: Optional[torch.nn.Module] = None, lora: Any = True,
             tokenizer: Any = None, dataset: Any = None, rows: int = 64, trainer_cls: Any = None, config_cls: Any = None,
             seed: int = 0, **settings: Any):
    """A trainer (FastSFT unless ``trainer_cls``) on ``model`` (default: ``tiny_lm(family)`` for the tokenizer),
    the demo tokenizer and ``dataset`` (default: ``rows`` demo conversations), with ``TINY_RUN`` updated by
    ``settings``. ``lora``: True for ``lora_config()``, a ``LoraConfig``, or None/False for a full fine-tune. The
    global RNG is seeded first (PEFT draws LoRA A from it). Other trainer arguments (eval_dataset, callbacks, ...)
    go in ``settings`` too when they are not config fields."""
    from trl import SFTConfig

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.tokenizer import load_demo_tokenizer

    trainer_cls = trainer_cls or FastSFT
    config_cls = config_cls or (FastSFTConfig if issubclass(trainer_cls, FastSFT) else SFTConfig)
    tokenizer = tokenizer if tokenizer is not None else load_demo_tokenizer()
    if model is None:
        model = tiny_lm(family, tokenizer=tokenizer, seed=seed)
    kwargs = {k: settings.pop(k) for k in ("eval_dataset", "callbacks", "data_collator") if k in settings}
    args = {**TINY_RUN, "output_dir": str(output_dir), "seed": seed, **settings}
    if issubclass(config_cls, FastSFTConfig):
        args.setdefault("live_dashboard", False)
    if lora is True:
        lora = lora_config()
    torch.manual_seed(seed)
    return trainer_cls(model=model, args=config_cls(**args), processing_class=tokenizer,
                       train_dataset=dataset if dataset is not None else make_dataset("messages", n=rows),
                       peft_config=lora or None, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# recording


@dataclass
class Run:
    """What a run did: per step its loss and gradients, its trainable weights at the end, and, from a trainer, the
    logged entries of its training steps (``logged``) and the trainer itself."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    logged: list[dict[str, Any]] = field(default_factory=list)
    trainer: Any = None


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient the model holds, as fp32 copies."""
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights, as fp32 copies on the CPU."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


@functools.cache
def _step_grads() -> type:
    from transformers import TrainerCallback

    class StepGrads(TrainerCallback):
        """The gradients of every optimizer step (fp32 copies: bf16 runs compare to fp32 tolerances), before the
        step; ``steps`` holds one dict per step."""

        def __init__(self) -> None:
            self.steps: list[dict[str, torch.Tensor]] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.steps.append(gradients(model))

    return StepGrads


def __getattr__(name: str) -> Any:
    # StepGrads is made on first use: transformers' callbacks import PEFT, which model-level tests never need
    if name == "StepGrads":
        return _step_grads()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lm_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The model's own loss of ``batch`` (which holds the labels)."""
    return model(**batch).loss


def run_steps(model: torch.nn.Module, batches: Iterable[Any], *,
              forward: Callable[[torch.nn.Module, Any], torch.Tensor] = lm_loss,
              backward: Callable[[torch.Tensor], Any] = torch.Tensor.backward) -> Run:
    """Per batch: the gradients cleared, ``forward(model, batch)`` (a loss), ``backward(loss)``; the loss and the
    gradients recorded. No optimizer step: the weights stay (they are recorded at the end all the same)."""
    losses, grads = [], []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss = forward(model, batch)
        backward(loss)
        losses.append(loss.item())
        grads.append(gradients(model))
    return Run(losses, grads, trainable(model))


def train(trainer: Any, *, grads: bool = False) -> Run:
    """``trainer.train()``: the logged loss of each step, the gradients of each optimizer step when ``grads``, the
    trainable weights at the end."""
    caught = _step_grads()()
    if grads:
        trainer.add_callback(caught)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return Run([h["loss"] for h in logged], caught.steps, trainable(trainer.model), logged, trainer)


# ---------------------------------------------------------------------------------------------------------------
# comparing


def max_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest of each tensor's max |a - b| over its max |b|."""
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)) for n in b)


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: Tol = BITWISE,
                        where: str = "") -> dict[str, float]:
    """Every tensor of ``want`` matched by ``got``'s of the same name, shape and dtype, within ``tol``; the same
    names on both sides, and at least one. Returns the gap per name (relative for a ``scaled`` tolerance)."""
    at = f"{where}: " if where else ""
    assert got.keys() == want.keys(), (f"{at}names differ: only in got {sorted(set(got) - set(want))[:4]}, "
                                       f"only in want {sorted(set(want) - set(got))[:4]}")
    assert want, f"{at}nothing to compare"
    gaps = {}
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, f"{at}{name}: {g.dtype} {tuple(g.shape)} against " \
                                                          f"{w.dtype} {tuple(w.shape)}"
        ok, gaps[name] = tol.tensors(g, w)
        assert ok, f"{at}{name}: gap {gaps[name]:.3g}, allowed {tol}"
    return gaps


def assert_same_series(got: list[float], want: list[float], tol: Tol = BITWISE, what: str = "loss") -> None:
    """Two lists of numbers (a value per step) of the same length, not empty, equal within ``tol``."""
    assert len(got) == len(want) > 0, f"{what}: {len(got)} steps against {len(want)}: {got} / {want}"
    largest = max(abs(w) for w in want)
    for step, (g, w) in enumerate(zip(got, want), 1):
        ok = tol.numbers(g, w, largest) and not (math.isnan(g) or math.isnan(w))
        assert ok, f"{what} of step {step}: {g!r} against {w!r}, gap {abs(g - w):.3g}, allowed {tol}; " \
                   f"all: {got} / {want}"


def assert_same_run(got: Run, want: Run, *, losses: Optional[Tol] = BITWISE, grads: Optional[Tol] = BITWISE,
                    weights: Optional[Tol] = None) -> None:
    """Two runs alike: the losses of every step, the gradients of every step, the final weights, each within its
    tolerance (None: not compared; weights are not compared unless a tolerance is given)."""
    if losses is not None:
        assert_same_series(got.losses, want.losses, losses)
    if grads is not None:
        assert len(got.grads) == len(want.grads) > 0, \
            f"gradients of {len(got.grads)} steps against {len(want.grads)} (train(..., grads=True) records them)"
        for step, (g, w) in enumerate(zip(got.grads, want.grads), 1):
            assert_same_tensors(g, w, grads, where=f"gradient of step {step}")
    if weights is not None:
        assert_same_tensors(got.weights, want.weights, weights, where="final weight")


# ---------------------------------------------------------------------------------------------------------------
# batches


def first_batch(trainer: Any) -> dict[str, Any]:
    """The first batch of the trainer's own training data loader."""
    return next(iter(trainer.get_train_dataloader()))


def assert_same_batches(plain: Any, fast: Any, rows: int = 4) -> None:
    """``fast``'s collator is of ``plain``'s type and returns the same batch for the same ``rows`` prepared rows, and
    both trainers' data loaders start with the same batch: keys, tensors (bitwise) and other values."""
    examples = [plain.train_dataset[i] for i in range(rows)]
    assert type(fast.data_collator) is type(plain.data_collator)
    for ours, theirs in ((fast.data_collator(examples), plain.data_collator(examples)),
                         (first_batch(fast), first_batch(plain))):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value, key
