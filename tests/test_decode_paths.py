"""``nbkit.decode``'s paths on a CPU, their steps captured through ``nbkit.ops.layer_graphs.TapeBackend`` (the CPU
stand-in for CUDA graphs: the recorded ops replayed on the recorded tensors, Python not re-run).

- The graphed path's captured step gives ``generate``'s greedy tokens exactly (float32), is captured once and sees
  an in-place weight update without a new capture.
- The dense path's captured step is its eager step: the same greedy tokens (and ``generate``'s), and with the same
  seed the same sampled tokens.
- Sampling reads the step's own logits: ``top_k=1`` (and ``min_p=1``) sampling is greedy decoding on every path;
  every drawn first token is one the filters keep, and the draws vary; over 300 seeds the first tokens' frequencies
  are the filtered softmax's probabilities (5 standard errors + 0.01); a seed repeats its tokens, another seed does
  not. A sampling step that cannot be captured leaves greedy decoding on the dense path.
- The plain path's sampled tokens are ``generate``'s own for that seed, and torch's global random state is as it was.
- The chooser takes dense, then graphed, then ``generate``; the decoders live beside the model (not in its
  ``__dict__``, not in a copy of it), go when it goes, and ``release_decoders`` frees both fast paths.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from nbkit.decode import choose as chooser
from nbkit.decode.chat import answer, prompt_ids
from nbkit.decode.config import GenerationSettings, chat_config, greedy_config
from nbkit.decode.dense import DenseDecoder
from nbkit.decode.graphed import GraphedDecoder
from nbkit.decode.plain import PlainDecoder
from nbkit.decode.shared import Unsupported
from nbkit.ops import sampling
from nbkit.ops.layer_graphs import TapeBackend

QUESTION = "Reverse the words: red fox moon and the sea"
SAMPLE = GenerationSettings(max_new_tokens=20, temperature=1.5, min_p=0.1, seed=3)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    from nbkit.demo.tokenizer import load_demo_tokenizer

    return load_demo_tokenizer()


def _model(tok, family="qwen3", seed=0):
    from peft import LoraConfig, get_peft_model

    from nbkit.demo.models import tiny_model

    model = tiny_model(family, len(tok), seed=seed, pad_token_id=tok.pad_token_id, eos_token_id=None)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                 lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def _ids(tok):
    return prompt_ids(tok, [{"role": "user", "content": QUESTION}], torch.device("cpu"))


def _generate(model, tok, ids, n):
    return model.generate(input_ids=ids, generation_config=greedy_config(model, tok, n))[0, ids.shape[1]:].tolist()


def test_the_graphed_step_replays_generates_greedy_tokens(tok):
    model, ids = _model(tok), _ids(tok)
    decoder = GraphedDecoder(backend=TapeBackend())
    assert decoder.check(model, ids.shape[1] + 24) is None
    assert decoder.generate(model, ids, greedy_config(model, tok, 24)) == _generate(model, tok, ids, 24)
    with torch.no_grad():  # an optimizer step in place: the replay reads the parameters where they are
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)
    again = decoder.generate(model, ids, greedy_config(model, tok, 24))
    assert again == _generate(model, tok, ids, 24)
    assert decoder.captures == 1
    assert GraphedDecoder().check(model, 64) == "no CUDA device"  # CUDA graphs need CUDA


def test_the_dense_captured_step_is_its_eager_step_greedy_and_sampling(tok):
    model, ids = _model(tok, "llama"), _ids(tok)
    taped, eager = DenseDecoder(backend=TapeBackend()), DenseDecoder(graphs=False)
    config = greedy_config(model, tok, 24)
    assert taped.generate(model, ids, config) == eager.generate(model, ids, config) == [_generate(model, tok, ids,
                                                                                                  24)]
    sampled_config = chat_config(model, tok, SAMPLE)
    sampled = taped.generate(model, ids, sampled_config, settings=SAMPLE)
    assert sampled == eager.generate(model, ids, sampled_config, settings=SAMPLE)
    assert taped.captures == 2  # greedy and sampling: one step each, on the same buffers
    assert len(taped._states) == 1


def _paths(model):
    return {"dense": DenseDecoder(backend=TapeBackend()), "graphed": GraphedDecoder(backend=TapeBackend())}


def _run(path, decoder, model, ids, config, settings):
    if path == "dense":
        return decoder.generate(model, ids, config, settings=settings)[0]
    return decoder.generate(model, ids, config, settings=settings)


def test_sampling_draws_from_the_steps_own_logits(tok):
    model, ids = _model(tok), _ids(tok)
    greedy = _generate(model, tok, ids, 16)
    with torch.no_grad():
        last = model(input_ids=ids).logits[0, -1]
    allowed = torch.isfinite(sampling.filter_logits(last[None], sort=False, **SAMPLE.sampling_tensors(
        torch.device("cpu"))))[0]
    for path, decoder in _paths(model).items():
        for narrow in (GenerationSettings(max_new_tokens=16, temperature=2.0, top_k=1, seed=1),
                       GenerationSettings(max_new_tokens=16, temperature=2.0, min_p=1.0, seed=1)):
            assert _run(path, decoder, model, ids, chat_config(model, tok, narrow), narrow) == greedy, path
        firsts = set()
        for seed in range(12):
            one = GenerationSettings(max_new_tokens=1, temperature=1.5, min_p=0.1, seed=seed)
            firsts |= set(_run(path, decoder, model, ids, chat_config(model, tok, one), one))
        assert all(allowed[t] for t in firsts) and len(firsts) > 1, (path, firsts, int(allowed.sum()))
        config = chat_config(model, tok, SAMPLE)
        first = _run(path, decoder, model, ids, config, SAMPLE)
        assert _run(path, decoder, model, ids, config, SAMPLE) == first and len(first) == 20
        other = GenerationSettings(max_new_tokens=20, temperature=1.5, min_p=0.1, seed=4)
        assert _run(path, decoder, model, ids, config, other) != first


def test_the_plain_path_samples_as_generate_does_for_the_seed(tok):
    model, ids = _model(tok), _ids(tok)
    settings = GenerationSettings(max_new_tokens=20, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=11)
    config = chat_config(model, tok, settings)
    state = torch.random.get_rng_state()
    got = PlainDecoder().generate(model, ids, config, settings=settings)[0]
    assert torch.equal(torch.random.get_rng_state(), state)  # the user's random state is left as it was
    torch.manual_seed(11)
    want = model.generate(input_ids=ids, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                          max_new_tokens=20, pad_token_id=tok.pad_token_id, eos_token_id=None)
    assert got == want[0, ids.shape[1]:].tolist()
    assert got != _generate(model, tok, ids, 20)
    plain = answer(model, tok, QUESTION, max_new_tokens=20, stream=False, fast=False, temperature=0.8, top_k=20,
                   top_p=0.9, min_p=0.05, seed=11)
    assert plain.token_ids == got and plain.path == "generate"


def test_the_chooser_goes_dense_graphed_generate_and_keeps_decoders_beside_the_model(tok):
    model = _model(tok)
    before = set(model.__dict__)
    kept = chooser.decoders_of(model)
    kept.dense, kept.graphed = _paths(model).values()  # what a GPU makes, on tapes
    assert chooser.decoders_of(model.get_base_model()) is kept  # a wrapper and its base share them
    pieces: list[str] = []
    dense = answer(model, tok, QUESTION, max_new_tokens=16, stream=pieces.append, temperature=1.5, min_p=0.1,
                   seed=5)
    assert dense.path == "dense" and dense.reason is None and "".join(pieces) == dense.text
    graphed = answer(model, tok, QUESTION, max_new_tokens=16, stream=False, exact=True, temperature=1.5,
                     min_p=0.1, seed=5)
    assert graphed.path == "graphed" and graphed.token_ids == dense.token_ids  # same logits, same draws
    greedy = answer(model, tok, QUESTION, max_new_tokens=16, stream=False, exact=True)
    assert greedy.token_ids == _generate(model, tok, _ids(tok), 16)
    model.generation_config.repetition_penalty = 1.3  # neither fast path takes it
    fallback = answer(model, tok, QUESTION, max_new_tokens=16, stream=False)
    assert fallback.path == "generate" and "repetition_penalty" in fallback.reason
    model.generation_config.repetition_penalty = 1.0
    assert set(model.__dict__) == before  # nothing kept on the user's object
    assert chooser.kept_decoders(copy.deepcopy(model)) is None
    chooser.release_decoders(model)
    assert kept.dense.weights is None and kept.graphed._step is None
    assert answer(model, tok, QUESTION, max_new_tokens=16, stream=False, exact=True).path == "graphed"
    count = len(chooser._KEPT)
    del model, kept
    gc.collect()
    assert len(chooser._KEPT) == count - 1  # the decoders go with the model


def test_a_sampling_step_that_cannot_be_captured_leaves_the_greedy_dense_path(tok, monkeypatch):
    model = _model(tok)
    kept = chooser.decoders_of(model)
    kept.dense, kept.graphed = _paths(model).values()
    real = DenseDecoder._capture

    def capture(self, state, mode):
        if mode != "greedy":
            raise Unsupported("its dense step cannot be captured (a sort the backend refuses)")
        return real(self, state, mode)

    monkeypatch.setattr(DenseDecoder, "_capture", capture)
    assert answer(model, tok, QUESTION, max_new_tokens=8, stream=False).path == "dense"
    sampled = answer(model, tok, QUESTION, max_new_tokens=8, stream=False, temperature=1.5, top_p=0.9, seed=0)
    assert sampled.path == "graphed" and "a sort the backend refuses" in sampled.reason
    assert answer(model, tok, QUESTION, max_new_tokens=8, stream=False).path == "dense"
    assert kept.dense.captures == 1 and kept.dense.weights is not None


def test_first_tokens_follow_the_filtered_softmax_of_the_prompt(tok):
    """300 seeds, one token each, on both fast paths: each token's frequency is within 5 standard errors (plus 0.01)
    of its probability after temperature and min-p, and no filtered token is drawn."""
    model, ids = _model(tok), _ids(tok)
    with torch.no_grad():
        last = model(input_ids=ids).logits[0, -1]
    settings = GenerationSettings(max_new_tokens=1, temperature=0.1, min_p=0.1)
    probs = sampling.filter_logits(last[None], sort=False, **settings.sampling_tensors(torch.device("cpu"))
                                   ).softmax(-1)[0].double()
    assert 4 <= int((probs > 0).sum()) <= 40  # a few tokens kept, none dominant
    n = 300
    for path, decoder in _paths(model).items():
        counts = torch.zeros_like(probs)
        for seed in range(n):
            one = GenerationSettings(max_new_tokens=1, temperature=0.1, min_p=0.1, seed=seed)
            counts[_run(path, decoder, model, ids, chat_config(model, tok, one), one)[0]] += 1
        freq = counts / n
        assert (freq[probs == 0] == 0).all(), path
        se = (probs * (1 - probs) / n).sqrt()
        assert ((freq - probs).abs() <= 5 * se + 0.01).all(), (path, freq[probs > 0], probs[probs > 0])
