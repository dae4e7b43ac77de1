"""CPU tests of the speedup nbkit.speedups.moe (fp32): nbkit's experts path equals transformers' eager experts.

Each parity test compares outputs and gradients (inputs, router, expert weights and biases, LoRA A/B) with the plain
path at fp32 tolerance (rtol 1e-4, atol 1e-5); both routing backends ("loop": contiguous slices, "grouped":
torch's grouped_mm, which also runs on CPU) are exercised. The other tests hold attach/detach to the ledger
contract. The ops themselves are checked against their references in tests/ops/test_moe_routing.py and
tests/ops/test_moe_gates.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from parity import Tol, add_lora, assert_same_run, run_steps
from torch import nn
from torch.nn.utils import parametrize
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from nbkit.speedups import moe
from nbkit.speedups.moe import FastMoERouting

torch.set_num_threads(min(2, torch.get_num_threads()))
FAMILIES = ["gpt_oss", "qwen3_moe", "mixtral"]
TOL = dict(rtol=1e-4, atol=1e-5)
MODEL_TOL = Tol(**TOL)
E, H, INTER = 8, 16, 24


def _config(family: str, top_k: int = 2, layers: int = 2):
    common = dict(vocab_size=64, hidden_size=H, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts_per_tok=top_k, attn_implementation="eager")
    if family == "gpt_oss":
        return GptOssConfig(intermediate_size=INTER, num_local_experts=E, **common,
                            layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if family == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=INTER, num_experts=E, decoder_sparse_step=1,
                              mlp_only_layers=[], **common)
    return MixtralConfig(intermediate_size=INTER, num_local_experts=E, **common)


def _model(family: str, top_k: int = 2):
    torch.manual_seed(0)
    cls = {"gpt_oss": GptOssForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}[family]
    model = cls(_config(family, top_k))
    for name, p in model.named_parameters():  # large enough to matter, and to cross gpt-oss's clamp
        if "experts" in name or "router" in name or "gate.weight" in name:
            torch.nn.init.normal_(p, std=0.5)
    for m in model.modules():
        if hasattr(m, "limit"):
            m.limit = 1.0
    return model


def _experts(family: str, top_k: int):
    model = _model(family, top_k)
    experts = next(m for m in model.modules() if moe._is_interface_experts(m))
    return experts


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def _run_experts(experts, impl: str, x, logits, top_k, backend="loop", index=None, kernels="torch"):
    """Experts forward + backward with routing from ``logits`` (or a fixed ``index``); returns out and grads."""
    moe.register()
    experts.config._experts_implementation = impl
    if impl == "nbkit":
        experts._nbkit_moe_plan = moe._make_plan(experts, x.device, x.dtype, backend, kernels)
    try:
        if index is None:
            values, index = logits.topk(top_k, dim=-1)
        else:
            values = logits.gather(1, index)
        weights = values.softmax(-1)
        out = experts(x, index, weights)
        probe = torch.linspace(-1, 1, out.numel()).view_as(out)
        grads = _grads((out * probe).sum(), [x, logits, *experts.parameters()])
    finally:
        experts.__dict__.pop("_nbkit_moe_plan", None)
    return out, grads


def _assert_same(ref, got):
    (out_r, grads_r), (out_g, grads_g) = ref, got
    torch.testing.assert_close(out_g, out_r, **TOL)
    for a, b in zip(grads_g, grads_r):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("backend", ["loop", "grouped"])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_match_eager(family, top_k, backend):
    """Outputs and grads (hidden, router logits, every expert weight/bias) equal the eager experts loop."""
    experts = _experts(family, top_k)
    x = torch.randn(13, H, requires_grad=True)
    logits = torch.randn(13, E, requires_grad=True)
    ref = _run_experts(experts, "eager", x, logits, top_k)
    _assert_same(ref, _run_experts(experts, "nbkit", x, logits, top_k, backend))


@pytest.mark.parametrize("backend", ["loop", "grouped"])
@pytest.mark.parametrize("case", ["empty_experts", "all_to_one"])
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_skewed_routing(family, case, backend):
    """Experts receiving no token (their weight grads must stay exactly zero) and a batch on one expert."""
    top_k = 2
    experts = _experts(family, top_k)
    T = 11
    x = torch.randn(T, H, requires_grad=True)
    logits = torch.randn(T, E, requires_grad=True)
    if case == "empty_experts":  # only experts 1, 4, 6 are used
        pool = torch.tensor([1, 4, 6])
        index = torch.stack([pool[torch.randperm(3)[:top_k]] for _ in range(T)])
    else:  # every token on expert 3 first (and expert 5 second)
        index = torch.tensor([[3, 5]] * T)
    ref = _run_experts(experts, "eager", x, logits, top_k, index=index)
    got = _run_experts(experts, "nbkit", x, logits, top_k, backend, index=index)
    _assert_same(ref, got)
    used = set(index.flatten().tolist())
    for g in got[1][2:]:
        for e in set(range(E)) - used:
            assert torch.count_nonzero(g[e]) == 0


class _UpDownExperts(nn.Module):
    """Experts without a gate (has_gate=False), like NemotronH's: the eager reference is a per-assignment einsum."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = E
        self.up_proj = nn.Parameter(torch.randn(E, INTER, H) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(E, H, INTER) * 0.3)
        self.act_fn = nn.GELU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        up = torch.einsum("th,tkih->tki", hidden_states, self.up_proj[top_k_index])
        down = torch.einsum("tki,tkhi->tkh", self.act_fn(up), self.down_proj[top_k_index])
        return (down * top_k_weights.unsqueeze(-1)).sum(1)


