"""CPU tests for nbkit.speedups.offload: the host-storage path runs the same pack / unpack / prefetch code as CUDA.

Parity is bitwise: the offloaded input is restored byte for byte, so the recompute sees identical data and runs
the same kernels in the same order as plain checkpointing (fp32, CPU).

The engine runs inside the layer runner (``layer_runner``): ``attach`` builds a runner with it alone, which takes
over the checkpointed layers (their flag off, the user's checkpoint function called by the runner, left in place).
What the runner holds is read from ``oc._runner``: its ``Layer`` records and its plans.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import pytest
import torch
from parity import Run, add_lora, assert_same_run, gradients, run_steps, tiny_lm
from torch.utils.checkpoint import checkpoint

from nbkit.ops.offload_lanes import _HostPool, _Lane, slot_bytes
from nbkit.speedups.layer_plan import KEPT, OFFLOADED
from nbkit.speedups.layer_runner import LayerRunner, run_as_is
from nbkit.speedups.offload import OffloadedCheckpointing
from nbkit.trl_seam import GradientCheckpointingLayer

torch.set_num_threads(2)

LAYERS = 4


def tiny_qwen3(layers: int = LAYERS):
    """A qwen3 of hidden size 64 (the host slots below are sized by it), SDPA attention, in train mode."""
    return tiny_lm("qwen3", 128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, head_dim=16,
                   max_position_embeddings=256, attn_implementation="sdpa").train()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 96), generator=g)
    pos = torch.cat([torch.arange(40), torch.arange(56)])[None]  # two packed documents
    labels = ids.clone()
    labels[0, 40] = -100
    return dict(input_ids=ids, position_ids=pos, labels=labels)


def _twice(loss: torch.Tensor) -> None:
    loss.backward(retain_graph=True)
    loss.backward()


def step(model, retain: bool = False):
    """One forward and backward of ``batch()`` (with ``retain``: two backwards of the same graph)."""
    return run_steps(model, [batch()], backward=_twice if retain else torch.Tensor.backward)


def assert_same(ref, got):
    assert_same_run(got, ref)  # bitwise: the loss and every gradient


def layer_funcs(model):
    return [layer._gradient_checkpointing_func for layer in model.model.layers]


def layer_state(model):
    """What the runner may change on each layer, and must put back: its checkpoint function and flag, and whether
    its forward (and its MLP's) is an instance attribute (the runner's)."""
    return [(layer._gradient_checkpointing_func if hasattr(layer, "_gradient_checkpointing_func") else None,
             layer.gradient_checkpointing, "forward" in vars(layer), "forward" in vars(layer.mlp))
            for layer in model.model.layers]


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
        # every layer but the last one restored is served by a prefetch issued after the next layer's MLP backward
        assert s.prefetch_hits == s.prefetch_issued == s.prefetch_after_ffn == (LAYERS - 1) * (i + 1)
        assert s.host_allocs == LAYERS  # the host pool does not grow after step 1
        assert s.buffer_allocs == LAYERS * (i + 1)  # one restore buffer per layer, handed back after it
    oc.detach()


def test_single_buffer(gc_model):
    ref = step(gc_model)
    oc = OffloadedCheckpointing(mode=True, double_buffer=False, trace=100)
    assert oc.attach(gc_model)
    for _ in range(2):
        assert_same(ref, step(gc_model))
    s = oc.stats
    assert s.prefetch_issued == s.prefetch_hits == 0 and s.buffers == 1 and s.buffer_allocs == 2 * LAYERS
    assert {e[0] for e in oc.trace} == {"unpack"}  # no MLP hook is installed without a second buffer
    oc.detach()


def test_retain_graph_double_backward(gc_model):
    ref = step(gc_model, retain=True)
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(gc_model)
    assert_same(ref, step(gc_model, retain=True))  # each input is restored twice from the same host slot
    assert oc.stats.unpacks == 2 * LAYERS
    assert oc.stats.prefetch_hits == 2 * (LAYERS - 1)  # the MLP hooks fire in both backwards
    oc.detach()


def _mark_backward(model, trace, staged_at_mlp=None, lane=None):
    """Module backward hooks that log into the offload trace: each MLP projection and the attention projections."""
    for i, layer in enumerate(model.model.layers):
        name = f"model.layers.{i}"
        mods = {f"mlp.{n}": getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}
        mods |= {f"attn.{n}": getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        for tag, mod in mods.items():
            def hook(mod, gin, gout, tag=tag, name=name):
                trace.append((tag, name, ""))
                if staged_at_mlp is not None and tag.startswith("mlp."):
                    lane_ = lane()
                    staged_at_mlp.append(lane_ is not None and lane_.staged is not None)
            mod.register_full_backward_hook(hook)


def test_prefetch_is_issued_after_the_mlp_backward(gc_model):
    """Layer i-1's input is copied back after layer i's MLP backward (its memory peak), before its attention's."""
    ref = step(gc_model)
    oc = OffloadedCheckpointing(mode=True, trace=1000)
    oc.attach(gc_model)
    staged_at_mlp: list[bool] = []
    _mark_backward(gc_model, oc.trace, staged_at_mlp, lambda: next(iter(oc._lanes.values()), None))
    for _ in range(2):
        oc.trace.clear()
        assert_same(ref, step(gc_model))
        ev = list(oc.trace)
        at = {e: k for k, e in enumerate(ev)}
        for i in range(1, LAYERS):
            cur, prev = f"model.layers.{i}", f"model.layers.{i - 1}"
            fetch = at[("prefetch", prev, "after_ffn")]
            assert at[("unpack", cur, "miss" if i == LAYERS - 1 else "hit")] < fetch
            for proj in ("gate_proj", "up_proj", "down_proj"):  # the whole MLP backward came first
                assert at[(f"mlp.{proj}", cur, "")] < at[("ffn_backward_done", cur, "")] < fetch
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):  # the attention backward is left to hide the copy
                assert fetch < at[(f"attn.{proj}", cur, "")]
            assert fetch < at[("unpack", prev, "hit")]
        assert [e for e in ev if e[0] == "prefetch"] == [
            ("prefetch", f"model.layers.{i - 1}", "after_ffn") for i in range(LAYERS - 1, 0, -1)]
    # during every MLP backward no second input is restored: one buffer at the peak, like save_on_cpu
    assert staged_at_mlp and not any(staged_at_mlp)
    oc.detach()


