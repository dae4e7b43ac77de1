"""PEFT prompt tuning, P-tuning and prefix tuning train under FastSFT exactly as under SFTTrainer: TRL's own path
(``nbkit.speedups.fast_path``: the virtual tokens and prefix key/values are not in nbkit's packed boundaries), the
same collator and batches, the same losses (bitwise: the same code runs), and the prompt parameters learn; given as
``peft_config=`` or on a model already wrapped by ``get_peft_model``. Prefix tuning fails under gradient
checkpointing in SFTTrainer (checkpointed layers drop the prefix's key/values); FastSFT turns checkpointing off for
it and trains as SFTTrainer does without it.

CPU, fp32, a tiny Qwen3 built from its config, the demo tokenizer.
"""

from __future__ import annotations

import pytest
import torch
from parity import assert_same_batches, assert_same_series, fast_sft, tiny_lm, train
from trl import SFTTrainer

from nbkit.demo.tokenizer import load_demo_tokenizer
from nbkit.speedups.fast_path import prompt_learning


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


def _prompt_configs():
    from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig

    return {
        "prompt_tuning": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "p_tuning": PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=32),
        "prefix_tuning": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    }


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning", "prefix_tuning"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["peft_config", "get_peft_model"])
def test_prompt_learning_trains_exactly_as_sfttrainer(tok, tmp_path, method, wrapped):
    """Prompt tuning, P-tuning and prefix tuning, given as peft_config= or on a model already wrapped by
    get_peft_model: TRL's path (its padded batches), the same losses, and the prompt parameters learn."""
    from peft import get_peft_model

    def make():
        model = tiny_lm("qwen3", tokenizer=tok)
        if wrapped:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = get_peft_model(model, _prompt_configs()[method])
        return model

    from nbkit import FastSFT

    lora = False if wrapped else _prompt_configs()[method]
    settings = dict(lora=lora, packing=False, learning_rate=1e-2, gradient_checkpointing=True)
    # prefix tuning fails under gradient checkpointing in SFTTrainer; FastSFT turns it off, and trains as SFTTrainer
    # does without it
    plain = fast_sft(tmp_path / "plain", trainer_cls=SFTTrainer, model=make(),
                     **{**settings, "gradient_checkpointing": method != "prefix_tuning"})
    fast = fast_sft(tmp_path / "fast", trainer_cls=FastSFT, model=make(), **settings)
    assert fast.nbkit_path.plain and prompt_learning(fast.model) is not None
    assert bool(fast.nbkit_path.no_checkpointing) == (method == "prefix_tuning")
    assert_same_batches(plain, fast)
    before = {n: p.detach().clone() for n, p in fast.model.named_parameters() if p.requires_grad}
    want, got = train(plain), train(fast)
    assert fast.nbkit_attached == []
    assert_same_series(got.losses, want.losses)
    assert all(torch.isfinite(torch.tensor(got.losses)))
    moved = [n for n, p in fast.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved, "no prompt parameter was trained"
