"""Where FastSFT differs from SFTTrainer on purpose, and only there: the README's one table of differences names a
setting for each that FastSFTConfig accepts; a diverging run stops by design and ``on_nonfinite_loss="off"`` gives
SFTTrainer's run; trainable weights never sit below the run's compute precision.

CPU, tiny models built from configs in code, the demo tokenizer.
"""

from __future__ import annotations

import pytest
import torch
from parity import Tol, assert_same_series, fast_sft, tiny_lm, train
from trl import SFTTrainer

from nbkit.demo.tokenizer import load_demo_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


def test_a_diverging_run_stops_by_design_and_off_gives_sfttrainers_run(tok, tmp_path):
    """An fp16 model at learning rate 0.1 diverges at its third step: SFTTrainer trains on; FastSFT's default
    (on_nonfinite_loss="stop", a deliberate difference in the README's table) raises; "off" gives SFTTrainer's run
    (losses within 1e-3 relative: fp16, the packed path sums in another order)."""
    from nbkit import FastSFT
    from nbkit.reliability.nonfinite import NonFiniteLossError

    settings = dict(lora=None, learning_rate=0.1, max_steps=3)
    make = lambda: tiny_lm("qwen3", tokenizer=tok).half()  # noqa: E731
    want = train(fast_sft(tmp_path / "plain", trainer_cls=SFTTrainer, model=make(), **settings))
    assert len(want.losses) == 3
    with pytest.raises(NonFiniteLossError):
        fast_sft(tmp_path / "stop", trainer_cls=FastSFT, model=make(), **settings).train()
    got = train(fast_sft(tmp_path / "off", trainer_cls=FastSFT, model=make(), on_nonfinite_loss="off", **settings))
    assert_same_series(got.losses, want.losses, Tol(rtol=1e-3, atol=1e-3))


# ---------------------------------------------------------------------------------------------------------------
# precision


@pytest.mark.parametrize("bf16", [False, True])
def test_trainable_weights_are_not_left_below_the_compute_precision(tok, tmp_path, bf16):
    """TRL's QLoRA recipe casts trainable weights to bf16; without mixed precision (a CPU) they would meet fp32
    activations outside the trainer. Under bf16 mixed precision TRL's bf16 stays."""
    from parity import add_lora

    model = add_lora(tiny_lm("qwen3", tokenizer=tok))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.bfloat16)  # what TRL does to a quantized model's adapters
    fast = fast_sft(tmp_path, model=model, lora=False, bf16=bf16)
    dtypes = {p.dtype for p in fast.model.parameters() if p.requires_grad}
    assert dtypes == ({torch.bfloat16} if bf16 else {torch.float32})


# ---------------------------------------------------------------------------------------------------------------
# the README's one table of differences


def _differences_table() -> list[list[str]]:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("\n## Where FastSFT differs from SFTTrainer\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return rows[1:]  # below the header


def test_every_setting_the_differences_table_names_is_one_fastsftconfig_accepts():
    import ast
    import re

    from nbkit import FastSFTConfig
    from nbkit.settings import SWITCH_VALUES, value_problem

    rows = _differences_table()
    assert len(rows) >= 10 and all(len(row) == 3 for row in rows)
    settings = {}
    for row in rows:
        for name, value in re.findall(r"`(\w+)=([^`]+)`", row[2]):
            settings[name] = ast.literal_eval(value)
    for name in ("on_nonfinite_loss", "validate_inputs", "bf16", "cached_packing", "atomic_saves"):
        assert name in settings, f"the table gives no setting for {name}"
    for name, value in settings.items():
        assert name in FastSFTConfig.__dataclass_fields__, name
        if name in SWITCH_VALUES:
            assert value_problem(name, value) is None, name
        FastSFTConfig(**{"output_dir": "unused", "use_cpu": True, "live_dashboard": False, name: value})  # accepted
