"""A MoE model trained by FastSFT generates afterwards: TRL's ``output_router_logits=True`` holds inside ``train()``
only (CPU, fp32).

TRL's ``SFTTrainer.__init__`` turns ``output_router_logits`` on in a MoE config for its load-balancing loss; left on,
a left-padded batched ``generate`` fails at its first decode step (the aux loss is computed over the padded prompt's
mask with one new token's router logits). For each tiny MoE family: train a few steps, then generate several new
tokens for prompts of different lengths (``min_new_tokens`` forces the decode steps); during training the value
must be TRL's (so the aux loss is unchanged), after it the user's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from nbkit import FastSFT, FastSFTConfig
from nbkit.demo.data import make_dataset
from nbkit.demo.models import MOE_FAMILIES, tiny_model

NEW_TOKENS = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


class _RecordRouterSetting(TrainerCallback):
    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append(model.config.get_text_config().output_router_logits)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_model_generates_padded_batches_after_training(tokenizer, tmp_path, family):
    model = tiny_model(family, len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    user_value = model.config.get_text_config().output_router_logits
    args = FastSFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, report_to=[], save_strategy="no", bf16=False, use_cpu=True, seed=0,
                         disable_tqdm=True, max_length=64, packing=True, live_dashboard=False,
                         gradient_checkpointing=False, dataloader_num_workers=0)
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=16),
                      processing_class=tokenizer)
    assert trainer.aux_loss_enabled  # TRL trains with the load-balancing loss
    recorder = _RecordRouterSetting()
    trainer.add_callback(recorder)
    assert model.config.get_text_config().output_router_logits == user_value  # before train(): the user's
    trainer.train()
    assert recorder.seen == [True, True]  # TRL's value during training: the aux loss is the same
    assert model.config.get_text_config().output_router_logits == user_value  # after: the user's again

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(["reverse: red fox blue sky green tree", "hi"], return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    assert (batch["attention_mask"] == 0).any()  # a padded batch
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (2, batch["input_ids"].shape[1] + NEW_TOKENS)

    trainer.train()  # a second train() trains with TRL's value again
    assert recorder.seen[-2:] == [True, True]
    assert model.config.get_text_config().output_router_logits == user_value