def _gelu_experts():
    """Mixtral experts with a GELU gate: transformers' default _apply_gate, an activation nbkit does not fuse."""
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**{**_config("mixtral").to_dict(), "hidden_act": "gelu"}))
    experts = next(m for m in model.modules() if moe._is_interface_experts(m))
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return experts


@pytest.mark.parametrize("backend", ["loop", "grouped"])
@pytest.mark.parametrize("kind", ["gelu_gate", "no_gate"])
def test_generic_gate_families(kind, backend):
    """Families whose gate nbkit does not fuse run the model's own _apply_gate / act_fn on the sorted rows."""
    if kind == "gelu_gate":
        experts = _gelu_experts()
    else:
        from transformers import PretrainedConfig
        from transformers.integrations.moe import use_experts_implementation

        torch.manual_seed(0)
        experts = use_experts_implementation(has_gate=False)(type("UpDown", (_UpDownExperts,), {}))(PretrainedConfig())
    assert moe._gate_kind(experts) == "generic"
    x = torch.randn(13, H, requires_grad=True)
    logits = torch.randn(13, E, requires_grad=True)
    ref = _run_experts(experts, "eager", x, logits, 2)
    _assert_same(ref, _run_experts(experts, "nbkit", x, logits, 2, backend))


def test_all_tokens_one_expert_top1():
    experts = _experts("gpt_oss", 1)
    x = torch.randn(9, H, requires_grad=True)
    logits = torch.randn(9, E, requires_grad=True)
    index = torch.full((9, 1), 7)
    ref = _run_experts(experts, "eager", x, logits, 1, index=index)
    _assert_same(ref, _run_experts(experts, "nbkit", x, logits, 1, "grouped", index=index))


def test_no_tokens():
    experts = _experts("qwen3_moe", 2)
    moe.register()
    out = moe.nbkit_experts_forward(experts, torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, H)


def _loss_and_grads(model, ids):
    """The language-model loss of ``ids`` and the gradient of every trainable parameter."""
    return run_steps(model, [dict(input_ids=ids, labels=ids)])


