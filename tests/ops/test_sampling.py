"""``nbkit.ops.sampling`` against transformers' logits processors and against the softmax it draws from.

- Filters: for random logits, every combination of temperature, top-k, top-p and min-p keeps exactly the tokens
  transformers' ``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper`` -> ``MinPLogitsWarper``
  keep (``generate``'s order), and the kept scores equal theirs to 1e-6. Rows with tied logits keep the same scores
  (which of the tied tokens top-p keeps is the order a sort gives ties, there as here).
- Draws: 40,000 draws (one noise row each) from a 12-token distribution match its probabilities: every token's
  frequency within 5 standard errors (a wrong race, e.g. ``p * noise``, is off by far more), filtered tokens never.
- Seeds: the same generator seed gives the same tokens; another seed other tokens.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nbkit.decode.config import GenerationSettings
from nbkit.decode.sampler import Draws
from nbkit.ops import sampling


def _theirs(logits, temperature, top_k, top_p, min_p):
    scores = logits.clone()
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return scores


def _params(temperature, top_k, top_p, min_p):
    return GenerationSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).sampling_tensors(
        torch.device("cpu"))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", list(itertools.product(
    (1.0, 0.7, 1.5), (0, 1, 5, 40), (1.0, 0.9, 0.5), (0.0, 0.05, 0.3))))
def test_the_filters_keep_what_transformers_processors_keep(temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=gen) * 3
    logits[1, :8] = logits[1].max() + 1  # ties at the top: top-k keeps all of them
    logits[2, 10:20] = 0.5  # ties around the k-th value
    want = _theirs(logits, temperature, top_k, top_p, min_p)
    sort = bool(top_k) or top_p < 1.0
    got = sampling.filter_logits(logits, sort=sort, **_params(temperature, top_k or None, top_p, min_p or None))
    kept, wanted = torch.isfinite(got), torch.isfinite(want)
    assert torch.equal(kept[[0, 3]], wanted[[0, 3]])  # rows without ties: the very same tokens
    for row in range(4):  # rows with ties: top-p keeps as many of the tied tokens (which ones: the sort's order)
        torch.testing.assert_close(got[row][kept[row]].sort().values, want[row][wanted[row]].sort().values,
                                   rtol=1e-6, atol=1e-6)
    assert kept.any(dim=-1).all()  # each row keeps a token
    if top_k and top_p == 1.0:  # top-k alone keeps every token tied at the k-th value
        assert torch.equal(kept, wanted)


def test_without_sort_only_temperature_and_min_p_apply():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 2
    got = sampling.filter_logits(logits, sort=False, **_params(1.3, None, None, 0.1))
    want = _theirs(logits, 1.3, 0, 1.0, 0.1)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], rtol=1e-6, atol=1e-6)


def test_draws_follow_the_filtered_softmax():
    n, vocab = 40_000, 12
    logits = torch.linspace(-3, 1.5, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(2))]
    params = _params(1.2, None, None, 0.05)
    filtered = sampling.filter_logits(logits[None], sort=False, **params)[0]
    probs = filtered.softmax(-1)
    assert (probs == 0).sum() >= 2  # min-p removes the least likely tokens
    noise = torch.empty(n, vocab).exponential_(generator=torch.Generator().manual_seed(3))
    tokens = sampling.sample(logits.expand(n, vocab), noise, sort=False, **params)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    assert (freq[probs == 0] == 0).all()
    se = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * se + 1e-12).all(), (freq, probs)
    # the race's negative control: multiplying by the noise instead is a different distribution
    wrong = torch.bincount((probs * noise).argmax(-1), minlength=vocab).double() / n
    assert ((wrong - probs.double()).abs() > 5 * se).any()


def test_a_seed_repeats_its_draws():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(4))
    settings = GenerationSettings(temperature=1.5, min_p=0.01, top_p=0.95, seed=7)

    def draws(seed_settings):
        d = Draws(2, 300, torch.device("cpu"))
        d.load(seed_settings)
        out = []
        for _ in range(30):
            d.refill()
            out.append(d.choose(logits).tolist())
        return out

    first = draws(settings)
    assert draws(settings) == first
    assert draws(GenerationSettings(temperature=1.5, min_p=0.01, top_p=0.95, seed=8)) != first


def test_settings_say_when_they_sample():
    assert not GenerationSettings().sampling
    assert GenerationSettings(temperature=1.5, min_p=0.1).sampling
    assert not GenerationSettings(temperature=0).sampling
    assert GenerationSettings(do_sample=True).sampling and not GenerationSettings(min_p=0.1, do_sample=False).sampling
    assert GenerationSettings(top_p=0.9).needs_sort and not GenerationSettings(min_p=0.1).needs_sort
    for bad in (dict(top_p=0.0), dict(min_p=1.5), dict(top_k=-1), dict(temperature=-1.0), dict(max_new_tokens=0),
                dict(temperature=0.0, do_sample=True)):
        with pytest.raises(ValueError):
            GenerationSettings(**bad)
