"""Parity of the cached-packing path with the plain path, on CPU in fp32.

Tolerances: attention kernels vs an explicit-mask reference 1e-5 absolute (fp32 rounding of a different reduction
order); whole-model logits and LoRA gradients 1e-4 relative.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from parity import Tol, add_lora, assert_same_run, run_steps, tiny_lm

from nbkit.demo.models import tiny_model
from nbkit.ops.packed_boundaries import metadata_from_lengths, metadata_from_position_ids
from nbkit.ops.reference_attention import AttnCall
from nbkit.ops.varlen_attention import KERNEL_FNS, PackedRun
from nbkit.speedups.packed_attention import (
    PackedAttention,
    PackedCollator,
    choose_kernel,
    nbkit_attention_forward,
)

_flex_kernel, _sdpa_loop_kernel, _sdpa_masked_kernel = KERNEL_FNS["flex"], KERNEL_FNS["sdpa_loop"], KERNEL_FNS["sdpa_masked"]
_sdpa_kernel = KERNEL_FNS["sdpa"]

VOCAB = 97
DENSE_FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]


def _dense_reference(q, k, v, offsets, call: AttnCall):
    """Attention over all T tokens with an explicit block-diagonal causal (+window) T x T mask: the slow truth."""
    T, H, D = q.shape
    groups = H // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    doc = torch.zeros(T, dtype=torch.long)
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        doc[a:b] = i
    i = torch.arange(T)
    allowed = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    if call.window is not None:
        allowed &= i[None, :] > i[:, None] - call.window
    qh, kh, vh = q.transpose(0, 1).double(), k.transpose(0, 1).double(), v.transpose(0, 1).double()
    if call.softcap is None and call.sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=call.scaling)
    else:
        s = qh @ kh.transpose(-1, -2) * call.scaling
        if call.softcap is not None:
            s = torch.tanh(s / call.softcap) * call.softcap
        s = s.masked_fill(~allowed, float("-inf"))
        if call.sinks is not None:
            s = torch.cat([s, call.sinks.double().reshape(-1, 1, 1).expand(-1, T, 1)], -1)
            p = torch.softmax(s, -1)[..., :-1]
        else:
            p = torch.softmax(s, -1)
        out = p @ vh
    return out.transpose(0, 1).float()


@pytest.mark.parametrize("kernel", [_sdpa_kernel, _sdpa_loop_kernel, _sdpa_masked_kernel, _flex_kernel])
@pytest.mark.parametrize(
    "window,softcap,sinks", [(None, None, False), (4, None, False), (None, 20.0, False), (3, None, True)]
)
def test_kernel_matches_dense_block_diagonal_mask(kernel, window, softcap, sinks):
    if kernel is _flex_kernel and sinks:
        pytest.skip("flex path has no sinks (choose_kernel never picks it for them)")
    torch.manual_seed(0)
    lens = [7, 1, 12, 5]
    meta = metadata_from_lengths(lens)
    T, H, KV, D = sum(lens), 4, 2, 16
    q, k, v = (torch.randn(T, h, D) for h in (H, KV, KV))
    call = AttnCall(scaling=D**-0.5, window=window, softcap=softcap,
                    sinks=torch.randn(H) if sinks else None, dropout=0.0)
    run = PackedRun(kernel=kernel, cu_q=meta["cu_seq_lens_q"], cu_k=meta["cu_seq_lens_k"], max_q=12, max_k=12,
                    host_offsets=meta["nbkit_cu_seqlens_host"], training=False, flex_fn=None)
    if kernel is _flex_kernel:
        from torch.nn.attention.flex_attention import flex_attention

        run.flex_fn = flex_attention
    out = kernel(q, k, v, run, call)
    ref = _dense_reference(q, k, v, meta["nbkit_cu_seqlens_host"], call)
    assert out.shape == (T, H, D)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_metadata_from_position_ids_matches_lengths():
    lens = [3, 1, 4, 2]
    meta = metadata_from_lengths(lens)
    derived = metadata_from_position_ids(meta["position_ids"])
    assert derived["nbkit_cu_seqlens_host"] == meta["nbkit_cu_seqlens_host"] == (0, 3, 4, 8, 10)
    assert derived["max_length_q"] == 4 and isinstance(derived["max_length_q"], int)
    assert derived["cu_seq_lens_q"].dtype == torch.int32


def _docs(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lens]


def _per_doc_logits(model, docs):
    with torch.no_grad():
        return [model(input_ids=d[None]).logits[0] for d in docs]


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_packed_logits_equal_documents_run_one_by_one(family):
    model = tiny_model(family, VOCAB, attn_implementation="eager")
    docs = _docs([9, 20, 4, 17])  # 20 and 17 exceed the 16-token sliding window of mistral/gemma
    ref = torch.cat(_per_doc_logits(model, docs))
    speedup = PackedAttention()
    assert speedup.attach(model)
    assert model.config._attn_implementation == "nbkit"
    meta = metadata_from_lengths([len(d) for d in docs])
    with torch.no_grad():
        out = model(input_ids=torch.cat(docs)[None], **meta).logits[0]
    speedup.detach()
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_packed_gpt_oss_equals_its_documents_run_one_by_one():
    """gpt-oss (attention sinks, sliding windows of 16 tokens): nbkit's packed forward is exact. transformers' own
    packed path is not, for this family: ``GptOssModel`` builds its masks without ``position_ids`` (upstream PR
    huggingface/transformers#39997), so packed documents attend to each other on sdpa/eager (BENCHMARKS.md, Learning curves
    per family)."""
    model = tiny_model("gpt_oss", VOCAB, attn_implementation="eager")
    docs = _docs([9, 20, 4, 17])
    with torch.no_grad():
        ref = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    speedup = PackedAttention()
    assert speedup.attach(model)
    meta = metadata_from_lengths([len(d) for d in docs])
    with torch.no_grad():
        out = model(input_ids=torch.cat(docs)[None], **meta).logits[0]
    speedup.detach()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma2", "gpt_oss"])
def test_one_masked_call_per_layer_equals_documents_run_one_by_one(family):
    """``attention_kernel="sdpa_masked"``: the whole row in one call with the block-diagonal mask (windows,
    soft-capping, sinks included) gives each document's own logits, and the mask is built once per forward."""
    model = tiny_model(family, VOCAB, attn_implementation="eager")
    docs = _docs([9, 20, 4, 17])
    with torch.no_grad():
        ref = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    speedup = PackedAttention(kernel="sdpa_masked")
    assert speedup.attach(model) and speedup.kernel == "sdpa_masked"
    built = []
    dense_mask = PackedRun.dense_mask

    def counted(self, window, device):
        if window not in self._dense_masks:
            built.append(window)
        return dense_mask(self, window, device)

    meta = metadata_from_lengths([len(d) for d in docs])
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(PackedRun, "dense_mask", counted)
        out = model(input_ids=torch.cat(docs)[None], **meta).logits[0]
    speedup.detach()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert len(built) == len(set(built)) >= 1, built  # once per window kind, not per layer


