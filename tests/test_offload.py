"""CPU tests for nbkit.offload: the host-storage path runs the same pack / unpack / prefetch code as CUDA.

Parity is bitwise: the offloaded input is restored byte for byte, so the recompute sees identical data and runs
the same kernels in the same order as plain checkpointing (fp32, CPU).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nbkit.offload import OffloadedCheckpointing, _HostPool, _Lane

torch.set_num_threads(2)

LAYERS = 4


def tiny_qwen3(layers: int = LAYERS):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(cfg).float()
    model.train()
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 96), generator=g)
    pos = torch.cat([torch.arange(40), torch.arange(56)])[None]  # two packed documents
    labels = ids.clone()
    labels[0, 40] = -100
    return dict(input_ids=ids, position_ids=pos, labels=labels)


def step(model, retain: bool = False):
    model.zero_grad(set_to_none=True)
    loss = model(**batch()).loss
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same(ref, got):
    (l0, g0), (l1, g1) = ref, got
    assert torch.equal(l0, l1), (l0, l1)
    assert g0.keys() == g1.keys() and g0
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k


def layer_funcs(model):
    return [layer._gradient_checkpointing_func for layer in model.model.layers]


@pytest.fixture
def gc_model():
    model = tiny_qwen3()
    model.gradient_checkpointing_enable()
    return model


def test_parity_pool_reuse_and_prefetch(gc_model):
    ref = step(gc_model)
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(gc_model) and oc.active
    for i in range(3):
        assert_same(ref, step(gc_model))
        s = oc.stats
        assert s.packs == s.unpacks == LAYERS * (i + 1)
        # every layer but the last one restored is served by a prefetch issued while the next layer recomputed
        assert s.prefetch_hits == s.prefetch_issued == (LAYERS - 1) * (i + 1)
        assert s.host_allocs == LAYERS and s.buffer_busy == 0  # the host pool does not grow after step 1
        assert s.buffer_allocs == 2 * (i + 1)  # two restore buffers per backward, none per layer
    oc.detach()


def test_single_buffer(gc_model):
    ref = step(gc_model)
    oc = OffloadedCheckpointing(mode=True, double_buffer=False)
    assert oc.attach(gc_model)
    for _ in range(2):
        assert_same(ref, step(gc_model))
    assert oc.stats.prefetch_hits == 0 and oc.stats.buffer_allocs == 2 and oc.stats.buffers == 1  # one per step
    oc.detach()


def test_retain_graph_double_backward(gc_model):
    ref = step(gc_model, retain=True)
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(gc_model)
    assert_same(ref, step(gc_model, retain=True))  # each input is restored twice from the same host slot
    assert oc.stats.unpacks == 2 * LAYERS
    oc.detach()


def test_every_n_layers():
    model = tiny_qwen3()
    model.gradient_checkpointing_enable(every_n_layers=2)
    ref = step(model)
    before = layer_funcs(model)
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(model)
    checkpointed = [layer.gradient_checkpointing for layer in model.model.layers]
    assert checkpointed == [True, False, True, False]
    installed = [type(f).__name__ == "_InstalledCheckpoint" for f in layer_funcs(model)]
    assert installed == checkpointed  # exactly the checkpointed layers
    assert_same(ref, step(model))
    assert oc.stats.packs == 2
    oc.detach()
    assert layer_funcs(model) == before


def test_peft_lora_parity():
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen3()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref = step(model)
    assert any("lora_A" in k for k in ref[1])
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(model)  # the PeftModel: unwrapped to the transformers model inside
    assert_same(ref, step(model))
    assert oc.stats.packs == LAYERS
    oc.detach()


def test_detach_restores_and_frees(gc_model):
    before = layer_funcs(gc_model)
    ref = step(gc_model)
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    step(gc_model)
    assert oc.stats.host_bytes > 0
    oc.detach()
    assert all(a is b for a, b in zip(layer_funcs(gc_model), before))
    assert oc.stats.host_bytes == 0 and not oc._lanes and not oc.active
    packs = oc.stats.packs
    assert_same(ref, step(gc_model))
    assert oc.stats.packs == packs
    oc.detach()  # twice is safe


def test_plain_path_in_eval_no_grad_and_inference_mode(gc_model):
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    ids = batch()["input_ids"]
    with torch.inference_mode():
        gc_model(input_ids=ids)
    with torch.no_grad():
        gc_model(input_ids=ids)
    gc_model.eval()
    gc_model(input_ids=ids).logits.sum().backward()  # eval with grad: transformers does not checkpoint at all
    assert oc.stats.packs == 0 and oc.stats.unpacks == 0
    oc.detach()


def test_not_enabled_is_refused_with_one_line(caplog):
    model = tiny_qwen3()
    oc = OffloadedCheckpointing(mode=True)
    with caplog.at_level(logging.INFO, logger="nbkit.offload"):
        assert oc.attach(model) is False
        oc.attach(model)
    lines = [r.getMessage() for r in caplog.records if "not enabled" in r.getMessage()]
    assert len(lines) == 1


def test_reentrant_is_refused():
    model = tiny_qwen3()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    before = layer_funcs(model)
    assert OffloadedCheckpointing(mode=True).attach(model) is False
    assert layer_funcs(model) == before


def test_user_kwargs_are_kept(gc_model):
    gc_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"preserve_rng_state": False})
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    inst = gc_model.model.layers[0]._gradient_checkpointing_func
    assert inst.ckpt_kwargs == {"preserve_rng_state": False, "use_reentrant": False}
    oc.detach()


def test_config_switch(tmp_path, gc_model, caplog):
    from nbkit.config import FastSFTConfig

    cfg = functools.partial(FastSFTConfig, output_dir=str(tmp_path), bf16=False, use_cpu=True)
    off = OffloadedCheckpointing.from_config(cfg(offload_checkpointing=False))
    assert off.attach(gc_model) is False
    on = OffloadedCheckpointing.from_config(cfg(offload_checkpointing=True, offload_double_buffer=False))
    assert on.attach(gc_model) and on.double_buffer is False
    on.detach()
    auto = OffloadedCheckpointing.from_config(cfg())
    with caplog.at_level(logging.INFO, logger="nbkit.offload"):
        assert auto.attach(gc_model) is False  # 'auto' never offloads from a CPU model
    assert any("auto" in r.getMessage() and "cpu" in r.getMessage() for r in caplog.records)


def test_auto_stays_off_for_host_tensors(gc_model, monkeypatch, caplog):
    oc = OffloadedCheckpointing(mode="auto", min_bytes=0)
    monkeypatch.setattr(oc, "_auto_refusal", lambda base: None)  # get past attach's device check
    assert oc.attach(gc_model)
    with caplog.at_level(logging.INFO, logger="nbkit.offload"):
        step(gc_model)
    assert oc.stats.packs == 0 and not oc.active
    assert any("off:" in r.getMessage() for r in caplog.records)
    oc.detach()


def test_corrupted_restore_is_detected(gc_model, monkeypatch):
    """Negative control: the parity check above would catch a restore that returns wrong bytes."""
    ref = step(gc_model)
    real = _Lane.unpack
    monkeypatch.setattr(_Lane, "unpack", lambda self, p: real(self, p) * 0.999)
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    loss, grads = step(gc_model)
    assert torch.equal(loss, ref[0])  # the forward is untouched
    assert not all(torch.equal(grads[k], ref[1][k]) for k in grads)
    oc.detach()


def test_vram_tight_falls_back_to_one_buffer(gc_model, monkeypatch, caplog):
    ref = step(gc_model)
    monkeypatch.setattr(_Lane, "_room_for", lambda self, nbytes: False)
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    with caplog.at_level(logging.WARNING, logger="nbkit.offload"):
        assert_same(ref, step(gc_model))
        assert_same(ref, step(gc_model))
    assert oc.stats.buffers == 1 and oc.stats.buffer_allocs == 2  # one per step
    assert sum("one restore buffer" in r.getMessage() for r in caplog.records) == 1
    oc.detach()


def test_host_memory_exhausted_keeps_inputs(gc_model, monkeypatch, caplog):
    ref = step(gc_model)

    def fail(self, nbytes):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(_HostPool, "_alloc", fail)
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    with caplog.at_level(logging.WARNING, logger="nbkit.offload"):
        assert_same(ref, step(gc_model))
    assert oc.stats.packs == 0 and oc.stats.kept == LAYERS
    assert sum("host memory exhausted" in r.getMessage() for r in caplog.records) == 1
    oc.detach()


# ----------------------------------------------------------------------------- a hand-made stack (no transformers)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)

    def forward(self, h, shared):
        return h + torch.tanh(self.lin(h)) * shared


def run_stack(blocks, x, shared):
    h = x
    for b in blocks:
        h = b._gradient_checkpointing_func(b.__call__, h, shared)
    return h


def test_shared_positional_tensor_offloaded_once():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(3))
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(blocks)
    shared = torch.rand(8, 32)
    x = torch.randn(8, 32, requires_grad=True)
    # the same live tensor passed first to every call: copied once, then left in place
    outs = [b._gradient_checkpointing_func(b.__call__, shared, shared) for b in blocks]  # graphs kept alive
    assert oc.stats.packs == 1 and oc.stats.kept == 2
    del outs
    # the usual case: hidden states first, the shared tensor second is never copied
    run_stack(blocks, x, shared).sum().backward()
    assert oc.stats.packs == 4
    oc.detach()


def test_input_released_after_pack():
    """The offloaded input's memory is not held by the autograd graph (only the host copy is)."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(1))
    shared = torch.ones(8, 32)

    def holders(offload: bool) -> int:
        oc = OffloadedCheckpointing(mode=True)
        if offload:
            oc.attach(blocks)
        h = torch.randn(8, 32, requires_grad=True) * 2  # non-leaf, like hidden states
        probe = h.detach()
        out = run_stack(blocks, h, shared)
        del h
        n = torch._C._storage_Use_Count(probe.untyped_storage()._cdata)
        out.sum().backward()
        oc.detach()
        return n

    assert holders(offload=True) < holders(offload=False)


