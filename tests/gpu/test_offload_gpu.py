"""GPU tests for nbkit.speedups.offload (H200): bf16 parity, copy/compute overlap, peak VRAM, fallbacks.

Tolerances: with the math SDPA backend every kernel is deterministic, so offloaded checkpointing must give bitwise
the same loss and gradients as plain checkpointing (the restored input is the same bytes). With the default
attention backends (QLoRA test) the reference is plain checkpointing run twice: the offloaded gradients must be as
close to it as it is to itself, with a bf16 floor of 1e-2 relative (Frobenius) error.

Overlap floors (``test_copies_overlap_compute``), from the profiler's share of each copy's time under compute:
D2H 25% and H2D 30% double-buffered. Measured: an H200 gave D2H 36%, H2D 50%; an H100 (2026-12-07) D2H 31%, H2D
39.5%; single-buffered H2D 0% on both, the floor a broken prefetch would fall to.

``attach`` runs the engine alone in a layer runner (``layer_runner.standalone``): it offloads every checkpointed layer
from the first training call, and with no keep mode beside it the plan's first look (step 2, from CUDA's memory
counters) brings no input back on the GPU. The runner is read from ``oc._runner``.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from nbkit.ops.offload_lanes import _HostPool
from nbkit.speedups.layer_plan import CHECKPOINTED, OFFLOADED
from nbkit.speedups.offload import OffloadedCheckpointing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB = 2**20


def qwen3(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int = 1024, trainable: bool = True):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.train()
    if not trainable:
        model.requires_grad_(False)
        model.model.norm.weight.requires_grad_(True)  # something to train; gradients still flow through every layer
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def ids(tokens: int, vocab: int = 1024) -> torch.Tensor:
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1)).cuda()


def step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_diff(a: dict, b: dict) -> float:
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a)
    den = sum(float(b[k].float().pow(2).sum()) for k in a)
    return (num / max(den, 1e-30)) ** 0.5


def test_bf16_parity_bitwise_math_backend():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = qwen3(layers=4, hidden=512, inter=1536, heads=8, kv=4)
    x = ids(2048)
    with sdpa_kernel([SDPBackend.MATH]):
        ref, ref2 = step(model, x), step(model, x)
        deterministic = all(torch.equal(ref2[1][k], ref[1][k]) for k in ref[1])
        noise = rel_diff(ref2[1], ref[1])
        print(f"plain vs plain: {'bitwise' if deterministic else f'{noise:.2e}'}")
        for double in (True, False):
            oc = OffloadedCheckpointing(mode=True, double_buffer=double, trace=100)
            assert oc.attach(model)
            for _ in range(2):
                loss, grads = step(model, x)
                assert torch.equal(loss, ref[0])
                if deterministic:  # same bytes in, same kernels: bitwise
                    assert all(torch.equal(grads[k], ref[1][k]) for k in ref[1]), rel_diff(grads, ref[1])
                else:
                    assert rel_diff(grads, ref[1]) <= max(2 * noise, 1e-2)
            assert oc.stats.packs == 8 and oc.stats.pinned is True
            assert [p.activations for p in oc._runner.plans] == [OFFLOADED] * 4  # after the first look too
            assert oc.stats.host_allocs == 4  # the pool is reused on the second step
            # every restore but each step's first one is prefetched, triggered after the next layer's MLP backward
            assert oc.stats.prefetch_hits == oc.stats.prefetch_after_ffn == (6 if double else 0)
            ev = list(oc.trace)  # on CUDA too (hooks run on the autograd engine's device thread): MLP done, then fetch
            for k, e in enumerate(ev):
                if e[0] == "prefetch":
                    done = ev[k - 1]
                    assert done[0] == "ffn_backward_done"
                    assert e[1] == f"model.layers.{int(done[1].rsplit('.', 1)[1]) - 1}"
            oc.detach()


def test_qlora_packed_parity_like_the_benchmark():
    """The benchmark's own path (nf4 QLoRA, packed row, nbkit attention when present) at a small size."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from benchmarks.offload_workload import attach_attention, build_qlora, loss_fn, packed_batch, set_config

    model, causal, _ = build_qlora("8b", 3, "cuda", overrides=dict(hidden_size=1024, intermediate_size=3072,
                                                                   num_attention_heads=8, num_key_value_heads=4,
                                                                   vocab_size=4096))
    attach_attention(model, "auto")
    batch = packed_batch(4096, 4096, "cuda")
    params = [p for p in model.parameters() if p.requires_grad]

    def run(name):
        oc = set_config(model, causal, name)
        for p in params:
            p.grad = None
        loss = loss_fn(causal, batch)
        loss.backward()
        if oc is not None:
            oc.detach()
        return loss.detach(), {i: p.grad.clone() for i, p in enumerate(params)}

    ref, ref2, off = run("ckpt"), run("ckpt"), run("nbkit_double")
    noise = rel_diff(ref2[1], ref[1])
    err = rel_diff(off[1], ref[1])
    print(f"QLoRA: plain vs plain {noise:.2e}, nbkit vs plain {err:.2e}, bitwise {err == 0}")
    assert torch.allclose(off[0], ref[0], rtol=1e-3)
    assert err <= max(2 * noise, 1e-2)