def test_prefetch_trace_is_a_real_observation(gc_model):
    """Negative control: a prefetch issued at unpack (the old timing) breaks the ordering the test above checks."""
    oc = OffloadedCheckpointing(mode=True, trace=1000)
    oc.attach(gc_model)
    for layer in oc._runner.layers:
        layer.mlp = None  # the engine sees no MLP: no hook, the fallback timing
    _mark_backward(gc_model, oc.trace)
    step(gc_model)
    ev = list(oc.trace)
    fetch = ev.index(("prefetch", "model.layers.2", "at_unpack"))
    assert fetch < ev.index(("mlp.down_proj", "model.layers.3", ""))  # before layer 3's MLP backward
    assert oc.stats.prefetch_hits == LAYERS - 1 and oc.stats.prefetch_after_ffn == 0
    oc.detach()


def _checkpoint_every_other_layer(model) -> None:
    """Layers 0 and 2 of 4 checkpointed: transformers' ``every_n_layers=2`` where it has it (5.17 on), else the
    same flags set by hand after enabling checkpointing (Colab's 5.15)."""
    import inspect

    if "every_n_layers" in inspect.signature(model.gradient_checkpointing_enable).parameters:
        model.gradient_checkpointing_enable(every_n_layers=2)
        return
    model.gradient_checkpointing_enable()
    for i, layer in enumerate(model.model.layers):
        layer.gradient_checkpointing = i % 2 == 0


