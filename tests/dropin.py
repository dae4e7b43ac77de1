"""The drop-in contract's harness: one behaviour run through TRL's ``SFTTrainer`` and nbkit's ``FastSFT``, compared.

Why: FastSFT promises to be a drop-in ``SFTTrainer``: the same arguments, the same datasets, the same losses, the
same errors. The ``test_dropin_*`` files hold it to that, behaviour by behaviour (the behaviours TRL's own SFT tests
and docs cover). Each test builds the same setup twice, from scratch (a fresh tiny model, a fresh tokenizer, a fresh
dataset: TRL mutates all three), once with ``trl.SFTTrainer`` / ``trl.SFTConfig`` and once with ``nbkit.FastSFT`` /
``nbkit.FastSFTConfig``, and asserts the same outcome.

Contract of the helpers:

- Building. ``tokenizer()`` is nbkit's demo tokenizer (a real byte-level BPE with a ChatML template whose assistant
  turns sit in ``{% generation %}`` marks), loaded fresh. ``tiny(family, tok)`` is a tiny randomly initialised model
  of a real architecture sized to the tokenizer: nbkit's demo families (``nbkit.demo.models``) and the conv/SSM
  hybrids ``HYBRIDS`` (LFM2's short convolutions, Nemotron-H's and Falcon-H1's Mamba-2 mixers, run on
  transformers' pure-torch paths on a CPU) and the other families of TRL's tests (``MORE_FAMILIES``: OLMo 3,
  Cohere 2, GPT-NeoX, GLM-4-MoE). ``dataset(fmt)`` builds a small dataset of a TRL format from the demo
  task: ``text``, ``prompt`` (prompt-completion), ``messages`` (conversational), ``conversational_prompt``
  (conversational prompt-completion) and ``tools`` (conversations with tool calls and a ``tools`` column, read with
  ``TOOLS_TEMPLATE``).
- Running. ``run(kind, out, ...)`` builds the config (``BASE`` updated by the test's settings), the trainer and
  trains, and records an ``Outcome``: the trainer, every parameter before training, the log, or the exception and
  the stage that raised it (``"setup"``: the config or the trainer's constructor; ``"train"``: ``train()``).
  ``both(tmp_path, ...)`` runs SFTTrainer then FastSFT on the same settings.
- Comparing. ``assert_trains(outcome)`` is what TRL's tests check of a run: it finished, logged ``train_loss``, and
  every trainable parameter changed while every frozen one stayed. ``assert_same_outcome(plain, fast)``: when TRL
  raised, FastSFT raised an exception of TRL's type (a subclass is allowed) at the same stage, naming what TRL's
  names; when TRL trained, FastSFT trained the same steps to the same losses (training and evaluation, within
  ``LOSS_TOL``) and the same step metrics (``METRIC_TOLS``), with the same parameters trainable and the same ones
  changed. ``assert_same_batch`` compares two
  collated batches: keys, types, shapes, dtypes and values.

Precision: both configs get the same explicit ``bf16=False, fp16=False`` (fp32) unless a test says otherwise.
``SFTConfig`` defaults to ``bf16=True`` (TRL 1.16, also on a CPU, where it autocasts); ``FastSFTConfig`` picks fp32 on
a CPU. The defaults themselves are part of the contract and have their own test (``test_dropin_formats``), which
holds every default that differs to a row of the README's table of differences (``readme_differences``).

Tolerance: ``LOSS_TOL``, per logged loss ``|fast - plain| <= 1e-6 + 1e-5 |plain|``. On a CPU in fp32 FastSFT either
runs TRL's own code path (the same kernels: bitwise) or its packed path, which sums the same terms in another order;
1e-5 relative is what the CPU parity tests hold that path to (tests/test_trainer.py). A test with another tolerance
(a 4-bit base, MoE routing) states it and why.
"""

from __future__ import annotations

import json
import math
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from datasets import Dataset
from parity import Tol, assert_same_series