def _assert_model_same(ref, got):
    assert_same_run(got, ref, losses=MODEL_TOL, grads=MODEL_TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_full_finetune(family):
    """A tiny 2-layer model: loss and every parameter's gradient equal the eager experts path."""
    model = _model(family)
    ids = torch.randint(0, 64, (2, 10))
    model.set_experts_implementation("eager")
    ref = _loss_and_grads(model, ids)
    fm = FastMoERouting()
    assert fm.attach(model)
    try:
        _assert_model_same(ref, _loss_and_grads(model, ids))
    finally:
        fm.detach()


def _peft_model(family, r=4):
    up = "mlp.experts.gate_up_proj" if family == "gpt_oss" else "experts.gate_up_proj"
    down = up.replace("gate_up_proj", "down_proj")
    # PEFT starts B at zero; random_b makes the adapters matter
    return add_lora(_model(family), r, targets=["q_proj"], target_parameters=[up, down], random_b=0.3)


class _CountParametrizations:
    def __init__(self, monkeypatch):
        self.calls = 0
        original = parametrize.register_parametrization

        def counting(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(parametrize, "register_parametrization", counting)


@pytest.mark.parametrize("backend", ["loop", "grouped"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_experts_matches_peft(family, backend, monkeypatch):
    """PEFT target_parameters LoRA: loss and LoRA A/B grads equal PEFT's own path, without its parametrization."""
    peft_model = _peft_model(family)
    ids = torch.randint(0, 64, (2, 10))
    peft_model.get_base_model().set_experts_implementation("eager")
    counter = _CountParametrizations(monkeypatch)
    ref = _loss_and_grads(peft_model, ids)
    assert counter.calls > 0  # PEFT's path materializes W + BA through a parametrization
    fm = FastMoERouting(backend=backend)
    assert fm.attach(peft_model)
    try:
        assert fm.lora_bypassed == 2
        counter.calls = 0
        got = _loss_and_grads(peft_model, ids)
        assert counter.calls == 0  # nbkit never forms W + BA
        _assert_model_same(ref, got)
        assert any("experts" in n and "lora_A" in n for n in got.grads[0])
        with peft_model.disable_adapter():  # disabled adapters: the base experts only, as PEFT computes
            base = peft_model(input_ids=ids).logits
        fm.detach()
        with peft_model.disable_adapter():
            torch.testing.assert_close(peft_model(input_ids=ids).logits, base, **TOL)
    finally:
        fm.detach()


def test_lora_rank_not_multiple_of_8_grouped():
    """The grouped backend pads the LoRA rank to a multiple of 8 with zeros: same numbers as PEFT."""
    peft_model = _peft_model("qwen3_moe", r=3)
    ids = torch.randint(0, 64, (2, 10))
    peft_model.get_base_model().set_experts_implementation("eager")
    ref = _loss_and_grads(peft_model, ids)
    fm = FastMoERouting(backend="grouped")
    assert fm.attach(peft_model)
    try:
        _assert_model_same(ref, _loss_and_grads(peft_model, ids))
    finally:
        fm.detach()


def test_lora_on_a_bias_stays_on_peft(caplog):
    """LoRA on a tensor nbkit does not compute (a bias) keeps PEFT's path for that module: said once, same numbers."""
    peft_model = add_lora(_model("gpt_oss"), 4, targets=["q_proj"],
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj_bias"], random_b=0.3)
    ids = torch.randint(0, 64, (2, 10))
    peft_model.get_base_model().set_experts_implementation("eager")
    ref = _loss_and_grads(peft_model, ids)
    fm = FastMoERouting()
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.moe"):
        assert fm.attach(peft_model)
    try:
        assert fm.lora_bypassed == 0 and len(caplog.records) == 1 and "down_proj_bias" in caplog.text
        _assert_model_same(ref, _loss_and_grads(peft_model, ids))
    finally:
        fm.detach()


def test_attach_detach_restores_everything():
    """Attach twice, a second object on top (detached first: last in, first out), detach twice: the implementation,
    every module's own attributes and the logits are as before."""
    peft_model = _peft_model("gpt_oss")
    base = peft_model.get_base_model()
    before = base.get_experts_implementation()
    ids = torch.randint(0, 64, (1, 8))
    logits_before = peft_model(input_ids=ids).logits
    fm = FastMoERouting()
    assert fm.attach(peft_model)
    assert fm.attach(peft_model)  # attaching again is safe (detaches first)
    assert base.get_experts_implementation() == {"": "nbkit"}
    assert ALL_EXPERTS_FUNCTIONS["nbkit"] is moe.nbkit_experts_forward
    other = FastMoERouting()
    assert other.attach(peft_model.get_base_model())  # a second object: registration is idempotent
    assert ALL_EXPERTS_FUNCTIONS["nbkit"] is moe.nbkit_experts_forward
    other.detach()
    assert base.get_experts_implementation() == {"": "nbkit"} and fm.lora_bypassed == 2  # the first one is intact
    fm.detach()
    fm.detach()  # twice is safe
    assert base.get_experts_implementation() == before
    assert not any("forward" in m.__dict__ or "_nbkit_moe_plan" in m.__dict__ for m in peft_model.modules())
    torch.testing.assert_close(peft_model(input_ids=ids).logits, logits_before)


def test_unsupported_models_stay_plain(caplog):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with caplog.at_level(logging.INFO, logger="nbkit.speedups.moe"):
        assert FastMoERouting().attach(llama) is False
    assert "no experts module" in caplog.text

    model = _model("mixtral")
    model._tp_size = 2  # as after tensor/expert-parallel loading: expert ids may be sentinels
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.moe"):
        assert FastMoERouting().attach(model) is False
    assert "parallel" in caplog.text and len(caplog.records) == 1
    assert model.get_experts_implementation() == {"": "grouped_mm"}


def test_bare_experts_module_attach():
    """A bare experts module (no PreTrainedModel around it): selected through its config, restored on detach."""
    experts = _experts("qwen3_moe", 2)
    experts.config._experts_implementation = "eager"
    fm = FastMoERouting()
    assert fm.attach(experts)
    assert experts.config._experts_implementation == "nbkit" and experts._nbkit_moe_plan.backend == "loop"
    fm.detach()
    assert experts.config._experts_implementation == "eager"


_TRITON_SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.test_moe import _experts, _gelu_experts, _run_experts, _assert_same, H, E
    for family, top_k in (("gpt_oss", 4), ("qwen3_moe", 1), ("gelu", 2)):  # bias + interleaved, silu, generic
        experts = _gelu_experts() if family == "gelu" else _experts(family, top_k)
        assert experts.has_bias == (family == "gpt_oss")
        x = torch.randn(13, H, requires_grad=True)
        logits = torch.randn(13, E, requires_grad=True)
        ref = _run_experts(experts, "nbkit", x, logits, top_k, "loop", kernels="torch")
        _assert_same(ref, _run_experts(experts, "nbkit", x, logits, top_k, "loop", kernels="triton"))
    print("TRITON_OK")
    """
)


def test_triton_kernels_match_torch_interpreted():
    """The experts forward and backward with the Triton kernels (gate fwd/bwd, gather-sum, combine backward) equal
    the same path with the torch kernels, fp32 (TOL).

    Runs under TRITON_INTERPRET=1 in a subprocess: the interpreter must be on before triton is imported.
    """
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))  # tests/: the parity harness
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "TRITON_OK" in proc.stdout, proc.stderr[-3000:]


def test_bad_options_are_refused():
    with pytest.raises(ValueError):
        FastMoERouting(backend="yes")
    with pytest.raises(ValueError):
        FastMoERouting(kernels="yes")


def test_every_change_goes_through_the_ledger_and_detach_empties_it():
    """attach records the implementation switch, one plan per experts module and one forward per PEFT wrapper
    chain, and nothing else; detach undoes all of it."""
    peft_model = _peft_model("qwen3_moe")
    fm = FastMoERouting()
    assert fm.attach(peft_model)
    entries = fm._ledger.entries()
    layers = peft_model.get_base_model().config.num_hidden_layers
    assert entries[0] == "set_experts_implementation"
    assert entries.count("set Qwen3MoeExperts._nbkit_moe_plan") == layers
    assert entries.count("set ParamWrapper.forward") == layers == fm.lora_bypassed
    assert len(entries) == 1 + 2 * layers
    fm.detach()
    assert len(fm._ledger) == 0 and fm.lora_bypassed == 0


def test_a_model_whose_implementation_cannot_switch_stays_as_found(monkeypatch, caplog):
    """When transformers refuses the switch (e.g. a load-time-only implementation), attach says so once and
    leaves the model, its config and its experts modules as found."""
    model = _model("mixtral")
    before = model.get_experts_implementation()
    original = model.set_experts_implementation

    def refuse(impl):
        if impl == "nbkit":
            raise RuntimeError("a load-time choice")
        original(impl)

    monkeypatch.setattr(model, "set_experts_implementation", refuse)
    fm = FastMoERouting()
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.moe"):
        assert fm.attach(model) is False
    assert "cannot switch" in caplog.text and len(caplog.records) == 1
    assert model.get_experts_implementation() == before and len(fm._ledger) == 0
    assert not any("_nbkit_moe_plan" in m.__dict__ for m in model.modules())


def test_step_benchmark_tiny_losses(monkeypatch, caplog):
    """``python -m benchmarks.moe_step --tiny`` (TRL SFTTrainer vs FastSFT on a tiny gpt-oss, CPU fp32): every path
    completes. With one padded document per row (plain gpt-oss attention is per document there too) FastSFT's
    per-step losses equal SFTTrainer's to 1e-4 relative, full fine-tune and LoRA (experts + attention); with TRL
    packing, FastSFT with and without nbkit's routing agree to 1e-4, and the routing ran only where asked."""
    from benchmarks import moe_step

    monkeypatch.delenv("OUT", raising=False)
    quick = ["--tiny", "--steps", "3", "--warmup", "1"]
    with caplog.at_level(logging.INFO, logger="nbkit.speedups.moe"):
        rows = moe_step.run(quick + ["--packing", "off", "--paths", "sft,fast,sft_lora,fast_lora"])
    assert not [r for r in rows if r.get("error")], rows
    assert "LoRA bypass on 4" in caplog.text  # FastSFT's LoRA on the experts of all 4 layers ran through nbkit
    gaps = moe_step.loss_gaps(rows)
    assert set(gaps) == {"fast vs sft", "fast_lora vs sft_lora"} and max(gaps.values()) < 1e-4, gaps
    assert all(len(r["losses"]) == 4 for r in rows)

    rows = moe_step.run(quick)
    by_path = {r["path"]: r for r in rows}
    assert set(by_path) == set(moe_step.PATHS) and not [r for r in rows if r.get("error")], rows
    gaps = moe_step.loss_gaps(rows)
    assert gaps["fast vs fast_noroute"] < 1e-4 and gaps["fast_lora vs fast_lora_noroute"] < 1e-4, gaps
    for path, row in by_path.items():
        assert ("fast_moe_routing" in row["speedups"]) == (path in ("fast", "fast_lora")), (path, row["speedups"])
    assert 0 < by_path["fast_lora"]["trainable_params"] < by_path["fast"]["trainable_params"]