def test_every_n_layers():
    model = tiny_qwen3()
    _checkpoint_every_other_layer(model)
    ref = step(model)
    before = layer_state(model)
    oc = OffloadedCheckpointing(mode=True, trace=100)
    assert oc.attach(model)
    runner = oc._runner
    checkpointed = [layer.checkpointed for layer in runner.layers]
    assert checkpointed == [True, False, True, False]  # taken over as the user asked
    # the user's checkpoint functions, called by the runner; transformers calls run_as_is for the layers taken over
    assert [layer.checkpoint for layer in runner.layers if layer.checkpointed] == [before[0][0], before[2][0]]
    assert layer_funcs(model) == [run_as_is if c else f for c, (f, *_) in zip(checkpointed, before)]
    _mark_backward(model, oc.trace)
    assert_same(ref, step(model))
    assert [p.activations == OFFLOADED for p in runner.plans] == checkpointed  # exactly the checkpointed layers
    assert oc.stats.packs == 2 and oc.stats.prefetch_hits == oc.stats.prefetch_after_ffn == 1
    ev = list(oc.trace)
    fetch = ev.index(("prefetch", "model.layers.0", "after_ffn"))
    assert ev.index(("ffn_backward_done", "model.layers.2", "")) < fetch
    assert fetch < ev.index(("attn.q_proj", "model.layers.2", ""))
    assert fetch < ev.index(("mlp.down_proj", "model.layers.1", ""))  # the plain layer 1 also hides the copy
    oc.detach()
    assert layer_state(model) == before


def test_peft_lora_parity():
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = add_lora(tiny_qwen3(), targets=targets, init_lora_weights=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref = step(model)
    assert any("lora_A" in k for k in ref.grads[0])
    oc = OffloadedCheckpointing(mode=True, trace=100)
    assert oc.attach(model)  # the PeftModel: unwrapped to the transformers model inside
    assert_same(ref, step(model))
    s = oc.stats
    assert s.packs == LAYERS and s.prefetch_hits == s.prefetch_after_ffn == LAYERS - 1
    assert oc.trace[0][1] == "model.layers.3"  # names inside the unwrapped transformers model
    oc.detach()


def test_moe_layers_prefetch_after_the_sparse_block():
    """In an MoE model the layer's ``mlp`` is the sparse expert block: same trigger, same bitwise parity."""
    model = tiny_lm("qwen3_moe", 128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=3, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa",
                    norm_topk_prob=False).train()
    model.gradient_checkpointing_enable()
    ref = step(model)
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(model)
    assert_same(ref, step(model))
    assert oc.stats.prefetch_hits == oc.stats.prefetch_after_ffn == 2
    oc.detach()


def test_detach_restores_and_frees(gc_model):
    before = layer_state(gc_model)
    ref = step(gc_model)
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    assert layer_state(gc_model) == [(run_as_is, True, True, True)] * LAYERS  # the runner's now; flags stay on
    step(gc_model)
    assert oc.stats.host_bytes > 0
    oc.detach()
    assert layer_state(gc_model) == before  # flags, functions and forwards as they were
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
    with caplog.at_level(logging.INFO, logger="nbkit.speedups.offload"):
        assert oc.attach(model) is False
        oc.attach(model)
    lines = [r.getMessage() for r in caplog.records if "not enabled" in r.getMessage()]
    assert len(lines) == 1


def test_reentrant_is_refused():
    model = tiny_qwen3()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    before = layer_state(model)
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(model) is False
    assert layer_state(model) == before  # a refused attach leaves nothing behind: no runner on the layers
    assert oc._runner is None


def test_no_decoder_layers_is_refused():
    """A model without transformers' decoder layers: nothing to offload, and attach says so."""
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(torch.nn.Sequential(torch.nn.Linear(4, 4))) is False and not oc.active


def test_user_kwargs_are_kept(gc_model, monkeypatch):
    import nbkit.speedups.offload as offload_module

    gc_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"preserve_rng_state": False})
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    layer = oc._runner.layers[0]
    assert oc._ckpt_kwargs[id(layer)] == {"preserve_rng_state": False, "use_reentrant": False}
    calls = []

    def spy(function, *args, **kwargs):
        calls.append(kwargs)
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(offload_module, "torch_checkpoint", spy)
    step(gc_model)
    # what reaches torch's checkpoint: the user's kwargs alone (the layer's own are bound to its forward)
    assert calls == [{"preserve_rng_state": False, "use_reentrant": False}] * LAYERS and oc.stats.packs == LAYERS
    oc.detach()


