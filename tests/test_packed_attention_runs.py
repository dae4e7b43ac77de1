"""How a layer finds its forward's ``PackedRun``: by the forward's ``cu_seq_lens_q``, in a table its ``PackedAttention``
owns, and the ``"nbkit"`` attention registered over that owner's runs while it is attached (CPU, fp32).

What could go wrong, each checked here: a checkpointed layer's recompute in the backward not finding its forward's
run, or reading another forward's (micro-batches one after another, an evaluation forward between them, two forwards
before their backwards); a second
forward reading the first's run (over a fresh tensor, or over the same tensor rewritten in place); the registry not
put back at detach, or a second owner attached inside the first taking the first model's calls; the attention
running without an owner or without a run it knows; the registry keeping a forgotten owner's model alive.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from parity import Run, add_lora, run_steps, tiny_lm
from transformers import AttentionInterface

from nbkit.demo.models import tiny_model
from nbkit.ops.packed_boundaries import metadata_from_lengths
from nbkit.ops.varlen_attention import KERNEL_FNS
from nbkit.speedups.packed_attention import ATTN_NAME, PackedAttention, nbkit_attention_forward

VOCAB = 97


@pytest.fixture
def runs(monkeypatch) -> list:
    """The ``PackedRun`` of every attention call on the exact SDPA kernel (auto's kernel on a CPU), in call order."""
    seen = []
    original = KERNEL_FNS["sdpa"]

    def spy(q, k, v, run, call):
        seen.append(run)
        return original(q, k, v, run, call)

    monkeypatch.setitem(KERNEL_FNS, "sdpa", spy)
    return seen


@pytest.fixture
def registry():
    """``"nbkit"`` naming the unattached function during the test (an owner another test left attached is not
    this test's), and what it named before after it."""
    before = AttentionInterface().get(ATTN_NAME, nbkit_attention_forward)
    AttentionInterface.register(ATTN_NAME, nbkit_attention_forward)
    yield
    AttentionInterface.register(ATTN_NAME, before)


def _ids(total: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, total), generator=torch.Generator().manual_seed(seed))


def _batch(lengths: list[int], seed: int) -> dict:
    ids = _ids(sum(lengths), seed)
    return {"input_ids": ids, "labels": ids, **metadata_from_lengths(lengths)}


def _lora(checkpointing: bool) -> torch.nn.Module:
    model = add_lora(tiny_lm("qwen3", VOCAB), random_b=0.02).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _layers(model: torch.nn.Module) -> int:
    return model.config.get_text_config().num_hidden_layers


def _steps(model: torch.nn.Module, batches: list[dict], between: dict) -> Run:
    """Per batch a training forward and its backward; an evaluation forward (no grad) of ``between`` after each."""

    def backward_then_evaluate(loss: torch.Tensor) -> None:
        loss.backward()
        model.eval()
        with torch.no_grad():
            model(**between)
        model.train()

    return run_steps(model, batches, backward=backward_then_evaluate)


