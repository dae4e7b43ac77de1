"""Greedy chat answers of a causal LM: what ``python -m nbkit demo`` and the notebooks score before and after training.

Why its own module: the demo (a CLI) and ``nbkit.notebook`` (notebook plumbing) both answer held-out prompts the same
way, and neither should import the other for it.

Contract of ``generate_answers``: each question becomes one user turn in the tokenizer's chat template with the
generation prompt added; prompts are left-padded in batches; decoding is greedy (``do_sample=False``) and stops at
the tokenizer's end of turn or after ``max_new_tokens``; the answer is the decoded new tokens without special tokens,
stripped. The model's train/eval mode and the tokenizer's padding side are restored afterwards.

``fast=True`` decodes each batch through ``nbkit.decode.dense`` where it applies (a CUDA GPU with room for a dense
copy of the weights, a supported family, ``min_new_tokens=0``): the batch's step is one CUDA graph, so a batch costs
about what one answer does; a greedy token differs from ``generate``'s only where two logits tie within rounding.
Elsewhere (``nbkit.decode.choose`` says why), and with ``fast=False``, each batch goes through ``model.generate``
(``nbkit.decode.plain``) with the arguments it always had.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .choose import choose, decoders_of
from .config import batch_config
from .dense import signature_of


@torch.no_grad()
def generate_answers(
    model: torch.nn.Module, tokenizer: Any, questions: Sequence[str], max_new_tokens: int = 12, batch_size: int = 32,
    min_new_tokens: int = 0, fast: bool = True,
) -> list[str]:
    """Greedy answers of ``model`` to chat ``questions`` (left-padded batches), decoded without special tokens.

    MoE models are asked for no router logits: TRL's ``SFTTrainer`` turns ``output_router_logits`` on in the config
    for its auxiliary loss, and with it a padded ``generate`` fails at the first decode step."""
    was_training = model.training
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    device = next(p.device for p in model.parameters())
    answers: list[str] = []
    config = getattr(model, "config", None)
    router = {"output_router_logits": False} if getattr(config, "output_router_logits", None) else {}
    try:
        for start in range(0, len(questions), batch_size):
            prompts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                )
                for q in questions[start : start + batch_size]
            ]
            batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            total = batch["input_ids"].shape[1] + max_new_tokens
            dense = fast and not min_new_tokens and not router  # what the dense step takes
            signature = signature_of(model) if dense else None
            path = choose(model, total, len(prompts), signature=signature, graphed=False)[0] if dense else "generate"
            decoders = decoders_of(model)
            if path == "dense":
                config = batch_config(model, tokenizer, max_new_tokens)
                rows = decoders.dense.generate(model, batch["input_ids"], config, batch["attention_mask"],
                                               signature=signature)
            else:  # generate's own arguments, as before the dense path existed
                rows = decoders.plain.generate(
                    model, batch["input_ids"], None, batch["attention_mask"], max_new_tokens=max_new_tokens,
                    do_sample=False, use_cache=True, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id, min_new_tokens=min_new_tokens, **router)
            answers += [text.strip() for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return answers