def built_runner(args) -> Optional[LayerRunner]:
    """The layer runner the speedup table builds for ``args`` (None: no layer mode switched on)."""
    from nbkit import speedups

    runners = [s for s in speedups.build("model", args, False) if s.name == speedups.LAYERS]
    return runners[0] if runners else None


def built_offload(args) -> Optional[OffloadedCheckpointing]:
    runner = built_runner(args)
    return runner.offload if runner is not None else None


def test_config_switch_builds_offload_from_the_speedup_table(tmp_path, gc_model, caplog):
    from nbkit.config import FastSFTConfig

    cfg = functools.partial(FastSFTConfig, output_dir=str(tmp_path), bf16=False, use_cpu=True,
                            gradient_checkpointing=True)
    assert built_offload(cfg(offload_checkpointing=False)) is None
    assert built_offload(cfg(offload_checkpointing=True, gradient_checkpointing=False)) is None
    runner = built_runner(cfg(offload_checkpointing=True, offload_double_buffer=False))
    on = runner.offload
    assert isinstance(on, OffloadedCheckpointing) and on.double_buffer is False
    assert on.min_bytes == FastSFTConfig.offload_min_bytes  # the config's default, not a second one
    assert OffloadedCheckpointing().min_bytes == FastSFTConfig.offload_min_bytes
    assert runner.attach(gc_model) and runner.begin_training(gc_model)  # as FastSFT drives it
    assert runner.offload is on and on.active
    step(gc_model)
    assert on.stats.packs == LAYERS and "offload_checkpointing" in runner.engaged_modes()
    runner.detach()
    runner = built_runner(cfg())
    auto = runner.offload
    assert auto is not None and auto.mode == "auto"
    with caplog.at_level(logging.INFO, logger="nbkit.speedups.offload"):
        runner.attach(gc_model)
        runner.begin_training(gc_model)
    assert runner.offload is None  # 'auto' never offloads from a CPU model: the runner dropped it
    assert any("auto" in r.getMessage() and "cpu" in r.getMessage() for r in caplog.records)
    runner.detach()


def test_auto_stays_off_for_host_tensors(gc_model, monkeypatch, caplog):
    oc = OffloadedCheckpointing(mode="auto", min_bytes=0)
    monkeypatch.setattr(oc, "_auto_refusal", lambda base: None)  # get past attach's device check
    assert oc.attach(gc_model)
    with caplog.at_level(logging.INFO, logger="nbkit.speedups.offload"):
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
    got = step(gc_model)
    assert_same_run(got, ref, grads=None)  # the forward is untouched
    with pytest.raises(AssertionError, match="gradient of step 1"):
        assert_same(ref, got)
    oc.detach()


def test_vram_tight_skips_the_prefetch(gc_model, monkeypatch, caplog):
    ref = step(gc_model)
    monkeypatch.setattr(_Lane, "_room_for", lambda self, nbytes: False)
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.offload"):
        assert_same(ref, step(gc_model))
        assert_same(ref, step(gc_model))
    s = oc.stats
    assert s.prefetch_skipped == 2 * (LAYERS - 1) and s.prefetch_issued == s.prefetch_hits == 0
    assert s.buffer_allocs == 2 * LAYERS  # one synchronous restore per layer
    assert sum("VRAM is tight" in r.getMessage() for r in caplog.records) == 1
    oc.detach()


def test_host_memory_exhausted_keeps_inputs(gc_model, monkeypatch, caplog):
    ref = step(gc_model)

    def fail(self, nbytes):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(_HostPool, "_alloc", fail)
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.offload"):
        assert_same(ref, step(gc_model))
    assert oc.stats.packs == 0 and oc.stats.kept == oc.stats.host_short == LAYERS
    assert sum("host memory exhausted" in r.getMessage() for r in caplog.records) == 1
    oc.detach()


