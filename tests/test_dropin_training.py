"""The drop-in contract, run side: evaluation, callbacks, label smoothing, ``model_init_kwargs``, a model given by
name, each config's defaults, a diverging run, the errors TRL raises for a wrong ``train_dataset``, and what
``trainer.data_collator`` returns.

Each test runs one behaviour through SFTTrainer and FastSFT (``tests/dropin.py``) and asserts the same outcome: the
same per-step training and evaluation losses within ``dropin.LOSS_TOL`` (1e-5 relative, fp32 on a CPU), the same
callback events, the same batches, the same exception type (FastSFT's may subclass TRL's) naming the same things.

Where FastSFT differs on purpose, the test runs FastSFT with the setting that gives TRL's behaviour and checks that
the default's difference is a row of the README's table of differences (``dropin.assert_documented``): stopping on a
non-finite loss (``on_nonfinite_loss="off"`` restores TRL's finishing run), and every config default that differs
(e.g. the precision on a CPU: ``SFTConfig`` autocasts to bf16, ``FastSFTConfig`` trains in fp32).
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import DatasetDict
from dropin import (
    BASE,
    LOSS_TOL,
    assert_documented,
    assert_same_batch,
    assert_same_outcome,
    assert_trains,
    both,
    classes,
    dataset,
    run,
    save_tiny,
    tiny,
)
from parity import Tol, assert_same_series
from transformers import TrainerCallback

# -- evaluation -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_evaluation_during_training_gives_the_same_eval_losses(one_thread, tmp_path, packing):
    plain, fast = both(tmp_path, extra=lambda tok: {"eval_dataset": dataset("text", n=8, split="eval")},
                       eval_strategy="steps", eval_steps=1, packing=packing)
    assert_trains(plain)
    assert len(plain.series("eval_loss")) == 3
    assert_same_outcome(plain, fast)
    for key in ("eval_mean_token_accuracy", "eval_num_tokens"):
        assert_same_series(fast.series(key), plain.series(key), LOSS_TOL, key)


def test_several_named_eval_datasets_and_compute_metrics_alike(one_thread, tmp_path):
    def extra(tok):
        return {"eval_dataset": {"a": dataset("text", n=4, split="eval"), "b": dataset("text", n=6, split="eval")},
                "compute_metrics": lambda pred: {"rows": float(len(pred.label_ids))}}

    plain, fast = both(tmp_path, extra=extra, eval_strategy="steps", eval_steps=3)
    assert_trains(plain)
    assert_same_outcome(plain, fast)
    for key in ("eval_a_loss", "eval_b_loss", "eval_a_rows", "eval_b_rows"):
        assert plain.series(key), f"SFTTrainer logged no {key}"
        assert_same_series(fast.series(key), plain.series(key), LOSS_TOL, key)


def test_evaluate_on_a_raw_dataset_without_training_alike(one_thread, tmp_path):
    """``trainer.evaluate(eval_dataset=...)`` with a dataset TRL has not prepared, before any training."""
    plain, fast = both(tmp_path, train=False)
    got = [o.trainer.evaluate(eval_dataset=dataset("messages", n=6, split="eval")) for o in (plain, fast)]
    assert got[0]["eval_loss"] > 0
    assert_same_series([got[1]["eval_loss"]], [got[0]["eval_loss"]], LOSS_TOL, "eval_loss")


# -- callbacks, label smoothing, model_init_kwargs, a model given by name ---------------------------------------------


class Recorder(TrainerCallback):
    """Every callback event, in order, with the keys of each log."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")

            def record(args, state, control, logs=None, **kwargs):
                events.append(name if logs is None else f"{name}{sorted(logs)}")
            return record
        return object.__getattribute__(self, name)