# ------------------------------------------------------------------------------------- benchmark helpers (pure logic)


def test_copy_overlap_from_a_synthetic_trace():
    from nbkit.bench.offload import copy_overlap

    def ev(cat, name, ts, dur, stream, nbytes=None):
        args = {"stream": stream} | ({"bytes": nbytes} if nbytes is not None else {})
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    trace = {"traceEvents": [
        ev("kernel", "gemm", 0, 100, 7),
        ev("kernel", "gemm", 150, 100, 7),
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50, 100, 20, 64 * 2**20),  # 50 of 100 us under compute
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 260, 40, 20, 64 * 2**20),  # none under compute
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 0, 5, 7, 4),  # tiny: ignored
    ]}
    out = copy_overlap(trace)
    assert out["DtoH"]["count"] == 1 and out["DtoH"]["overlap"] == pytest.approx(0.5)
    assert out["DtoH"]["gb_per_s"] == pytest.approx(64 * 2**20 / 100e3)
    assert out["HtoD"]["overlap"] == 0.0 and out["HtoD"]["streams"] == [20]


def test_packed_batch_is_like_trl_padding_free():
    from nbkit.bench.offload import packed_batch

    b = packed_batch(4096, 1000, "cpu")
    pos, cu = b["position_ids"][0], b["cu_seq_lens_q"]
    starts = (pos == 0).nonzero().flatten()
    assert cu[0] == 0 and cu[-1] == 4096 and torch.equal(cu[:-1].long(), starts)
    assert b["max_length_q"] == int(cu.diff().max()) and 300 <= int(cu.diff()[:-1].float().mean()) <= 500
    assert (b["labels"][0][starts] == -100).all() and (b["labels"][0] != -100).sum() == 4096 - len(starts)


def test_pool_grows_by_replacing_slots(gc_model):
    """A longer sequence replaces idle slots (host memory follows the largest step, it does not accumulate)."""
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    for tokens in (32, 96, 96):
        ids = torch.randint(0, 128, (1, tokens))
        gc_model(input_ids=ids, labels=ids).loss.backward()
    assert oc.stats.host_allocs == 2 * LAYERS  # sized on the first step, grown once
    assert oc.stats.host_bytes == LAYERS * 96 * 64 * 4  # only the larger slots remain
    oc.detach()