def test_host_budget_keeps_the_rest_on_the_gpu(gc_model, caplog):
    """offload_max_host_bytes: the pool stops at the budget (two layers' slots here), the other inputs stay where
    they are, said once; the step is the plain step, exactly."""
    ref = step(gc_model)
    one = slot_bytes(96 * 64 * 4)  # one layer input: 96 tokens x 64 wide, fp32
    oc = OffloadedCheckpointing(mode=True, max_host_bytes=2 * one)
    oc.attach(gc_model)
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.offload"):
        for _ in range(2):
            assert_same(ref, step(gc_model))
    assert oc.stats.host_bytes == 2 * one and oc.stats.packs == 2 * 2
    assert oc.stats.host_short == 2 * (LAYERS - 2)
    assert sum("offload_max_host_bytes" in r.getMessage() for r in caplog.records) == 1
    oc.detach()
    with pytest.raises(ValueError, match="offload_max_host_bytes"):
        OffloadedCheckpointing(mode=True, max_host_bytes=0)


def test_the_host_budget_switch_reaches_the_speedup(tmp_path):
    from nbkit import FastSFTConfig

    args = FastSFTConfig(output_dir=str(tmp_path), bf16=False, gradient_checkpointing=True,
                         offload_max_host_bytes=8 << 30)
    offload = built_offload(args)
    assert isinstance(offload, OffloadedCheckpointing) and offload.max_host_bytes == 8 << 30


# ----------------------------------------------------------------------------- a hand-made stack (no transformers)


class Block(GradientCheckpointingLayer):
    """A decoder layer as transformers' base class makes one (the runner finds layers by it), checkpointed."""

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
        h = b(h, shared)
    return h


def test_shared_positional_tensor_offloaded_once():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(3))
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(blocks)
    shared = torch.rand(8, 32)
    x = torch.randn(8, 32, requires_grad=True)
    # the same live tensor passed first to every call: copied once, then left in place
    outs = [b(shared, shared) for b in blocks]  # graphs kept alive
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


class MlpBlock(Block):
    """A block with an ``mlp`` submodule; ``cut``: its output is detached (its gradient hook never fires);
    ``frozen_input``: it reads a detached input (nothing to hook)."""

    def __init__(self, cut: bool = False, frozen_input: bool = False) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32))
        self.cut, self.frozen_input = cut, frozen_input

    def forward(self, h, shared):
        a = h + torch.tanh(self.lin(h)) * shared
        m = self.mlp(a.detach() if self.frozen_input else a)
        return a + (m.detach() if self.cut else m)


def _stack_grads(blocks, offload: Optional[OffloadedCheckpointing]) -> Run:
    """One forward and backward of the stack: the loss, the input's and every parameter's gradient."""
    torch.manual_seed(1)
    x = torch.randn(8, 32, requires_grad=True)
    shared = torch.rand(8, 32)
    blocks.zero_grad(set_to_none=True)
    if offload is not None:
        assert offload.attach(blocks)
    out = run_stack(blocks, x, shared).square().sum()
    out.backward()
    return Run([out.item()], [{"input": x.grad, **gradients(blocks)}])


@pytest.mark.parametrize("kind", ["no_mlp", "mlp_without_grad_input", "mlp_hook_never_fires", "mlp"])
def test_prefetch_fallbacks_keep_parity(kind):
    """No ``mlp``, or an MLP input without gradient: prefetch at unpack, as before. An MLP whose backward never runs:
    nothing is prefetched and each restore is a synchronous copy. All of them: the plain loss and gradients."""
    torch.manual_seed(0)
    make = {"no_mlp": Block, "mlp_without_grad_input": lambda: MlpBlock(frozen_input=True),
            "mlp_hook_never_fires": lambda: MlpBlock(cut=True), "mlp": MlpBlock}[kind]
    blocks = torch.nn.ModuleList(make() for _ in range(3))
    ref = _stack_grads(blocks, None)
    oc = OffloadedCheckpointing(mode=True, trace=100)
    got = _stack_grads(blocks, oc)
    assert_same_run(got, ref)
    s = oc.stats
    assert s.packs == s.unpacks == 3
    fetches = [e[2] for e in oc.trace if e[0] == "prefetch"]
    if kind == "mlp_hook_never_fires":
        assert fetches == [] and s.prefetch_hits == 0 and s.buffer_allocs == 3
    elif kind == "mlp":
        assert fetches == ["after_ffn"] * 2 and s.prefetch_hits == 2
    else:
        assert fetches == ["at_unpack"] * 2 and s.prefetch_hits == 2
    oc.detach()