def test_copies_overlap_compute(tmp_path):
    """The D2H and H2D copies run on a side stream while compute kernels run on another.

    Two independent views: torch.profiler's kernels and copies, and nbkit's own timed events (each prefetch's copy
    time, the compute-stream time between its issue after the MLP backward and its use, and any wait for it).
    """
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.offload import copy_overlap

    model = qwen3(layers=6, hidden=2048, inter=8192, heads=16, kv=8, trainable=False)
    x = ids(8192)
    frac, timed = {}, {}
    for double in (True, False):
        oc = OffloadedCheckpointing(mode=True, double_buffer=double)
        oc.attach(model)
        step(model, x)  # warm: pool
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(model, x)
            torch.cuda.synchronize()
        path = str(tmp_path / f"trace_{double}.json")
        prof.export_chrome_trace(path)
        ov = copy_overlap(path)
        timed[double] = oc.stats_dict()
        print("double" if double else "single", ov, timed[double])
        assert ov["DtoH"]["count"] >= 6 and ov["HtoD"]["count"] >= 6
        frac[double] = ov
        oc.detach()
    # With 6 layers the last layer's D2H and the first restore (a synchronous copy on the compute stream) have no
    # layer compute to hide behind, so the ceiling is ~5/6. The profiler's fraction differs between machines (how
    # long each copy is against the kernels beside it), so the bounds ask for a clear share, and for the double
    # buffer's H2D overlap to stand well above the single buffer's (none: the compute stream copies and waits).
    assert frac[True]["DtoH"]["overlap"] >= 0.25
    assert frac[True]["HtoD"]["overlap"] >= 0.3  # prefetch runs under the previous layer's attention backward
    assert frac[False]["HtoD"]["overlap"] <= frac[True]["HtoD"]["overlap"] - 0.3  # single buffer: compute waits
    s = timed[True]
    assert s["prefetch_hits"] == s["prefetch_after_ffn"] == 10  # 5 per step, all issued after an MLP backward
    assert s["lead_ms"] >= s["copy_ms"] > 0  # the attention backward left after the MLP is longer than the copy
    assert s["wait_ms"] <= 0.25 * s["copy_ms"] and s["prefetch_hidden"] >= 8  # and the copies finished in time
    assert timed[False]["prefetch_issued"] == 0 and timed[False]["copy_ms"] == 0