def test_user_callbacks_see_the_same_events(one_thread, tmp_path):
    recorders = []

    def extra(tok):
        recorders.append(Recorder())
        return {"callbacks": [recorders[-1]], "eval_dataset": dataset("text", n=4, split="eval")}

    plain, fast = both(tmp_path, extra=extra, eval_strategy="steps", eval_steps=2)
    assert_trains(plain)
    assert_same_outcome(plain, fast)
    want, got = (r.events for r in recorders)
    assert "on_step_end" in want and any(e.startswith("on_evaluate") for e in want)
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    assert got == want, f"events differ from #{first}: FastSFT {got[first:first + 6]} / SFTTrainer {want[first:first + 6]}"


def test_label_smoothing_trains_to_the_same_losses(one_thread, tmp_path):
    plain, fast = both(tmp_path, label_smoothing_factor=0.1, packing=True)
    assert_trains(plain)
    assert_same_outcome(plain, fast)
    reference = run("trl", tmp_path / "unsmoothed", train=True, packing=True)
    assert plain.losses != reference.losses, "label smoothing changed nothing: the test would test nothing"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen3-named"))


def test_a_model_given_by_name_with_model_init_kwargs_trains_alike(one_thread, tmp_path, tiny_folder):
    """A local folder's path as ``model``, no processing_class (TRL loads the tokenizer from the folder), and
    ``model_init_kwargs`` choosing the weights' dtype (bf16 weights; TRL's own test trains them at lr 1e-1)."""
    plain, fast = both(tmp_path, model=lambda tok: str(tiny_folder), tok=lambda: None,
                       model_init_kwargs={"dtype": torch.bfloat16}, learning_rate=1e-2)
    assert_trains(plain)
    assert_same_outcome(plain, fast)
    for outcome in (plain, fast):
        assert {p.dtype for p in outcome.trainer.model.parameters()} == {torch.bfloat16}, outcome.kind


def test_model_init_kwargs_with_an_instantiated_model_are_ignored_alike(one_thread, tmp_path):
    plain, fast = both(tmp_path, model_init_kwargs={"dtype": torch.bfloat16})
    assert_trains(plain)
    assert_same_outcome(plain, fast)
    assert {p.dtype for p in fast.trainer.model.parameters()} == {torch.float32}


# -- each config's defaults -------------------------------------------------------------------------------------------

MINIMAL = dict(max_steps=2, per_device_train_batch_size=2, logging_steps=1, report_to=[], save_strategy="no",
               use_cpu=True, max_length=64, disable_tqdm=True)
"""What a CPU run must set (no reports, no saves, a short run); every other field is the config's default."""


def test_each_configs_defaults_train_and_every_difference_is_documented(one_thread, tmp_path):
    """Both trainers with their configs' defaults train (the same model and data: losses within bf16's rounding,
    2e-2 relative, as SFTConfig autocasts to bf16 by default); every SFTConfig field whose resolved default differs
    in FastSFTConfig is a row of the README's table of differences."""
    plain, fast = both(tmp_path, base=MINIMAL)
    assert_trains(plain)
    assert_trains(fast)
    assert_same_series(fast.losses, plain.losses, Tol(rtol=2e-2), "loss")
    (_, sft_config), (_, fast_config) = classes("trl"), classes("nbkit")
    want = sft_config(output_dir=str(tmp_path / "d"), **MINIMAL).to_dict()
    got = fast_config(output_dir=str(tmp_path / "d"), **MINIMAL).to_dict()
    differ = sorted(k for k in want if k in got and got[k] != want[k] and "dir" not in k)
    for key in differ:
        assert_documented(key, why=f"the default of {key}: {got[key]!r} against SFTConfig's {want[key]!r}")


# -- a diverging run --------------------------------------------------------------------------------------------------


def _diverging(tok):
    return tiny("qwen3", tok, dtype=torch.float16)


