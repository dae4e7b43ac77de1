"""(Re)build the small tokenizer nbkit ships for its demo: ``python tools/build_demo_tokenizer.py``.

A byte-level BPE (any text encodes, nothing is ever unknown) with a ~1K vocabulary, trained on the demo data
(nbkit.demo.data) plus the generic English below, so that every demo word is one token and ordinary English
still encodes compactly. Digits are split one per token, as in Llama/Qwen tokenizers.

Special tokens (ChatML, as in Qwen): ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos, ends a
turn). The chat template wraps each assistant turn's content and its ``<|im_end|>`` in ``{% generation %}`` /
``{% endgeneration %}``, which TRL's ``assistant_only_loss`` needs to mask everything else; the end-of-turn token
is inside the markers, so the model is trained to stop.

Output: nbkit/demo/assets/tokenizer/ (tokenizer.json, tokenizer_config.json, chat_template.jinja), loadable offline
with ``AutoTokenizer.from_pretrained(path)``. Deterministic: the same inputs give the same files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nbkit.demo.data import WORDS, demo_pairs, format_pair  # noqa: E402

VOCAB_SIZE = 1024
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
DEFAULT_OUT = ROOT / "nbkit" / "demo" / "assets" / "tokenizer"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Generic English (written for this file) so that non-demo text does not fall back to single bytes.
ENGLISH = """
The quick brown fox jumps over the lazy dog. A small model can learn a simple skill when the data is clean and
the task is clear. We train the model for a few hundred steps and then ask it a question it has never seen.
Language models read text as a sequence of tokens. Each token is a piece of a word, a whole word, or a sign.
This tokenizer is small on purpose: it has about one thousand tokens, which is enough for short English sentences
and for the words the demo uses. Numbers are written one digit at a time, so 2024 becomes four tokens.
Once upon a time there was a little house on a hill. In the house lived an old man, his wife and their cat.
Every morning the man walked down the road to the lake, and every evening he came back with a fish for dinner.
The weather was cold in winter and warm in summer. In spring the trees were green and the birds sang all day.
What is your name? Where do you live? How old are you? Why is the sky blue? When does the train leave?
Please write a short answer. Thank you very much. You are welcome. Good morning, good night, see you soon.
The user asks a question and the assistant gives an answer. The assistant should be helpful, honest and brief.
Training a model means changing its weights so that it predicts the next token better. The loss goes down as
the model learns. A learning rate that is too high makes the loss jump; one that is too low makes it crawl.
Memory is limited, so we load the base model in four bits and train small adapters on top of it.
First, second, third, last. One, two, three, four, five, six, seven, eight, nine, ten, hundred, thousand.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April, May, June,
July, August, September, October, November, December. North, south, east, west, left, right, up, down.
I think that this is a good idea, but we should test it first. They said it would work, and it did.
She reads a book in the garden while he cooks dinner in the kitchen. The children play outside with the dog.
Open the door, close the window, turn on the light, and sit down at the table. Read the text and answer below.
Python is a programming language. A function takes arguments and returns a value. Write code that is simple.
The river runs through the valley and under the old stone bridge near the village school and the market square.
People buy bread, milk, eggs, cheese, apples, oranges and vegetables at the market on Saturday morning.
My brother works at a hospital in the city. His friend is a teacher, and her sister is a doctor at the clinic.
We went to the mountains for a holiday last year. It rained every day, but we still had a wonderful time.
The computer could not find the file, so the program stopped with an error message and printed a warning.
If you want to learn something new, practice a little every day and do not be afraid of making mistakes.
The meeting starts at nine o'clock. Please bring your notes, a pencil and the report from last week.
Scientists study the world by asking questions, making careful measurements and testing their ideas.
Music, art, history, science, mathematics and languages are taught at the school in the centre of town.
The museum was closed on Monday, so we visited the park, walked along the beach and watched the sunset.
Can you help me with this problem? I have tried several times, but the answer is still not correct.
Water boils at one hundred degrees and freezes at zero. Ice is lighter than water, so it floats.
The farmer has many animals: horses, sheep, goats, chickens and a very friendly old brown dog.
When the phone rang, everyone in the room looked up, but nobody wanted to answer it first.
He opened the letter slowly, read it twice, smiled, and then put it back into the envelope.
The company released a new version of the software with better performance and fewer problems.
Our family usually eats together in the evening and talks about what happened during the day.
Remember to save your work often, because the power might go out during a storm.
Every story has a beginning, a middle and an end. Good stories also have interesting characters.
The students listened carefully while the teacher explained how plants turn sunlight into energy.
Airplanes fly high above the clouds, where the air is thin and very cold, even in the middle of summer.
I would like a cup of tea with lemon, please, and maybe a small piece of chocolate cake as well.
The library has thousands of books about history, travel, cooking, nature, science and famous people.
After the long journey, they were tired and hungry, so they went straight to bed without dinner.
Small steps, taken every day, add up to large changes over months and years. Keep going and be patient.
This example shows how to count words, sort a list, reverse a sentence, and find the longest line.
The answer is yes. The answer is no. Maybe later. I do not know. Let me check and get back to you.
"""


def corpus() -> list[str]:
    """The training texts: the demo data in all three formats, the demo words, and the English above."""
    texts = [line.strip() for line in ENGLISH.strip().splitlines()]
    texts.append(" ".join(WORDS))
    texts += [f"{role}\n" for role in ("system", "user", "assistant")] * 8  # the chat template's role headers
    for question, answer in demo_pairs(4000, "train") + demo_pairs(256, "eval"):
        texts.append(format_pair(question, answer, "text")["text"])
        texts.append(f"{question}\n{answer}")
    return texts


def build(out: Path = DEFAULT_OUT, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train the BPE, wrap it as a transformers tokenizer with the chat template, save it to ``out``."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # offsets must map back to characters exactly: assistant masks are built from them
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the English text is small: let single occurrences merge too
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        model_max_length=2048,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    hf_tok.save_pretrained(str(out))
    return out


def check(path: Path) -> None:
    """Fail loudly if the saved tokenizer does not do what the demo relies on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.eos_token == IM_END and tok.pad_token == PAD, (tok.eos_token, tok.pad_token)
    for word in WORDS:
        ids = tok.encode(" " + word, add_special_tokens=False)
        assert len(ids) == 1, f"demo word {word!r} is {len(ids)} tokens"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red fox"}]
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "red fox" + IM_END, tok.decode(masked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    path = build(args.out, args.vocab_size)
    check(path)
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"wrote {path} ({size / 1024:.0f} KiB): {', '.join(sorted(f.name for f in path.iterdir()))}")


if __name__ == "__main__":
    main()
