"""FastSFT with every switch at its default trains as the same run with every speedup off, across a matrix of runs.

The guard for one class of bug: a GPU's default fast path (cached packing on the varlen kernel, fused LoRA, Liger's
kernels, tiled MLP 'auto', selective checkpointing, CUDA graphs, ...) training differently from the eager path
under gradient accumulation, a batch of several packed rows, bf16 autocast over fp32 weights, a 4-bit base.

Each case trains twice from the same model, adapters, data (pre-tokenized once, packed, sequential order) and seed:
``FAST`` (``FastSFTConfig``'s defaults) and ``EAGER`` (every speedup switch off: TRL's own code path; packing
itself stays on, so both see the same rows). The eager run does not depend on Liger and is cached per case
(``_EAGER``), so the Liger axis costs one run, not two. Compared: the per-step logged losses, and every trainable
(LoRA) tensor after the last step, each as max|fast - eager| / max|eager|. The LoRA updates (weights less their
initial values) are printed beside them: LoRA A barely moves in 4 steps, so its final weights say little.

Matrix (``CASES``): families llama, qwen3, gemma3 x gradient_accumulation_steps {1, 4} x
per_device_train_batch_size {1, 2} (packing: 2 rows are still one padding-free row, the row CUDA graphs replay)
x fp32 / bf16 autocast (weights in fp32 in both: the demo's tiny models come so, and bf16 autocast over fp32
weights is where Qwen3's q/k norms hand attention fp32 tensors) x Liger on / off (off: ``liger_ops`` patched to
return None, so ``fused_kernels='auto'`` builds nothing; on: skipped when liger-kernel is not installed); a 4-bit
NF4 base (``nbkit.loading.load_model``) for qwen3 over the same GA x batch x dtype x Liger axes (its code path is
the fused 4-bit LoRA, family-independent). Plus the matrix's GA 4 cases once more with ``tiled_mlp=True`` and tiles
of 64 tokens (the default 'auto' does not tile a tiny model on an H200) against the same cached eager runs, and one
long run of the recipe users run most (``test_the_default_recipe_trains_as_the_eager_path_over_40_adamw_steps``).
Every case: 4 SGD steps at lr 1e-2 (Adam would scale the rounding of LoRA A's first, near-zero gradients up to
full-size updates: tests/test_gradient_accumulation.py), gradient checkpointing on (so selective checkpointing
decides after step 1 and CUDA graphs replay steps 2-4), LoRA r8 on all linear layers, 2-layer models (tiny_model's
other sizes: hidden 128, 4 query / 2 key-value heads of 32, MLP 256), rows of 256 tokens.

Tolerances (relative, as above):

- fp32, dense base: losses 1e-4, LoRA weights 1e-3. Both paths compute in fp32 (Liger's kernels too); what differs
  is the order of sums: the varlen/SDPA kernels, fused LoRA's GEMM epilogue, and the graphs' buckets, which pad the
  GEMMs' row counts. The known bugs gave 0.3% first-step loss errors in fp32.
- bf16 autocast, and every 4-bit case: losses 2e-2, the first step's loss (one forward's rounding, no update yet)
  5e-3, LoRA weights 5e-2. bf16 rounds each activation to ~3 significant digits, and kernels round in different
  places. A 4-bit base is at bf16 precision even without autocast: TRL casts QLoRA adapters to bf16 and PEFT then
  runs the LoRA product in bf16 (and bitsandbytes the base GEMM in its bf16 compute dtype), while fused LoRA
  computes in the input's dtype. The known bugs gave 36-39% LoRA weight errors: far outside.

What the fast run must have engaged, so that parity cannot come from a silently eager run: cached packing on a
varlen (or flash) kernel, fused LoRA, fused_kernels exactly when Liger is on, selective checkpointing, and in the
bf16 cases (where the fused attention kernels run) CUDA graphs with captures and replays > 0; the eager run
nothing. ``test_the_eager_reference_turns_off_every_speedup_switch`` keeps ``EAGER`` complete as switches are added.

Runs: 32 cases (24 dense, 8 four-bit) x Liger on/off = 64 fast runs (32 without Liger installed), 32 eager runs
(cached), 6 tiled runs, 2 long runs. Cost on one H200 (estimated, not measured; tiny models are bound by the host's
Python): each short run ~1-1.5 s (trainer setup and packing ~0.5 s, 4 to 16 micro-batches of ~20-60 ms, graph
captures ~0.2 s a bucket; a CPU runs one in 1-1.5 s), ~102 of them ~2-2.5 min; Liger's Triton kernels compiled once
(~10-20 s, less with a warm cache); the long run 2 x 160 micro-batches of 512 tokens, ~30-50 s (25 s each on 2 CPU
cores): about 3-4 minutes in all. Run with ``-s`` to read the measured errors.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(num_hidden_layers=2)  # tiny_model's other sizes; gemma3 alternates sliding / full even with 2 layers
STEPS = 4
LEARNING_RATE = 1e-2
MAX_LENGTH = 256
EXAMPLES = 420  # ~21 tokens each: 37 packed rows of 256, the 32 rows the largest case (GA 4 x batch 2 x 4 steps) reads
LORA_R = 8

EAGER: dict[str, Any] = dict(  # every speedup switch of FastSFTConfig off; ``attention_kernel`` must stay 'auto' then
    cached_packing=False, offload_checkpointing=False, offload_double_buffer=False, selective_checkpointing=False,
    cuda_graphs=False, fast_moe_routing=False, fused_lora=False, fused_kernels=False, tiled_mlp=False,
    sync_free_metrics=False, dequant_cache=False, expandable_segments=False, cuda_graphs_checkpointed=False,
)
FAST: dict[str, Any] = {}  # every switch at its default
NOT_SPEEDUPS = {  # FastSFTConfig's own fields that change no code path of the step (or only with a switch above on)
    "attention_kernel", "offload_min_bytes", "offload_max_host_bytes", "tiled_mlp_tokens",  # settings of a switch
    "live_dashboard",  # display only; off in both runs
    "validate_inputs", "on_nonfinite_loss", "atomic_saves",  # reliability: what happens when something goes wrong
}

TOLERANCES = {  # (losses, first step's loss, LoRA weights), relative: argued in the module docstring
    "fp32": (1e-4, 1e-4, 1e-3),
    "bf16": (2e-2, 5e-3, 5e-2),
}


@dataclass(frozen=True)
class Case:
    """One cell of the matrix, less the Liger flag (the eager run does not depend on it)."""

    family: str = "qwen3"  # a nbkit.demo.models family
    base: str = "dense"  # "dense" (tiny_model's fp32 weights) or "4bit" (NF4 through load_model)
    dtype: str = "fp32"  # "fp32" (no autocast) or "bf16" (bf16=True: autocast over the fp32 weights)
    batch: int = 1
    accumulation: int = 1
    checkpointing: bool = True

    @property
    def id(self) -> str:
        return f"{self.family}-{self.base}-{self.dtype}-b{self.batch}-ga{self.accumulation}"

    @property
    def precision(self) -> str:
        """The tolerance class: bf16 rounding wherever a bf16 product is on either path."""
        return "bf16" if self.dtype == "bf16" or self.base == "4bit" else "fp32"


@dataclass
class Run:
    """What one training run leaves to compare: losses, trainable weights before and after, what it ran with."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    start: dict[str, torch.Tensor]
    attached: list[str]
    steps: int = 0
    graphs: dict[str, Any] = field(default_factory=dict)
    selective_kept: Optional[int] = None
    seconds: float = 0.0