def test_a_diverging_run_finishes_as_in_trl_with_on_nonfinite_loss_off(one_thread, tmp_path):
    """fp16 weights at a huge learning rate: SFTTrainer finishes all its steps (the logged losses go non-finite or
    are filtered); FastSFT with ``on_nonfinite_loss="off"`` does the same, to the same logged losses."""
    plain = run("trl", tmp_path, model=_diverging, learning_rate=1e3, max_steps=4)
    fast = run("nbkit", tmp_path, model=_diverging, learning_rate=1e3, max_steps=4, on_nonfinite_loss="off")
    assert plain.error is None, plain.why()
    assert plain.trainer.state.global_step == 4
    weights = [p for p in plain.trainer.model.parameters() if p.requires_grad]
    assert any(not torch.isfinite(p).all() for p in weights), "the run did not diverge: the test tests nothing"
    assert fast.error is None, fast.why()
    assert fast.trainer.state.global_step == 4
    assert_same_series(fast.losses, plain.losses, LOSS_TOL, "loss")


def test_a_diverging_run_under_fastsfts_default_finishes_or_is_documented(one_thread, tmp_path):
    """FastSFT's default: where it stops a run that SFTTrainer finishes, that is ``on_nonfinite_loss`` in the
    README's table of differences (and the error is a FloatingPointError naming the step)."""
    fast = run("nbkit", tmp_path, model=_diverging, learning_rate=1e3, max_steps=4)
    if fast.error is None:
        assert fast.trainer.state.global_step == 4
        return
    assert isinstance(fast.error, FloatingPointError), fast.why()
    assert "step" in str(fast.error)
    assert_documented("on_nonfinite_loss", why="a diverging run: FastSFT stops it, SFTTrainer finishes it")


def test_an_fp32_run_with_a_huge_learning_rate_finishes_alike(one_thread, tmp_path):
    """The run breaks down (a loss or gradient norm non-finite or zero: the weights blown to where nothing trains,
    which releases reach by either road), SFTTrainer finishes it all the same, and so does FastSFT, alike."""
    plain = run("trl", tmp_path, learning_rate=1e6, max_steps=4)
    fast = run("nbkit", tmp_path, learning_rate=1e6, max_steps=4, on_nonfinite_loss="off")
    assert plain.error is None and plain.trainer.state.global_step == 4, plain.why()
    broken = plain.losses + plain.series("grad_norm")
    assert any(not math.isfinite(x) or x == 0.0 for x in broken), plain.log
    assert_same_outcome(plain, fast)


# -- a wrong train_dataset --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["DatasetDict", "list", "dict"])
def test_a_train_dataset_that_is_not_a_dataset_fails_alike(tmp_path, given):
    """TRL raises ``TypeError`` naming ``train_dataset`` and the type it got."""

    def data():
        rows = dataset("text", n=4)
        if given == "DatasetDict":
            return DatasetDict({"train": rows, "test": rows})
        return rows.to_list() if given == "list" else rows.to_dict()

    plain, fast = both(tmp_path, data=data, train=False)
    assert isinstance(plain.error, TypeError), plain.why()
    assert_same_outcome(plain, fast, names=("train_dataset", given))


def test_no_train_dataset_fails_alike(tmp_path):
    plain, fast = both(tmp_path, data=lambda: None, train=False)
    assert_same_outcome(plain, fast, names=("train_dataset",))


# -- trainer.data_collator --------------------------------------------------------------------------------------------

COLLATOR_SETTINGS = {
    "defaults": {},
    "packed": {"packing": True},
    "padding_free": {"padding_free": True, "max_length": None},
    "completion_only": {"completion_only_loss": True},
}


def _collated(tmp_path, settings: str):
    """Both trainers (not trained) on the same settings, and each one's ``data_collator`` of its first rows."""
    fmt = "prompt" if settings == "completion_only" else "text"
    plain, fast = both(tmp_path, data=lambda: dataset(fmt, n=8), train=False, **COLLATOR_SETTINGS[settings])
    assert plain.error is None and fast.error is None, (plain.why(), fast.why())
    rows = min(4, len(plain.trainer.train_dataset))
    return [(o, o.trainer.data_collator([o.trainer.train_dataset[i] for i in range(rows)])) for o in (plain, fast)]


@pytest.mark.parametrize("settings", list(COLLATOR_SETTINGS))
def test_data_collator_returns_what_trls_returns(one_thread, tmp_path, settings):
    """``trainer.data_collator(rows)`` on the prepared rows: the same keys, types, shapes, dtypes and values."""
    (_, want), (_, got) = _collated(tmp_path, settings)
    assert_same_batch(got, want, f"data_collator ({settings})")