def test_no_leakage_between_documents():
    model = tiny_model("qwen3", VOCAB)
    speedup = PackedAttention()
    speedup.attach(model)
    docs = _docs([6, 10, 8])
    changed = [docs[0], torch.randint(3, VOCAB, (10,)), docs[2]]
    meta = metadata_from_lengths([6, 10, 8])
    with torch.no_grad():
        a = model(input_ids=torch.cat(docs)[None], **meta).logits[0]
        b = model(input_ids=torch.cat(changed)[None], **meta).logits[0]
    speedup.detach()
    torch.testing.assert_close(a[:6], b[:6], rtol=0, atol=0)
    torch.testing.assert_close(a[16:], b[16:], rtol=0, atol=0)
    assert not torch.allclose(a[6:16], b[6:16])


def test_metadata_built_once_per_batch_whatever_the_layer_count():
    for layers in (2, 6):
        model = tiny_model("llama", VOCAB, num_hidden_layers=layers)
        speedup = PackedAttention()
        speedup.attach(model)
        runs = []

        original = KERNEL_FNS["sdpa"]

        def spy(q, k, v, run, call, runs=runs, original=original):
            runs.append(run)
            return original(q, k, v, run, call)

        KERNEL_FNS["sdpa"] = spy
        try:
            from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

            collator = PackedCollator(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True))
            batch = collator([{"input_ids": d.tolist()} for d in _docs([5, 8, 3])])
            assert collator.builds == 1
            batch.pop("labels")
            with torch.no_grad():
                model(**batch)
            # from position ids only: built once in the forward (pre-hook), never per layer
            with torch.no_grad():
                model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        finally:
            KERNEL_FNS["sdpa"] = original
            speedup.detach()
        assert len(runs) == 2 * layers
        assert all(r is runs[0] for r in runs[:layers]), "every layer must share the collated metadata"
        assert all(r is runs[layers] for r in runs[layers:])
        assert speedup.metadata_builds == 1
        assert runs[0].host_offsets == (0, 5, 13, 16)