CASES = [Case(family, "dense", dtype, batch, accumulation)
         for family in ("llama", "qwen3", "gemma3") for dtype in ("fp32", "bf16")
         for batch in (1, 2) for accumulation in (1, 4)]
CASES += [Case("qwen3", "4bit", dtype, batch, accumulation)
          for dtype in ("fp32", "bf16") for batch in (1, 2) for accumulation in (1, 4)]
_EAGER: dict[tuple, Run] = {}  # the eager run of a case (and its training settings), shared by its Liger on/off cells


# ---------------------------------------------------------------------------------------------------------- helpers
@functools.cache
def tokenizer():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


@functools.cache
def tokenized(n: int):
    """The demo's chats, tokenized once as TRL tokenizes them, with their assistant masks (TRL then only builds the
    labels and packs). Every third chat is trained in full (mask all ones, as a plain-text example would be): the
    demo's chats alone are so alike that every packed row trains the same number of tokens, and then a loss
    normalised per micro-batch instead of over the accumulation window could not be told from the right one."""
    from datasets import Dataset

    from nbkit.demo.data import make_dataset

    tok = tokenizer()
    ids, masks = [], []
    for i, chat in enumerate(make_dataset("messages", n=n)["messages"]):
        out = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids.append(list(out["input_ids"]))
        masks.append([1] * len(ids[-1]) if i % 3 == 0 else list(out["assistant_masks"]))
    return Dataset.from_dict({"input_ids": ids, "assistant_masks": masks})