def test_peak_vram_double_buffer_at_save_on_cpu_level():
    """The second restore buffer exists only from a layer's MLP backward (its peak) to the layer's end, so nbkit's
    double-buffered peak is save_on_cpu's. Tolerance: a quarter of one layer input (16 MiB of 64 MiB); before the
    change it was one whole input above. Steady state: no new cudaMalloc segment from step 2 to step 4 (the
    per-layer restore buffers are blocks of torch's caching allocator)."""
    layers, tokens, hidden = 12, 16384, 2048
    n = tokens * hidden * 2  # one layer input, bf16: 64 MiB
    model = qwen3(layers=layers, hidden=hidden, inter=4096, heads=16, kv=8, trainable=False)
    x = ids(tokens)
    grew = {}

    def peak(config: str) -> int:
        oc = None
        # transformers' offload=True (5.17 on) is torch's save_on_cpu around each checkpointed layer
        offload = {"offload": True} if config == "save_on_cpu" else {}
        if offload and "offload" not in inspect.signature(model.gradient_checkpointing_enable).parameters:
            pytest.skip("this transformers has no offloaded checkpointing (offload=True) to compare with")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **offload)
        if config.startswith("nbkit"):
            oc = OffloadedCheckpointing(mode=True, double_buffer=config == "nbkit_double")
            oc.attach(model)
        peaks = []
        for i in range(4):  # the peak of the second step is the steady state
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step(model, x)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            if i == 1:
                segments = torch.cuda.memory_stats()["segment.all.allocated"]
        grew[config] = torch.cuda.memory_stats()["segment.all.allocated"] - segments
        if oc is not None:
            assert oc.stats.prefetch_hits == (4 * (layers - 1) if config == "nbkit_double" else 0)
            oc.detach()
        return peaks[1]

    p = {c: peak(c) for c in ("plain", "nbkit_double", "nbkit_single", "save_on_cpu")}
    print({k: f"{v / MiB:.0f} MiB" for k, v in p.items()}, f"one layer input {n / MiB:.0f} MiB", "new segments", grew)
    saved = p["plain"] - p["nbkit_double"]
    assert (layers - 3) * n <= saved <= (layers + 1) * n  # about all the checkpointed inputs
    assert p["nbkit_double"] <= p["save_on_cpu"] + n // 4  # the target: no higher than save_on_cpu
    assert p["nbkit_single"] <= p["save_on_cpu"] + n // 4
    assert p["save_on_cpu"] < p["plain"]
    assert grew["nbkit_double"] <= 1  # not one per layer (11 prefetches a step)


def test_auto_mode_threshold(caplog):
    model = qwen3(layers=2, hidden=512, inter=1024, heads=8, kv=4)
    x = ids(2048)
    n = 2048 * 512 * 2
    with caplog.at_level(logging.INFO, logger="nbkit.speedups.offload"):
        big = OffloadedCheckpointing(mode="auto", min_bytes=n + 1)
        assert big.attach(model)
        step(model, x)
        assert big.stats.packs == 0 and not big.active
        assert [p.activations for p in big._runner.plans] == [CHECKPOINTED] * 2  # the user's checkpointing
        big.detach()
        small = OffloadedCheckpointing(mode="auto", min_bytes=n)
        small.attach(model)
        step(model, x)
        assert small.stats.packs == 2 and small.active
        assert [p.activations for p in small._runner.plans] == [OFFLOADED] * 2
        small.detach()
    assert any("off:" in r.getMessage() for r in caplog.records)


def test_pageable_fallback_when_pinning_fails(monkeypatch, caplog):
    model = qwen3(layers=3, hidden=512, inter=1024, heads=8, kv=4)
    x = ids(2048)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        ref = step(model, x)
        real_empty = torch.empty

        def no_pinning(*args, **kwargs):
            if kwargs.get("pin_memory"):
                raise RuntimeError("CUDA error: out of memory (pinned, simulated)")
            return real_empty(*args, **kwargs)

        monkeypatch.setattr(_HostPool, "_register", lambda self, slot: False)
        monkeypatch.setattr(torch, "empty", no_pinning)
        oc = OffloadedCheckpointing(mode=True)
        oc.attach(model)
        with caplog.at_level(logging.WARNING, logger="nbkit.speedups.offload"):
            got = step(model, x)
            step(model, x)
        monkeypatch.undo()
    assert oc.stats.pinned is False and oc.stats.packs == 6
    assert torch.equal(got[0], ref[0]) and all(torch.equal(got[1][k], ref[1][k]) for k in ref[1])
    assert sum("pageable" in r.getMessage() for r in caplog.records) == 1
    oc.detach()