@pytest.mark.parametrize("settings", list(COLLATOR_SETTINGS))
def test_a_collated_batch_moves_to_a_device_and_feeds_the_model(one_thread, tmp_path, settings):
    """User code that moves SFTTrainer's collated batch to a device and calls ``model(**batch)`` works on FastSFT's
    and gets the same loss: ``{k: v.to(device) for k, v in batch.items()}`` where SFTTrainer's batch holds tensors
    only, else the same with non-tensors passed through (TRL's padding-free batches hold ints)."""
    collated = _collated(tmp_path, settings)
    tensors_only = all(isinstance(v, torch.Tensor) for v in collated[0][1].values())
    losses = []
    for outcome, batch in collated:
        if tensors_only:
            moved = {k: v.to("cpu") for k, v in batch.items()}
        else:
            moved = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.no_grad():
            losses.append(float(outcome.trainer.model(**moved).loss))
    assert_same_series(losses[1:], losses[:1], LOSS_TOL, "model(**batch).loss")


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_gradient_accumulation_trains_to_the_same_losses(one_thread, tmp_path, packing):
    """Two micro-batches per step: TRL normalises the loss by the tokens of the whole step."""
    plain, fast = both(tmp_path, data=lambda: dataset("messages", n=32), gradient_accumulation_steps=2,
                       per_device_train_batch_size=2, packing=packing, assistant_only_loss=True)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


@pytest.mark.parametrize("config", ["SFTConfig", "TrainingArguments"])
def test_fastsft_takes_trls_own_config_classes(one_thread, tmp_path, config):
    """``FastSFT(args=SFTConfig(...))`` or ``TrainingArguments`` (which SFTTrainer converts): the same run as
    SFTTrainer's with the same object's settings."""
    from transformers import TrainingArguments
    from trl import SFTConfig

    config_cls = SFTConfig if config == "SFTConfig" else TrainingArguments
    base = {k: v for k, v in BASE.items() if k != "max_length"}  # not a TrainingArguments field
    settings = {"packing": True, "max_length": 64} if config == "SFTConfig" else {}
    plain, fast = both(tmp_path, config_cls=config_cls, base=base, **settings)
    assert_trains(plain)
    assert_same_outcome(plain, fast)


class CheckpointingSeen(TrainerCallback):
    """What a callback reads of the model's gradient checkpointing during ``train()``: the layers' flags at each step
    end, and whether nbkit's layer runner had taken over a layer then (the test could not fail without it)."""

    def __init__(self) -> None:
        self.flags: list[tuple[bool, ...]] = []
        self.taken: list[bool] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        from nbkit.speedups.layer_runner import run_as_is

        layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing") and hasattr(m, "self_attn")]
        self.flags.append(tuple(bool(m.gradient_checkpointing) for m in layers))
        self.taken.append(any(getattr(m, "_gradient_checkpointing_func", None) is run_as_is for m in layers))


def test_gradient_checkpointing_reads_as_on_during_training_alike(one_thread, tmp_path):
    """``model.is_gradient_checkpointing`` (any layer's flag) read inside a callback during ``train()``: on for both,
    while FastSFT's layer runner has taken the checkpointed layers over; and on again after."""
    seen = []

    def extra(tok):
        seen.append(CheckpointingSeen())
        return {"callbacks": [seen[-1]]}

    plain, fast = both(tmp_path, extra=extra, gradient_checkpointing=True)
    assert_trains(plain)
    assert_same_outcome(plain, fast)
    want, got = seen
    assert want.flags and all(all(f) for f in want.flags) and not any(want.taken)
    assert got.flags == want.flags
    assert all(got.taken), "the layer runner never took the checkpointed layers over: the test proves nothing"
    layers = [m for m in fast.trainer.model.modules() if hasattr(m, "gradient_checkpointing") and hasattr(m, "self_attn")]
    assert layers and all(m.gradient_checkpointing for m in layers)
