"""Generated instruction data for the demo: a skill a tiny model learns in a few hundred CPU steps.

The skill is word reversal: "Reverse the words: red fox moon" -> "moon fox red". It is algorithmic (the model
must copy tokens from the prompt in reverse order, not memorise answers), so a held-out split of unseen word
combinations measures whether it learned it; every word is a single token of the demo tokenizer, and a randomly
initialised 4-layer model with LoRA gets most of the eval split right within a few hundred steps.

Everything is deterministic given ``seed``. The eval split is generated first and the train split never contains
one of its questions, so eval prompts are truly held out.

Three dataset formats, as TRL's ``SFTTrainer`` reads them:
- ``"messages"`` (conversational): ``[{"role": "user", ...}, {"role": "assistant", ...}]``;
- ``"prompt"`` (prompt-completion): ``prompt`` = ``"Question: ...\\nAnswer:"``, ``completion`` = ``" ..."``;
- ``"text"`` (plain language modeling): ``"Question: ...\\nAnswer: ..."``.
"""

from __future__ import annotations

import random
from typing import Literal

from datasets import Dataset

Format = Literal["messages", "prompt", "text"]
Split = Literal["train", "eval"]

# 40 short everyday words; the demo tokenizer keeps each one (with its leading space) as a single token.
WORDS: tuple[str, ...] = (
    "red", "blue", "green", "gold", "pink", "gray", "black", "white",
    "cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen",
    "sun", "moon", "star", "rain", "snow", "wind", "fire", "ice",
    "tree", "leaf", "rock", "sand", "lake", "hill", "road", "ship",
    "cup", "box", "key", "pen", "hat", "bell", "lamp", "book",
)  # fmt: skip
MIN_WORDS, MAX_WORDS = 3, 4
EVAL_SIZE = 256
INSTRUCTION = "Reverse the words:"


def _question(words: list[str]) -> str:
    return f"{INSTRUCTION} {' '.join(words)}"


def _sample(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(WORDS) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
    return _question(words), " ".join(reversed(words))


def _eval_pairs(seed: int) -> list[tuple[str, str]]:
    rng = random.Random(f"nbkit-demo-eval-{seed}")
    pairs: dict[str, str] = {}
    while len(pairs) < EVAL_SIZE:
        question, answer = _sample(rng)
        pairs.setdefault(question, answer)
    return list(pairs.items())


def demo_pairs(n: int, split: Split = "train", seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (question, answer) pairs of ``split``; the same arguments always give the same pairs.

    ``split="eval"`` has at most ``EVAL_SIZE`` distinct pairs; ``split="train"`` never repeats one of them.
    """
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    if split == "eval":
        if n > EVAL_SIZE:
            raise ValueError(f"n={n}: the eval split has {EVAL_SIZE} examples")
        return _eval_pairs(seed)[:n]
    if split != "train":
        raise ValueError(f"split={split!r}: use 'train' or 'eval'")
    held_out = {question for question, _ in _eval_pairs(seed)}
    rng = random.Random(f"nbkit-demo-train-{seed}")
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n:
        question, answer = _sample(rng)
        if question not in held_out:
            pairs.append((question, answer))
    return pairs


def format_pair(question: str, answer: str, format: Format) -> dict:
    """One dataset row of ``format`` for a (question, answer) pair."""
    if format == "messages":
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    if format == "prompt":
        return {"prompt": f"Question: {question}\nAnswer:", "completion": f" {answer}"}
    if format == "text":
        return {"text": f"Question: {question}\nAnswer: {answer}"}
    raise ValueError(f"format={format!r}: use 'messages', 'prompt' or 'text'")


def make_dataset(format: Format = "messages", n: int = 2000, split: Split = "train", seed: int = 0) -> Dataset:
    """A ``datasets.Dataset`` of ``n`` demo examples of ``split`` in ``format`` (see the module docstring)."""
    rows = [format_pair(question, answer, format) for question, answer in demo_pairs(n, split, seed)]
    if not rows:  # Dataset.from_list([]) has no columns; keep the schema
        return Dataset.from_dict({key: [] for key in format_pair("q", "a", format)})
    return Dataset.from_list(rows)