def _base_folder(family: str, root: Path) -> Path:
    """A saved tiny model of ``family`` (fp32, the demo tokenizer beside it), written once under ``root``."""
    from nbkit.demo.models import tiny_model

    folder = root / f"base-{family}"
    if not (folder / "config.json").exists():
        tok = tokenizer()
        tiny_model(family, len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0,
                   **SHAPE).save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def _model(case: Case, root: Path, lora_r: int, shape: dict) -> tuple[Any, Any]:
    """(model, peft_config) for the case: a dense tiny model and a LoraConfig, or a 4-bit PEFT model (seeded)."""
    from peft import LoraConfig

    from nbkit.demo.models import tiny_model

    tok = tokenizer()
    if case.base == "4bit":
        from nbkit.loading import load_model

        torch.manual_seed(0)  # LoRA A's initialisation
        model, _ = load_model(str(_base_folder(case.family, root)), load_in_4bit=True, dtype=torch.float32,
                              lora_r=lora_r, lora_alpha=2 * lora_r, gradient_checkpointing=case.checkpointing)
        return model, None
    model = tiny_model(case.family, len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0,
                       **shape)
    return model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear", lora_dropout=0.0)


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def train(case: Case, switches: dict[str, Any], workdir: Path, device: str = "cuda", liger: bool = False,
          steps: int = STEPS, max_length: int = MAX_LENGTH, examples: int = EXAMPLES, lora_r: int = LORA_R,
          shape: Optional[dict] = None, **args: Any) -> Run:
    """One FastSFT run of ``case`` with ``switches`` on top of the shared settings (``args`` override them).

    ``liger=False`` hides Liger-Kernel (``fused_kernels.liger_ops`` returns None), as if it were not installed.
    """
    from transformers import PrinterCallback

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.speedups import fused_kernels
    from nbkit.speedups.layer_runner import LayerRunner

    settings: dict[str, Any] = dict(
        output_dir=str(workdir / f"{case.id}-{time.monotonic_ns()}"), max_steps=steps,
        per_device_train_batch_size=case.batch, gradient_accumulation_steps=case.accumulation, packing=True,
        max_length=max_length, bf16=case.dtype == "bf16", fp16=False, use_cpu=device == "cpu",
        learning_rate=LEARNING_RATE, optim="sgd", logging_steps=1, report_to=[], save_strategy="no", seed=0,
        shuffle_dataset=False, train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=case.checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
        live_dashboard=False,
    )
    settings.update(args)
    settings.update(switches)
    config = FastSFTConfig(**settings)
    if device == "cuda":  # selective_checkpointing sizes by the process's peak: an earlier test's must not count
        torch.cuda.reset_peak_memory_stats()
    with pytest.MonkeyPatch.context() as patch:
        if not liger:
            patch.setattr(fused_kernels, "liger_ops", lambda: None)
        model, peft_config = _model(case, workdir, lora_r, SHAPE if shape is None else shape)
        torch.manual_seed(0)  # LoRA A's initialisation (dense: PEFT wraps the model inside FastSFT)
        trainer = FastSFT(model=model, args=config, train_dataset=tokenized(examples), processing_class=tokenizer(),
                          peft_config=peft_config)
        trainer.remove_callback(PrinterCallback)  # the per-step log lines: the report below says what matters
        start = _trainable(trainer.model)
        run = Run(losses=[], weights={}, start=start, attached=[], steps=steps)
        detach = LayerRunner.detach

        def read_then_detach(runner: LayerRunner) -> None:  # the layer modes' counters, before the runner lets go
            if runner.layers:
                if runner.graphs is not None:
                    run.graphs = runner.graphs.counters()
                if runner.keep is not None:
                    run.selective_kept = runner.keep.kept
            detach(runner)

        patch.setattr(LayerRunner, "detach", read_then_detach)
        began = time.perf_counter()
        trainer.train()
        run.seconds = time.perf_counter() - began
    run.losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    run.weights = _trainable(trainer.model)
    run.attached = list(trainer.nbkit_attached)
    return run