def test_aborted_backward_then_reset():
    """A backward that raises half-way leaves a prefetched buffer; ``reset`` (or the next forward) drops it."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(MlpBlock() for _ in range(3))
    ref = _stack_grads(blocks, None)
    oc = OffloadedCheckpointing(mode=True)
    assert oc.attach(blocks)
    lane_staged = []

    class Abort(Exception):
        pass

    def stop(grad):
        lane_staged.append(next(iter(oc._lanes.values())).staged is not None)
        raise Abort

    x = torch.randn(8, 32, requires_grad=True)
    h = blocks[0](x, torch.ones(8, 32))
    h = blocks[1](h, torch.ones(8, 32))
    h.register_hook(stop)  # fires after block 2's backward, which prefetched block 1's input
    out = blocks[2](h, torch.ones(8, 32))
    with pytest.raises(Abort):
        out.sum().backward()
    assert lane_staged == [True]
    del out, h
    oc.reset()
    assert all(lane.staged is None for lane in oc._lanes.values())
    oc.detach()
    got = _stack_grads(blocks, OffloadedCheckpointing(mode=True))
    assert_same_run(got, ref)


def test_host_check_counts_and_reclaims_torch_pinned_cache(gc_model, monkeypatch):
    """Host room is MemAvailable plus torch's idle pinned blocks; the pool gives those back before it gives up."""
    import nbkit.ops.offload_lanes as off

    G = 2**30
    monkeypatch.setattr(off, "_torch_host_cache_idle", lambda: 30 * G)
    assert off.host_available({"MemTotal": 128 * G, "MemAvailable": 10 * G}) == 40 * G
    assert off.host_available({}) is None
    released = []
    meminfo = {"MemAvailable": 2 * G}  # short before the release, plenty after it
    monkeypatch.setattr(off, "meminfo", lambda: dict(meminfo))
    monkeypatch.setattr(off, "_torch_host_cache_idle", lambda: 0 if released else 30 * G)

    def release():
        released.append(1)
        meminfo["MemAvailable"] = 32 * G

    monkeypatch.setattr(off, "release_host_cache", release)
    ref = step(gc_model)
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    assert_same(ref, step(gc_model))
    assert released and oc.stats.packs == LAYERS and oc.stats.host_short == 0
    oc.detach()
    monkeypatch.setattr(off, "release_host_cache", lambda: None)  # nothing to give back: inputs stay on the GPU
    meminfo["MemAvailable"] = 2 * G
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    assert_same(ref, step(gc_model))
    assert oc.stats.packs == 0 and oc.stats.host_short == LAYERS
    oc.detach()


def test_pool_grows_by_replacing_slots(gc_model):
    """A longer sequence replaces idle slots (host memory follows the largest step, it does not accumulate)."""
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    for tokens in (32, 96, 96):
        ids = torch.randint(0, 128, (1, tokens))
        gc_model(input_ids=ids, labels=ids).loss.backward()
    assert oc.stats.host_allocs == 2 * LAYERS  # sized on the first step, grown once
    assert oc.stats.host_bytes == LAYERS * slot_bytes(96 * 64 * 4)  # only the larger slots remain
    oc.detach()


def test_slightly_longer_rows_reuse_the_slots(gc_model):
    """Packed rows vary by a few tokens between steps: within 1/16 the first step's slots are reused, not regrown."""
    oc = OffloadedCheckpointing(mode=True)
    oc.attach(gc_model)
    for tokens in (96, 100, 98):
        ids = torch.randint(0, 128, (1, tokens))
        gc_model(input_ids=ids, labels=ids).loss.backward()
    assert oc.stats.host_allocs == LAYERS
    oc.detach()