from nbkit.demo.data import demo_pairs, format_pair
from nbkit.demo.models import FAMILIES, tiny_model

ROOT = Path(__file__).resolve().parents[1]
TOOLS_TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chatml_tools.jinja"
"""A ChatML template (ours) that renders a ``tools`` list and assistant ``tool_calls``, assistant turns marked."""

LOSS_TOL = Tol(rtol=1e-5, atol=1e-6)
METRIC_TOLS: dict[str, Tol] = {"num_tokens": Tol(), "entropy": Tol(rtol=1e-4, atol=1e-5),
                               "mean_token_accuracy": Tol(atol=0.05)}
"""TRL's step metrics: the token count exactly; the entropy as a loss (summed over the vocabulary: 1e-4); the
accuracy within a few tokens' argmax flipping on near-ties of a random model's logits."""
FP32: dict[str, Any] = {"bf16": False, "fp16": False}

BASE: dict[str, Any] = dict(
    max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1, report_to=[],
    save_strategy="no", use_cpu=True, max_length=64, dataloader_num_workers=0, disable_tqdm=True, seed=0, **FP32,
)
"""What every run shares unless a test changes it: three logged steps, fp32, no saves or reports. Everything else
(packing, gradient checkpointing, the learning-rate schedule...) is each config's default."""

# ---------------------------------------------------------------------------------------------------------------
# building

_SIZES = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
              tie_word_embeddings=False)