def eager_run(case: Case, workdir: Path, device: str = "cuda", **kw: Any) -> Run:
    """The case's eager reference, trained once per case and settings (it does not depend on Liger)."""
    key = (case, device, tuple(sorted(kw.items())))
    if key not in _EAGER:
        _EAGER[key] = train(case, EAGER, workdir, device=device, **kw)
    return _EAGER[key]


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor: max |a - b| / max |b|."""
    return {n: float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)) for n in b}


def relative_norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """All tensors as one vector: ||a - b|| / ||b||."""
    diff = sum(float((a[n] - b[n]).double().square().sum()) for n in b)
    return (diff / max(sum(float(b[n].double().square().sum()) for n in b), 1e-300)) ** 0.5


def errors(fast: Run, eager: Run) -> dict[str, Any]:
    """The distances the parity checks read: per-step losses, weights, updates (weights less their start)."""
    loss = [abs(f - e) / abs(e) for f, e in zip(fast.losses, eager.losses)]
    weights = relative(fast.weights, eager.weights)
    moved = ({n: w - fast.start[n] for n, w in fast.weights.items()}, {n: w - eager.start[n] for n, w in eager.weights.items()})
    worst = max(weights, key=weights.get)
    return dict(loss=max(loss), first=loss[0], weights=weights[worst], worst=worst,
                updates=max(relative(*moved).values()), updates_norm=relative_norm(*moved),
                start=max(relative(fast.start, eager.start).values()))


def report(label: str, fast: Run, eager: Run, err: dict[str, Any]) -> None:
    print(f"\n{label}: losses {err['loss']:.2e} (first step {err['first']:.2e}), LoRA weights {err['weights']:.2e} "
          f"({err['worst']}), updates {err['updates']:.2e} (as one vector {err['updates_norm']:.2e}) "
          f"| fast {[round(x, 5) for x in fast.losses]} eager {[round(x, 5) for x in eager.losses]} "
          f"| attached {fast.attached} | graphs {fast.graphs} "
          f"| selective kept {fast.selective_kept} | {fast.seconds:.1f} s fast, {eager.seconds:.1f} s eager")


def assert_parity(case: Case, fast: Run, eager: Run, label: str) -> dict[str, Any]:
    """Same start, same number of logged steps, losses and LoRA weights within the case's tolerances."""
    err = errors(fast, eager)
    report(label, fast, eager, err)
    losses_tol, first_tol, weights_tol = TOLERANCES[case.precision]
    assert len(fast.losses) == len(eager.losses) == eager.steps, (fast.losses, eager.losses)
    assert err["start"] == 0, "the two runs did not start from the same adapters"
    assert any("lora_B" in n and w.abs().max() > 0 for n, w in eager.weights.items()), "training moved nothing"
    assert err["first"] <= first_tol, (label, err)
    assert err["loss"] <= losses_tol, (label, err)
    assert err["weights"] <= weights_tol, (label, err)
    return err