def test_idle_slots_of_mixed_sizes_are_taken_by_identity():
    """Idle slots differ in size once fewer layers pack than before and rows grew: the pool takes the smallest that
    fits, or replaces the largest, wherever it sits in the free list (comparing tensors by value raised there)."""
    oc = OffloadedCheckpointing(mode=True)
    pool = _Lane(oc, torch.device("cpu")).pool
    small, large, medium = (pool.acquire(n) for n in (4096, 16384, 8192))
    held = oc.stats.host_bytes
    for slot in (large, small, medium):
        pool.release(slot)
    assert [s.numel() for s in pool.free] == [slot_bytes(16384), slot_bytes(4096), slot_bytes(8192)]
    taken = pool.acquire(10000)  # fits medium and large: medium, the last in the list
    assert taken is medium and [s.data_ptr() for s in pool.free] == [large.data_ptr(), small.data_ptr()]
    assert pool.acquire(15000) is large and pool.acquire(100) is small and not pool.free
    assert oc.stats.host_allocs == 3 and oc.stats.host_bytes == held  # every request served from the pool
    for slot in (small, large, medium):
        pool.release(slot)
    grown = pool.acquire(30000)  # larger than every idle slot: the largest (in the middle) is replaced
    assert grown.numel() == slot_bytes(30000) and oc.stats.host_allocs == 4
    assert [s.data_ptr() for s in pool.free] == [small.data_ptr(), medium.data_ptr()]
    assert oc.stats.host_bytes == held - large.numel() + grown.numel()
    pool.close()


def test_fewer_checkpointed_layers_and_longer_rows_keep_parity(gc_model, monkeypatch):
    """What the keep mode does beside the offload on a smaller GPU: step 1 packs every layer, then the plan's first
    look keeps the last two layers' activations (their inputs no longer offloaded) and rows vary in length, so idle
    slots of two sizes sit in the pool. Bitwise the plain run's losses and gradients with those two layers
    un-checkpointed from step 2 on, each step's packs served from the pool once it holds a slot that fits."""
    from nbkit.speedups.layer_budget import Budget, Look
    from nbkit.speedups.selective_checkpointing import SelectiveCheckpointing

    lengths = (64, 96, 80, 64, 96)
    batches = [dict(input_ids=ids, labels=ids) for ids in
               (torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths)]

    def last_two_unchecked_after_step_1(model, batch, steps: list):
        if steps:
            for layer in model.model.layers[2:]:
                layer.gradient_checkpointing = False
        steps.append(1)
        return model(**batch).loss

    plain = tiny_qwen3()
    plain.gradient_checkpointing_enable()
    ref = run_steps(plain, batches, forward=functools.partial(last_two_unchecked_after_step_1, steps=[]))
    oc = OffloadedCheckpointing(mode=True)
    runner = LayerRunner(keep=SelectiveCheckpointing(mode=True, max_tokens=max(lengths)), offload=oc)
    # the first look has room for the last two layers kept whole, and nothing more
    monkeypatch.setattr(Budget, "first_look", lambda budget: Look(runner.costs[3].kept + runner.costs[2].kept, "test"))
    assert runner.attach(gc_model) and runner.begin_training(gc_model)
    got = run_steps(gc_model, batches)
    assert [p.activations for p in runner.plans] == [OFFLOADED, OFFLOADED, KEPT, KEPT]
    assert_same_run(got, ref)
    assert oc.stats.packs == LAYERS + 2 * (len(lengths) - 1)
    assert sorted(s.numel() for s in oc._lanes[torch.device("cpu")].pool.free) == \
        sorted([slot_bytes(64 * 64 * 4)] * 2 + [slot_bytes(96 * 64 * 4)] * 2)
    assert oc.stats.host_allocs == LAYERS + 2  # grown once, for the two layers still offloaded
    runner.detach()
    assert not oc._lanes and all(layer.gradient_checkpointing for layer in gc_model.model.layers)