def test_a_checkpointed_layer_recomputes_on_its_own_forwards_run(runs, registry, one_thread):
    """Non-reentrant checkpointing runs each layer's forward again in the backward, handed the same keyword
    arguments: the recompute finds the run of its own forward (not the evaluation forward's run in between, not the
    next micro-batch's), and the losses and LoRA gradients are those of the same steps without checkpointing."""
    batches = [_batch([9, 20, 4], seed=0), _batch([15, 15, 3], seed=1), _batch([33], seed=2)]
    between = _batch([5, 5, 23], seed=3)
    plain_model, model = _lora(checkpointing=False), _lora(checkpointing=True)
    layers = _layers(model)
    results = []
    for m in (plain_model, model):
        packed = PackedAttention()
        assert packed.attach(m)
        runs.clear()
        try:
            results.append(_steps(m, batches, between))
        finally:
            packed.detach()
    per_step = 2 * layers + layers  # forward and recompute, then the evaluation forward
    assert len(runs) == per_step * len(batches)
    for step, batch in enumerate(batches):
        trained = runs[step * per_step:step * per_step + 2 * layers]
        assert all(r is trained[0] for r in trained), "the recompute read another run than its forward"
        assert trained[0].host_offsets == batch["nbkit_cu_seqlens_host"]
        evaluated = runs[step * per_step + 2 * layers:(step + 1) * per_step]
        assert all(r is evaluated[0] and r is not trained[0] for r in evaluated)
    plain, checkpointed = results
    torch.testing.assert_close(checkpointed.losses, plain.losses, rtol=1e-5, atol=0)
    for got, want in zip(checkpointed.grads, plain.grads):
        assert got.keys() == want.keys() and got
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_recompute_after_a_later_forward_finds_its_own_forwards_run(runs, registry, one_thread):
    """Two forwards before their backwards (a loss over two batches), checkpointed: the first forward's recompute
    comes after the second forward and finds its own forward's documents (the run kept weakly while its tensors
    live, made again without them), as plain TRL's checkpointing recomputes on its saved arguments: the losses and
    gradients of the same forwards without checkpointing. Once the batches are gone, so are their runs."""
    results = []
    for checkpointing in (False, True):
        first, second = _batch([9, 20, 4], seed=0), _batch([15, 15, 3], seed=1)
        model = _lora(checkpointing)
        packed = PackedAttention()
        assert packed.attach(model)
        runs.clear()
        try:
            model.zero_grad(set_to_none=True)
            loss = model(**first).loss + model(**second).loss
            loss.backward()
            results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
            recomputed = runs[2 * _layers(model):]
            if checkpointing:  # the second forward's recomputes, then the first's, each on its own documents
                assert [r.host_offsets for r in recomputed] == [second["nbkit_cu_seqlens_host"]] * _layers(model) + \
                    [first["nbkit_cu_seqlens_host"]] * _layers(model)
                assert all(r.cu_q is first["cu_seq_lens_q"] for r in recomputed[_layers(model):])
            del loss, recomputed
            runs.clear()
            assert len(packed._runs) == 2  # the first forward's kept weakly while its batch lives
            del first
            gc.collect()
            assert len(packed._runs) == 1  # its tensors gone: its run too
        finally:
            packed.detach()
    (plain_loss, plain_grads), (loss, grads) = results
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    assert grads.keys() == plain_grads.keys() and grads
    for name in plain_grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_second_forward_reads_its_own_run_not_the_firsts(runs, registry):
    """Each forward's layers read the run its pre-hook made, found by identity: a second forward over fresh
    tensors, and a third over the second's ``cu_seq_lens_q`` rewritten in place (a reused buffer), give their own
    documents' logits. Once the second forward has run, the first's run is made again from its own tensor
    (kept weakly), never read by another's."""
    model = tiny_model("qwen3", VOCAB)
    layers = _layers(model)
    lens = ([6, 10, 8], [12, 4, 8], [3, 3, 18])
    ids = [_ids(24, seed) for seed in range(3)]
    with torch.no_grad():  # each document on its own: the truth
        refs = [torch.cat([model(input_ids=row[:, a:b]).logits[0] for a, b in zip(cu, cu[1:])])
                for row, cu in ((row, metadata_from_lengths(n)["nbkit_cu_seqlens_host"]) for row, n in zip(ids, lens))]
    packed = PackedAttention()
    assert packed.attach(model)
    metas = [metadata_from_lengths(n) for n in lens]
    reused = metas[1]["cu_seq_lens_q"]
    try:
        with torch.no_grad():
            first = model(input_ids=ids[0], **metas[0]).logits[0]
            assert packed.run_for(metas[0]) is runs[0]
            second = model(input_ids=ids[1], **metas[1]).logits[0]
            assert packed.run_for(metas[1]) is runs[layers]
            again = packed.run_for(metas[0])
            assert again is not runs[0] and again.cu_q is metas[0]["cu_seq_lens_q"] and again.host_offsets == \
                runs[0].host_offsets
            reused.copy_(metas[2]["cu_seq_lens_q"])  # the second forward's tensor, holding the third's boundaries
            third_meta = {**metas[2], "cu_seq_lens_q": reused, "cu_seq_lens_k": reused}
            third = model(input_ids=ids[2], **third_meta).logits[0]
            assert packed.run_for(third_meta) is runs[2 * layers]
            assert packed.run_for({"cu_seq_lens_q": reused.clone()}) is None  # by identity, not by value
    finally:
        packed.detach()
    assert len({id(r) for r in runs}) == 3 and len(runs) == 3 * layers
    assert [runs[i * layers].host_offsets for i in range(3)] == [m["nbkit_cu_seqlens_host"] for m in metas]
    assert runs[2 * layers].cu_q is runs[layers].cu_q  # the third run over the second's tensor, a run of its own
    for got, want in zip((first, second, third), refs):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert packed.run_for(third_meta) is None  # detached: the table is empty