def test_padded_batch_and_generation_take_the_plain_path():
    model = tiny_model("qwen3", VOCAB)
    ids = torch.randint(3, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: a packed kernel without the mask would be silently wrong
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        gen_ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    speedup = PackedAttention()
    speedup.attach(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert speedup.plain_forwards >= 2
    assert model.config._attn_implementation == "nbkit"
    speedup.detach()
    torch.testing.assert_close(out, ref)
    assert torch.equal(gen, gen_ref)


def test_unpacked_rows_without_position_ids_are_one_document_each():
    model = tiny_model("llama", VOCAB)
    ids = torch.randint(3, VOCAB, (3, 6))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    speedup = PackedAttention()
    speedup.attach(model)
    with torch.no_grad():
        out = model(input_ids=ids).logits
    speedup.detach()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_attention_without_metadata_raises_clearly():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="without nbkit's per-forward metadata"):
        nbkit_attention_forward(torch.nn.Module(), q, q, q, None)


def test_unsupported_family_warns_and_keeps_plain_path(caplog):
    model = tiny_model("llama", VOCAB)
    model.config.model_type = "someone_elses_model"
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.packed_attention"):
        assert PackedAttention().attach(model) is False
    assert "not validated for model family 'someone_elses_model'" in caplog.text
    assert model.config._attn_implementation != "nbkit"


def test_flash_attn_requested_but_absent_is_a_clear_error():
    from nbkit.ops.varlen_attention import flash_attn_available

    if flash_attn_available():
        pytest.skip("flash-attn is installed here")
    model = tiny_model("llama", VOCAB)
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        PackedAttention(kernel="flash_attn").attach(model)
    assert model.config._attn_implementation != "nbkit"


def test_kernel_choice_on_cpu_and_for_models_the_varlen_kernels_cannot_run():
    cpu = torch.device("cpu")
    assert choose_kernel("auto", tiny_model("qwen3", VOCAB).config, cpu) == ("sdpa", None)
    kernel, reason = choose_kernel("auto", tiny_model("gemma2", VOCAB).config, torch.device("cuda"))
    assert kernel in ("sdpa", "flash_attn")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        choose_kernel("varlen", tiny_model("qwen3", VOCAB).config, cpu)


@pytest.mark.parametrize(
    "tokens,docs,heads,softcap,expect",
    [(24, 4, 4, None, "masked"), (24, 2, 4, None, "loop"), (24, 1, 4, None, "loop"), (9000, 9, 4, None, "loop"),
     (8192, 8, 32, None, "masked"), (4096, 8, 4, 50.0, "masked"), (4096, 8, 8, 50.0, "loop")],
)
def test_sdpa_kernel_picks_one_masked_call_for_rows_of_many_short_documents(tokens, docs, heads, softcap, expect,
                                                                          monkeypatch):
    """auto's exact path: one masked call per layer while the (T, T) mask (and, with soft-capping, one layer's fp32
    scores) stays small and the row holds more than two documents; else one call per document."""
    from nbkit.ops import varlen_attention as va

    called = []
    monkeypatch.setattr(va, "_sdpa_masked_kernel", lambda *a: called.append("masked"))
    monkeypatch.setattr(va, "_sdpa_loop_kernel", lambda *a: called.append("loop"))
    q = torch.empty(tokens, heads, 1)
    offsets = tuple(round(i * tokens / docs) for i in range(docs + 1))
    run = PackedRun(kernel=_sdpa_kernel, cu_q=torch.tensor(offsets), cu_k=torch.tensor(offsets), max_q=tokens,
                    max_k=tokens, host_offsets=offsets, training=True)
    va._sdpa_kernel(q, q, q, run, AttnCall(scaling=1.0, window=None, softcap=softcap, sinks=None, dropout=0.0))
    assert called == [expect]


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_packed_loss_and_lora_gradients_equal_one_by_one(family):
    """The training quantity: sum of per-token losses over all documents, and LoRA A/B gradients."""
    docs = _docs([11, 6, 19])
    meta = metadata_from_lengths([len(d) for d in docs])
    bounds = meta["nbkit_cu_seqlens_host"]

    def fresh():
        model = tiny_lm(family, attn_implementation="eager")
        return add_lora(model, seed=1, init_lora_weights=False).train()  # the same random LoRA for both models

    def one_by_one(model, docs):
        return sum(F.cross_entropy(model(input_ids=d[None]).logits[0][:-1], d[1:], reduction="sum") for d in docs)

    def packed(model, docs):
        logits = model(input_ids=torch.cat(docs)[None], **meta).logits[0]
        return sum(F.cross_entropy(logits[a : b - 1], d[1:], reduction="sum") for a, b, d in zip(bounds, bounds[1:], docs))

    ref = run_steps(fresh(), [docs], forward=one_by_one)
    model = fresh()
    speedup = PackedAttention()
    assert speedup.attach(model)
    got = run_steps(model, [docs], forward=packed)
    speedup.detach()
    assert_same_run(got, ref, losses=Tol(rtol=1e-4), grads=Tol(rtol=1e-4, atol=1e-5))
    assert all("lora_" in n for n in got.grads[0])