def assert_engaged(case: Case, fast: Run, eager: Run, liger: bool) -> None:
    """The fast run ran the speedups it claims (so parity cannot come from a silently eager path); eager none."""
    names = fast.attached
    assert eager.attached == [], eager.attached
    assert any(n.startswith(("cached_packing(varlen", "cached_packing(flash")) for n in names), names
    assert "fused_lora" in names, names
    assert any(n.startswith("fused_kernels") for n in names) == liger, names
    if case.checkpointing:
        assert "selective_checkpointing" in names and fast.selective_kept, (names, fast.selective_kept)
    if case.dtype == "bf16":  # the fused attention kernels run bf16 only: there the layers must replay as graphs
        assert "cuda_graphs" in names, (names, fast.graphs)
        assert fast.graphs.get("captured", 0) > 0 and fast.graphs.get("replays", 0) > 0, fast.graphs


def _need_liger(liger: bool) -> None:
    if liger:
        from nbkit.speedups.fused_kernels import liger_ops

        if liger_ops() is None:
            pytest.skip("liger-kernel is not installed")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Iterator[Path]:
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # ~200 packing bars would bury the measured errors in pytest -s
    yield tmp_path_factory.mktemp("parity")
    if shown:
        datasets.enable_progress_bars()


# ------------------------------------------------------------------------------------------------------------ tests
def test_the_eager_reference_turns_off_every_speedup_switch():
    """Every FastSFTConfig field beyond SFTConfig's is either switched off in EAGER or changes no code path; every
    bool / 'auto' switch that defaults on is in EAGER, so a new switch cannot hide in the fast run's defaults."""
    from trl import SFTConfig

    from nbkit import FastSFTConfig

    ours = {n: f for n, f in FastSFTConfig.__dataclass_fields__.items() if n not in SFTConfig.__dataclass_fields__}
    # (bf16, fp16, dataloader_pin_memory are FastSFTConfig's own fields only where TRL's defaults differ)
    assert set(EAGER) <= set(ours) <= set(EAGER) | NOT_SPEEDUPS, set(ours) ^ (set(EAGER) | NOT_SPEEDUPS)
    assert all(value is False for value in EAGER.values())
    for name, f in ours.items():
        if name not in NOT_SPEEDUPS and f.default in (True, "auto"):
            assert name in EAGER, name
    FastSFTConfig(output_dir="unused", use_cpu=True, **EAGER)  # accepted as a whole