def _packed_logits(model: torch.nn.Module, lengths: list[int], seed: int) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_ids(sum(lengths), seed), **metadata_from_lengths(lengths)).logits[0]


def test_nbkit_names_the_attached_owners_attention_and_detach_puts_back_what_it_named(registry):
    """Attach registers ``"nbkit"`` over the owner's runs, detach puts back what it named before (here a sentinel).
    A second owner attached inside the first's time takes only its own model's calls: the first model's go on to
    the first owner, and give the same logits as before."""
    def sentinel(*args, **kwargs):
        raise AssertionError("not to be called")

    AttentionInterface.register(ATTN_NAME, sentinel)
    first_model, second_model = tiny_model("qwen3", VOCAB), tiny_model("llama", VOCAB)
    a, b = PackedAttention(), PackedAttention()
    assert a.attach(first_model)
    held_by_a = AttentionInterface()[ATTN_NAME]
    assert held_by_a is not sentinel
    alone = _packed_logits(first_model, [5, 9, 6], seed=0)
    assert b.attach(second_model)
    assert AttentionInterface()[ATTN_NAME] not in (sentinel, held_by_a)
    torch.testing.assert_close(_packed_logits(first_model, [5, 9, 6], seed=0), alone, rtol=0, atol=0)
    _packed_logits(second_model, [7, 13], seed=1)
    b.detach()
    assert AttentionInterface()[ATTN_NAME] is held_by_a
    a.detach()
    assert AttentionInterface()[ATTN_NAME] is sentinel
    a.detach()  # twice: nothing more
    assert AttentionInterface()[ATTN_NAME] is sentinel


def test_detach_leaves_an_entry_someone_else_registered_since(registry, caplog):
    def theirs(*args, **kwargs):
        raise AssertionError("not to be called")

    packed = PackedAttention()
    assert packed.attach(tiny_model("qwen3", VOCAB))
    AttentionInterface.register(ATTN_NAME, theirs)
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.packed_attention"):
        packed.detach()
    assert AttentionInterface()[ATTN_NAME] is theirs
    assert "registered again by someone else" in caplog.text


def test_the_attention_raises_without_an_owner_and_without_a_run_it_knows(registry):
    model = tiny_model("qwen3", VOCAB)
    meta = metadata_from_lengths([5, 7])
    packed = PackedAttention()
    assert packed.attach(model)
    packed.detach()
    assert AttentionInterface()[ATTN_NAME] is nbkit_attention_forward  # what it named before the attach
    model.set_attn_implementation(ATTN_NAME)  # "nbkit" chosen by hand: no owner
    with pytest.raises(RuntimeError, match="without nbkit's per-forward metadata: no attached PackedAttention"):
        with torch.no_grad():
            model(input_ids=_ids(12, 0), **meta)
    model.set_attn_implementation("sdpa")
    assert packed.attach(model)
    q = torch.randn(1, 2, 12, 8)
    try:
        with pytest.raises(RuntimeError, match="without nbkit's per-forward metadata"):
            AttentionInterface()[ATTN_NAME](torch.nn.Module(), q, q, q, None, **meta)  # no forward registered it
        with pytest.raises(RuntimeError, match="without nbkit's per-forward metadata"):
            AttentionInterface()[ATTN_NAME](torch.nn.Module(), q, q, q, None)  # no cu_seq_lens_q at all
    finally:
        packed.detach()


def test_the_registry_does_not_keep_a_forgotten_owner_or_its_model_alive(registry):
    """An owner never detached (an exception mid-attach, a notebook cell interrupted) and its model, once nothing
    else holds them, are freed: the registry holds the owner weakly, and then raises as without one."""
    model = tiny_model("qwen3", VOCAB)
    packed = PackedAttention()
    assert packed.attach(model)
    gone = weakref.ref(model)
    del model, packed
    gc.collect()
    assert gone() is None
    q = torch.randn(1, 2, 12, 8)
    with pytest.raises(RuntimeError, match="without nbkit's per-forward metadata"):
        AttentionInterface()[ATTN_NAME](torch.nn.Module(), q, q, q, None, **metadata_from_lengths([5, 7]))