HYBRIDS: dict[str, dict[str, Any]] = {
    # short causal convolutions between attention layers (LiquidAI LFM2 / LFM2.5)
    "lfm2": dict(model_type="lfm2", intermediate_size=256, num_hidden_layers=4, block_auto_adjust_ff_dim=False,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    # Mamba-2 mixers, attention, MLP and MoE blocks (NVIDIA Nemotron-H / Nemotron 3)
    "nemotron_h": dict(model_type="nemotron_h", head_dim=32, intermediate_size=256,
                       layers_block_type=["mamba", "attention", "mlp", "moe"], ssm_state_size=16, mamba_num_heads=4,
                       mamba_head_dim=32, n_groups=1, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, moe_shared_expert_intermediate_size=64),
    # attention and a Mamba-2 mixer side by side in every layer (TII Falcon-H1)
    "falcon_h1": dict(model_type="falcon_h1", head_dim=32, intermediate_size=256, num_hidden_layers=2,
                      mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16),
}

MORE_FAMILIES: dict[str, dict[str, Any]] = {
    **HYBRIDS,
    # families TRL's tests train whose packed attention nbkit has not validated
    "olmo3": dict(model_type="olmo3", intermediate_size=256, num_hidden_layers=2, sliding_window=16,
                  layer_types=["sliding_attention", "full_attention"]),
    "cohere2": dict(model_type="cohere2", intermediate_size=256, num_hidden_layers=2, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"]),
    "gpt_neox": dict(model_type="gpt_neox", intermediate_size=256, num_hidden_layers=2),
    "glm4_moe": dict(model_type="glm4_moe", head_dim=32, intermediate_size=256, num_hidden_layers=2,
                     moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                     n_group=1, topk_group=1),
}


def tokenizer(chat_template: Optional[str] = "demo") -> Any:
    """A fresh copy of nbkit's demo tokenizer; ``chat_template``: ``"demo"`` (its own), ``"tools"``
    (``TOOLS_TEMPLATE``) or None (no template, as a base model's tokenizer)."""
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    if chat_template == "tools":
        tok.chat_template = TOOLS_TEMPLATE.read_text()
    elif chat_template is None:
        tok.chat_template = None
    return tok


def tiny(family: str, tok: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A tiny randomly initialised causal LM of ``family`` (a demo family or one of ``MORE_FAMILIES``) for ``tok``'s
    vocabulary, pad and eos; the same ``seed`` gives the same weights (the global RNG is left as found)."""
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": None}
    if family in FAMILIES:
        return tiny_model(family, len(tok), seed=seed, dtype=dtype, **ids, **overrides)
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(MORE_FAMILIES[family])
    config = AutoConfig.for_model(spec.pop("model_type"), **{**_SIZES, **spec, **ids, "vocab_size": len(tok),
                                                             **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def save_tiny(folder: Path, family: str = "qwen3", seed: int = 0) -> Path:
    """A tiny model and the demo tokenizer saved as a local model folder (what a model name points to)."""
    tok = tokenizer()
    tiny(family, tok, seed=seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _tool_row(question: str, answer: str) -> dict[str, Any]:
    words = question.split(":", 1)[1].strip()
    call = {"type": "function", "function": {"name": "reverse_words", "arguments": {"words": words}}}
    return {
        "messages": [
            {"role": "user", "content": question, "tool_calls": None},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": answer, "tool_calls": None},
            {"role": "assistant", "content": answer, "tool_calls": None},
        ],
        "tools": json.dumps([{"type": "function", "function": {
            "name": "reverse_words", "description": "Reverse the order of words.",
            "parameters": {"type": "object", "properties": {"words": {"type": "string"}}, "required": ["words"]},
        }}]),
    }


def dataset(fmt: str = "text", n: int = 24, split: str = "train", seed: int = 0) -> Dataset:
    """``n`` demo examples in one of TRL's formats (see the module docstring)."""
    pairs = demo_pairs(n, split, seed)
    if fmt in ("text", "prompt", "messages"):
        return Dataset.from_list([format_pair(q, a, fmt) for q, a in pairs])
    if fmt == "conversational_prompt":
        return Dataset.from_list([{"prompt": [{"role": "user", "content": q}],
                                   "completion": [{"role": "assistant", "content": a}]} for q, a in pairs])
    if fmt == "tools":
        return Dataset.from_list([_tool_row(q, a) for q, a in pairs])
    raise ValueError(f"unknown format {fmt!r}")


# ---------------------------------------------------------------------------------------------------------------
# running


@dataclass
class Outcome:
    """What one trainer did with one setup: the trainer, the parameters before training, or the error and where."""

    kind: str
    trainer: Any = None
    before: dict[str, torch.Tensor] = field(default_factory=dict)
    error: Optional[BaseException] = None
    stage: str = ""

    @property
    def log(self) -> list[dict[str, Any]]:
        return list(self.trainer.state.log_history) if self.trainer is not None else []

    def series(self, key: str) -> list[float]:
        """The logged values of ``key`` (``"loss"``, ``"eval_loss"``...), in order."""
        return [float(h[key]) for h in self.log if key in h]

    @property
    def losses(self) -> list[float]:
        return self.series("loss")

    def trainable(self) -> set[str]:
        return {n for n, p in self.trainer.model.named_parameters() if p.requires_grad}

    def changed(self) -> set[str]:
        """Names of the parameters whose values differ from before training."""
        now = dict(self.trainer.model.named_parameters())
        return {n for n, p in self.before.items() if n in now and not torch.equal(p, now[n].detach().cpu())}

    def why(self) -> str:
        """The error, with the end of its traceback (for assertion messages)."""
        if self.error is None:
            return f"{self.kind}: no error"
        lines = traceback.format_exception(type(self.error), self.error, self.error.__traceback__)
        return f"{self.kind} raised at {self.stage}:\n" + "".join(lines[-6:])


def classes(kind: str) -> tuple[type, type]:
    """(trainer class, config class) of ``kind``: ``"trl"`` or ``"nbkit"``."""
    if kind == "trl":
        from trl import SFTConfig, SFTTrainer

        return SFTTrainer, SFTConfig
    from nbkit import FastSFT, FastSFTConfig

    return FastSFT, FastSFTConfig


def run(kind: str, out: Path, *, model: Callable[[Any], Any] = lambda tok: tiny("qwen3", tok),
        tok: Callable[[], Any] = tokenizer, data: Callable[[], Any] = dataset,
        extra: Optional[Callable[[Any], dict[str, Any]]] = None, train: bool = True, base: Optional[dict] = None,
        config_cls: Optional[type] = None, **settings: Any) -> Outcome:
    """One trainer of ``kind`` on a fresh setup: ``tok()``, ``model(tok)`` (a model, or a name), ``data()`` as the
    train dataset, ``extra(tok)`` as further trainer arguments (peft_config, eval_dataset, callbacks...), the config
    (``config_cls``, default the kind's own) from ``base`` (default ``BASE``) updated by ``settings``; trained when
    ``train``."""
    trainer_cls, own_config = classes(kind)
    config_cls = config_cls or own_config
    outcome = Outcome(kind)
    outcome.stage = "setup"
    try:
        t = tok()
        kwargs = {"model": model(t), "processing_class": t, "train_dataset": data(), **(extra(t) if extra else {})}
        args = config_cls(**{**(BASE if base is None else base), "output_dir": str(out / kind), **settings})
        outcome.trainer = trainer_cls(args=args, **kwargs)
        outcome.before = {n: p.detach().cpu().clone() for n, p in outcome.trainer.model.named_parameters()}
        if train:
            outcome.stage = "train"
            outcome.trainer.train()
        outcome.stage = "done"
    except Exception as error:  # the outcome under test: compared between the two trainers
        outcome.error = error
    return outcome


def both(tmp_path: Path, **kwargs: Any) -> tuple[Outcome, Outcome]:
    """``run`` with SFTTrainer, then with FastSFT, on the same arguments."""
    return run("trl", tmp_path, **kwargs), run("nbkit", tmp_path, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# comparing


def assert_trains(outcome: Outcome, *, frozen_may_change: bool = False) -> None:
    """What TRL's tests check of a run: it finished, logged ``train_loss`` and finite losses, every trainable
    parameter changed and (unless ``frozen_may_change``) every frozen one stayed."""
    assert outcome.error is None, outcome.why()
    assert outcome.log and outcome.log[-1].get("train_loss") is not None, f"{outcome.kind}: no train_loss logged"
    assert outcome.losses and all(math.isfinite(x) for x in outcome.losses), f"{outcome.kind}: {outcome.losses}"
    trainable, changed = outcome.trainable(), outcome.changed()
    assert trainable, f"{outcome.kind}: nothing trainable"
    assert trainable <= changed, f"{outcome.kind}: trainable but unchanged: {sorted(trainable - changed)[:5]}"
    if not frozen_may_change:
        assert changed <= trainable, f"{outcome.kind}: frozen but changed: {sorted(changed - trainable)[:5]}"


def assert_same_error(plain: Outcome, fast: Outcome, *names: str) -> None:
    """TRL raised; FastSFT raised an exception of TRL's type (or a subclass) at the same stage, and each of
    ``names`` is in both messages."""
    assert plain.error is not None, f"SFTTrainer raised nothing (the test expects an error); {fast.why()}"
    assert fast.error is not None, f"FastSFT raised nothing where SFTTrainer raised {plain.why()}"
    assert isinstance(fast.error, type(plain.error)), \
        f"FastSFT raised {type(fast.error).__name__} (an {type(fast.error).__mro__[1].__name__}) where SFTTrainer " \
        f"raised {type(plain.error).__name__}: {fast.why()}\nSFTTrainer's: {plain.error}"
    assert fast.stage == plain.stage, f"FastSFT raised at {fast.stage}, SFTTrainer at {plain.stage}"
    for name in names:
        assert name in str(plain.error), f"SFTTrainer's message does not name {name!r}: {plain.error}"
        assert name in str(fast.error), f"FastSFT's message does not name {name!r}: {fast.error}"


def assert_same_values(got: list[float], want: list[float], tol: Tol, what: str) -> None:
    """Two logged series alike (``parity.assert_same_series``), where a non-finite value must be matched by the same
    non-finite value (a diverging run logs NaN on both sides)."""
    assert len(got) == len(want) > 0, f"{what}: {len(got)} values against {len(want)}: {got} / {want}"
    odd = [i for i, w in enumerate(want) if not math.isfinite(w)]
    assert odd == [i for i, g in enumerate(got) if not math.isfinite(g)] and \
        all(str(got[i]) == str(want[i]) for i in odd), f"{what}: non-finite values differ: {got} / {want}"
    if len(odd) < len(want):
        assert_same_series([g for i, g in enumerate(got) if i not in odd], [w for i, w in enumerate(want) if i not in odd],
                           tol, what)


def assert_same_outcome(plain: Outcome, fast: Outcome, *, tol: Tol = LOSS_TOL, names: tuple[str, ...] = ()) -> None:
    """The same outcome (see the module docstring): the same error, or the same training within ``tol``."""
    if plain.error is not None:
        assert_same_error(plain, fast, *names)
        return
    assert fast.error is None, f"SFTTrainer trained, FastSFT did not: {fast.why()}"
    assert plain.trainer.state.global_step == fast.trainer.state.global_step
    assert_same_values(fast.losses, plain.losses, tol, "loss")
    for key, key_tol in METRIC_TOLS.items():  # TRL's per-step metrics, logged beside the loss
        if plain.series(key) or fast.series(key):
            assert_same_values(fast.series(key), plain.series(key), key_tol, key)
    evals = plain.series("eval_loss")
    if evals or fast.series("eval_loss"):
        assert_same_values(fast.series("eval_loss"), evals, tol, "eval_loss")
    assert fast.trainable() == plain.trainable(), "not the same parameters trainable"
    assert fast.changed() == plain.changed(), (f"not the same parameters changed: only FastSFT's "
                                               f"{sorted(fast.changed() - plain.changed())[:4]}, only SFTTrainer's "
                                               f"{sorted(plain.changed() - fast.changed())[:4]}")


def assert_same_batch(got: dict[str, Any], want: dict[str, Any], what: str = "batch") -> None:
    """Two collated batches alike: the same keys, and per key the same type; tensors of the same shape, dtype and
    values; anything else equal."""
    assert list(got) == list(want), f"{what}: keys {list(got)} against SFTTrainer's {list(want)}"
    for key, w in want.items():
        g = got[key]
        assert type(g) is type(w), f"{what}[{key!r}]: {type(g).__name__} against {type(w).__name__}"
        if isinstance(w, torch.Tensor):
            assert g.shape == w.shape and g.dtype == w.dtype, \
                f"{what}[{key!r}]: {g.dtype} {tuple(g.shape)} against {w.dtype} {tuple(w.shape)}"
            assert torch.equal(g, w), f"{what}[{key!r}]: other values"
        else:
            assert g == w, f"{what}[{key!r}]: {g!r} against {w!r}"


# ---------------------------------------------------------------------------------------------------------------
# the README's table of differences


def readme_differences() -> list[str]:
    """The rows of the README's table of differences from SFTTrainer: the first markdown table under the first
    heading that speaks of differences (``#... ...differ...``); empty when there is none."""
    rows: list[str] = []
    under = False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("#"):
            if rows:
                break
            under = bool(re.search(r"differ", line, re.IGNORECASE))
        elif under and line.startswith("|"):
            if not set(line) <= set("|-: "):
                rows.append(line)
        elif rows:
            break
    return rows[1:]  # the header row is not a difference


def assert_documented(*words: str, why: str) -> None:
    """A row of the README's table of differences names one of ``words`` (a setting, or what differs), as a whole
    word; ``why`` says what differs (for the message)."""
    rows = readme_differences()
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)
    assert any(pattern.search(row) for row in rows), \
        f"FastSFT differs from SFTTrainer in {why}; the README's table of differences has no row naming " \
        f"{' or '.join(repr(w) for w in words)} ({len(rows)} rows found under a heading about differences)"