@pytest.mark.parametrize("liger", [False, True], ids=["liger-off", "liger-on"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_defaults_train_as_every_speedup_off(case, liger, workdir):
    _need_liger(liger)
    if case.base == "4bit":
        pytest.importorskip("bitsandbytes")
    eager = eager_run(case, workdir)
    fast = train(case, FAST, workdir, liger=liger)
    assert_parity(case, fast, eager, f"{case.id} liger={'on' if liger else 'off'}")
    assert_engaged(case, fast, eager, liger)


TILED = [Case(family, "dense", dtype, 1, 4) for family in ("llama", "qwen3", "gemma3") for dtype in ("fp32", "bf16")]


@pytest.mark.parametrize("case", TILED, ids=[c.id for c in TILED])
def test_the_defaults_with_a_tiled_mlp_train_as_every_speedup_off(case, workdir):
    """tiled_mlp=True with tiles of 64 tokens (every MLP call of a 256-token row is tiled), the rest at defaults,
    Liger as installed; the same tolerances and the same cached eager runs as the matrix."""
    from nbkit.speedups.fused_kernels import liger_ops

    liger = liger_ops() is not None
    eager = eager_run(case, workdir)
    fast = train(case, dict(tiled_mlp=True, tiled_mlp_tokens=64), workdir, liger=liger)
    assert_parity(case, fast, eager, f"{case.id} tiled_mlp=True liger={'on' if liger else 'off'}")
    assert "tiled_mlp" in fast.attached, fast.attached
    assert_engaged(case, fast, eager, liger)


# The long run: the recipe users run most, at the precision FastSFTConfig picks (bf16 on an H200), AdamW.
LONG = Case("qwen3", "dense", "auto", batch=1, accumulation=4)
LONG_STEPS = 40
LONG_LR = 2e-3
# Tolerances, from a measurement: this recipe's eager run in bf16 autocast against the same in fp32 (CPU, where both
# exist) gave a last-10-step mean loss 0.008% apart, LoRA weights 21% apart per tensor (Adam turns the rounding of
# near-zero gradients into full-size steps of either sign: the worst elements of a tensor say little) and LoRA
# updates 4.4% apart as one vector. Fast and eager in bf16 round in different places each, so ~1.4x that apart;
# the bound is ~3x the measurement. The known bug gave 172% LoRA weight errors per tensor.
LONG_LOSS_TOL = 1e-2  # the fast run's mean loss over the last 10 steps at most 1% above the eager run's
LONG_WEIGHTS_TOL = 0.6  # LoRA weights: max|fast - eager| / max|eager| per tensor
LONG_UPDATES_TOL = 0.15  # LoRA updates (weights less their start), all tensors as one vector: ||fast - eager|| / ||eager||


def long_runs(workdir: Path, device: str = "cuda", liger: Optional[bool] = None) -> tuple[Run, Run]:
    """(fast, eager) of the long recipe: tiny qwen3 (4 layers), LoRA r16 all-linear, packing, GA 4 x batch 1 of
    512-token rows, AdamW (the default optim), 40 steps, fp32 weights, the default mixed precision."""
    if liger is None:
        from nbkit.speedups.fused_kernels import liger_ops

        liger = liger_ops() is not None
    from nbkit import FastSFTConfig

    common = dict(steps=LONG_STEPS, max_length=512, examples=4400, lora_r=16, shape={}, learning_rate=LONG_LR,
                  optim=FastSFTConfig.__dataclass_fields__["optim"].default, bf16=None, fp16=None)
    eager = train(LONG, EAGER, workdir, device=device, **common)
    fast = train(LONG, FAST, workdir, device=device, liger=liger, **common)
    return fast, eager


def test_the_default_recipe_trains_as_the_eager_path_over_40_adamw_steps(workdir):
    """Tolerances: LONG_LOSS_TOL, LONG_WEIGHTS_TOL, LONG_UPDATES_TOL, argued beside them."""
    from nbkit.speedups.fused_kernels import liger_ops

    liger = liger_ops() is not None
    fast, eager = long_runs(workdir, liger=liger)
    err = errors(fast, eager)
    report(f"long run (qwen3, {LONG_STEPS} AdamW steps, GA 4 x 1)", fast, eager, err)
    fast_tail, eager_tail = sum(fast.losses[-10:]) / 10, sum(eager.losses[-10:]) / 10
    print(f"long run: mean loss over the last 10 steps: fast {fast_tail:.5f}, eager {eager_tail:.5f} "
          f"({fast_tail / eager_tail - 1:+.2%}); first {eager.losses[0]:.5f}")
    assert len(fast.losses) == len(eager.losses) == LONG_STEPS
    assert eager_tail < eager.losses[0], "the recipe did not train"
    assert fast_tail <= eager_tail * (1 + LONG_LOSS_TOL), (fast_tail, eager_tail)
    assert err["weights"] <= LONG_WEIGHTS_TOL, err
    assert err["updates_norm"] <= LONG_UPDATES_TOL, err
    assert any(n.startswith("cached_packing") for n in fast.attached) and "fused_lora" in fast.attached
    if torch.cuda.get_device_capability() >= (8, 0):  # FastSFTConfig picks bf16: the fused attention kernels run
        assert "cuda_graphs" in fast.attached and fast.graphs.get("replays", 0) > 0, (fast.attached, fast.graphs)
