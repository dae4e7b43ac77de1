"""The speedup contract, tested once for every speedup in ``nbkit.speedups.SPEEDUPS``.

``attach`` then ``detach`` leaves the model exactly as found: every module's own attributes and hooks, the model
config, and every module-level function of the transformers/PEFT modules loaded. While attached, the speedup must
have changed something (else the comparison would prove nothing), and its ledger must hold every change. The only
global act allowed is registering ``"nbkit"`` with transformers' attention/experts interfaces. A speedup that changes
the model only once training runs is exercised with training steps while attached, so the changes it makes then are
held to the contract too. A trainer-stage speedup (``stage="trainer"``) is attached to a tiny ``FastSFT`` and held to
the same for the trainer's own attributes and its model.

The decoder layers' row (``decoder_layers``, one ``LayerRunner``) is held to it with every mode on at once, trained
through its plan's first and second looks (the checkpointed layers taken over, weights kept dequantized, kept layers
replayed as graphs, MLPs tiled); and each mode on its own (``mode.attach(model)``: a standalone runner with that
mode alone), since that is how a mode is used outside FastSFT.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any, Callable

import pytest
import torch
from peft import LoraConfig, get_peft_model

from nbkit.demo.models import tiny_model
from nbkit.ops.layer_graphs import TapeBackend
from nbkit.ops.packed_boundaries import metadata_from_lengths
from nbkit.speedups import LAYER_MODES, SPEEDUPS
from nbkit.speedups.cuda_graphs import CudaGraphs
from nbkit.speedups.dequant_cache import DequantCache
from nbkit.speedups.expandable_segments import ExpandableSegments, current_settings
from nbkit.speedups.fused_kernels import FusedKernels, KernelOps
from nbkit.speedups.fused_lora import FusedLoRA
from nbkit.speedups.layer_runner import LayerRunner
from nbkit.speedups.moe import FastMoERouting
from nbkit.speedups.offload import OffloadedCheckpointing
from nbkit.speedups.packed_attention import PackedAttention
from nbkit.speedups.selective_checkpointing import SelectiveCheckpointing
from nbkit.speedups.step_flops import CachedFlops
from nbkit.speedups.step_walks import CachedTrainableWalks
from nbkit.speedups.sync_free_loss import SyncFreeLoss
from nbkit.speedups.tiled_mlp import TiledMLP

VOCAB = 97
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _torch_ops() -> KernelOps:
    """Plain-torch ops with Liger's functional signatures (Liger's own need a GPU)."""

    def rms_norm(x, w, eps, offset=0.0, casting_mode="llama", in_place=True):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return ((offset + w.float()) * y).to(x.dtype)

    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

        def rot(x):
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    return KernelOps(rms_norm, lambda a, b: torch.nn.functional.silu(a) * b,
                     lambda a, b: torch.nn.functional.gelu(a, approximate="tanh") * b, rope, "reference")


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))


def _gc(model: torch.nn.Module) -> torch.nn.Module:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _four_bit_lora() -> torch.nn.Module:
    """LoRA over NF4 bases (quantized on the CPU by bitsandbytes)."""
    import bitsandbytes as bnb

    model = tiny_model("qwen3", VOCAB)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and name.endswith("_proj"):
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=torch.float32,
                                      quant_type="nf4")
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4", module=q)
                setattr(module, name, q.to("cpu"))
    return _lora(model)


def _train_steps(model: torch.nn.Module, steps: int = 2) -> None:
    ids = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()


def _trainer() -> Any:
    """A tiny FastSFT (LoRA on qwen3, CPU, fp32, every trainer-stage switch on); nothing is trained."""
    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    model = tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0)
    args = FastSFTConfig(output_dir=tempfile.mkdtemp(), max_steps=1, per_device_train_batch_size=2, report_to=[],
                         save_strategy="no", use_cpu=True, bf16=False, max_length=64, live_dashboard=False,
                         disable_tqdm=True, sync_free_metrics=True)
    return FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=8), processing_class=tok,
                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))


def _runner_model() -> torch.nn.Module:
    """LoRA over NF4 bases, checkpointed, with packed attention and fused LoRA attached (what the runner's modes need:
    checkpointed layers to keep or offload, fused 4-bit bases to keep dequantized, packed rows to replay as graphs).
    Those two are part of the model as found: the contract is the runner's."""
    model = _gc(_four_bit_lora())
    packed = PackedAttention(kernel="sdpa")
    for speedup in (packed, FusedLoRA()):
        assert speedup.attach(model)
    _PACKED[id(model)] = packed  # the graphs mode reads its per-forward runs (FastSFT's build() hands it over)
    return model


_PACKED: dict[int, PackedAttention] = {}


def _all_modes() -> LayerRunner:
    return LayerRunner(keep=SelectiveCheckpointing(mode=True, max_tokens=32), offload=OffloadedCheckpointing(mode=True),
                       graphs=CudaGraphs(mode=True, backend=TapeBackend()), tiled=TiledMLP(tile_tokens=8),
                       dequant=DequantCache(mode=True))


def _train_runner(model: torch.nn.Module, runner: LayerRunner) -> None:
    """As FastSFT drives it: training begins, step 1 (every layer checkpointed and offloaded), the first look at the
    2nd forward, an optimizer step, the second look at the next."""
    runner.graphs.packed = _PACKED.pop(id(model))
    assert runner.begin_training(model)
    meta = metadata_from_lengths([20, 12])
    ids = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        model(input_ids=ids, labels=ids, use_cache=False, **meta).loss.backward()
        if step == 1:
            runner.optimizer_stepped()
    assert runner.planned and runner.offload.engaged and runner.dequant.engaged and runner.graphs.replays > 0
    assert runner.tiled is not None and runner.kept == len(runner.layers), runner.line


# name -> (target builder: the model, or the trainer for stage "trainer"; speedup builder). Every row must be here.
CASES: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "cached_packing": (lambda: tiny_model("qwen3", VOCAB), lambda: PackedAttention(kernel="auto")),
    "fast_moe_routing": (lambda: _lora(tiny_model("qwen3_moe", VOCAB)), FastMoERouting),
    "fused_lora": (lambda: _lora(tiny_model("llama", VOCAB)), FusedLoRA),
    "fused_kernels": (lambda: tiny_model("gemma3", VOCAB), lambda: FusedKernels(ops=_torch_ops())),
    "decoder_layers": (_runner_model, _all_modes),
    "expandable_segments": (lambda: tiny_model("qwen3", VOCAB), lambda: ExpandableSegments(mode=True)),
    "sync_free_metrics": (_trainer, SyncFreeLoss),
    "step_walks": (_trainer, CachedTrainableWalks),
    "step_flops": (_trainer, CachedFlops),
}
# switch -> what runs while it is attached (given the model and the speedup), before the comparison (default: nothing)
EXERCISE: dict[str, Callable[[torch.nn.Module, Any], None]] = {
    "decoder_layers": _train_runner,
}
# each mode of the runner on its own (``mode.attach(model)``): switch -> (model builder, mode builder, exercise)
MODES: dict[str, tuple[Callable[[], Any], Callable[[], Any], Callable[[torch.nn.Module, Any], None]]] = {
    "selective_checkpointing": (lambda: _gc(_lora(tiny_model("qwen3", VOCAB))),
                                lambda: SelectiveCheckpointing(mode=True, max_tokens=32),
                                lambda model, mode: _train_steps(model)),
    "offload_checkpointing": (lambda: _gc(tiny_model("qwen3", VOCAB)), lambda: OffloadedCheckpointing(mode=True),
                              lambda model, mode: _train_steps(model, 1)),
    "cuda_graphs": (lambda: _lora(tiny_model("qwen3", VOCAB)), lambda: CudaGraphs(mode=True, backend=TapeBackend()),
                    lambda model, mode: None),
    "tiled_mlp": (lambda: _lora(tiny_model("llama", VOCAB)), lambda: TiledMLP(tile_tokens=8),
                  lambda model, mode: None),
    # its copies are kept at the first look, the first layer call of the second training forward
    "dequant_cache": (_four_bit_lora, lambda: DequantCache(mode=True), lambda model, mode: _train_steps(model)),
}


def _watched_modules() -> list[Any]:
    prefixes = ("transformers.models.", "transformers.integrations.", "peft.tuners.")
    names = {"transformers.modeling_utils", "transformers.masking_utils", "torch.utils.checkpoint",
             "torch.nn.functional"}
    return [m for n, m in list(sys.modules.items())
            if m is not None and (n in names or n.startswith(prefixes))]


def _registries() -> dict[str, dict]:
    from transformers import AttentionInterface

    out = {"attention": dict(AttentionInterface._global_mapping)}
    try:
        from transformers.integrations.moe import ExpertsInterface

        out["experts"] = dict(ExpertsInterface._global_mapping)
    except ImportError:
        pass
    return {k: {name: v for name, v in mapping.items() if name != "nbkit"} for k, mapping in out.items()}


def snapshot(target: Any) -> dict[str, Any]:
    """Identity of everything a speedup could change: per module its own attributes and hooks; the configs; the
    module-level objects of the loaded transformers/PEFT modules; the interface registries (bar "nbkit"); for a
    trainer, its own attributes and all of that for its model."""
    if not isinstance(target, torch.nn.Module):
        return {**snapshot(target.model), "trainer": {k: id(v) for k, v in vars(target).items()}}
    model = target
    modules = {}
    for name, m in model.named_modules():
        own = {k: id(v) for k, v in vars(m).items() if k not in _HOOK_DICTS and k != "_modules"}
        own["_modules"] = tuple((k, id(v)) for k, v in m._modules.items())
        for k in _HOOK_DICTS:
            hooks = getattr(m, k, None)
            if hooks is not None:
                own[k] = tuple((key, id(v)) for key, v in hooks.items())
        modules[name] = own
    configs = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and id(config) not in configs:
            configs[id(config)] = repr(sorted((k, repr(v)) for k, v in vars(config).items()))
    functions = {m.__name__: {k: id(v) for k, v in vars(m).items()} for m in _watched_modules()}
    return {"modules": modules, "configs": configs, "functions": functions, "registries": _registries(),
            "allocator": current_settings()}


def differences(before: dict, after: dict) -> list[str]:
    out = []
    for name, own in before["modules"].items():
        got = after["modules"].get(name)
        if got != own:
            keys = sorted(k for k in set(own) | set(got or {}) if (got or {}).get(k) != own.get(k))
            out.append(f"module {name or '<root>'}: {keys}")
    out += [f"module {n} added" for n in set(after["modules"]) - set(before["modules"])]
    out += ["config changed" for k, v in before["configs"].items() if after["configs"].get(k) != v]
    for mod, names in before["functions"].items():
        got = after["functions"].get(mod, {})
        changed = sorted(k for k in set(names) | set(got) if got.get(k) != names.get(k))
        if changed:
            out.append(f"{mod}: {changed[:5]}")
    if after["registries"] != before["registries"]:
        out.append("an interface registry changed beyond 'nbkit'")
    if after["allocator"] != before["allocator"]:
        out.append(f"the allocator's settings: {before['allocator']!r} -> {after['allocator']!r}")
    trainer, got = before.get("trainer", {}), after.get("trainer", {})
    changed = sorted(k for k in set(trainer) | set(got) if got.get(k) != trainer.get(k))
    if changed:
        out.append(f"trainer: {changed}")
    return out


def test_every_speedup_in_the_table_is_held_to_the_contract():
    assert {spec.name for spec in SPEEDUPS} == set(CASES)
    for spec in SPEEDUPS:  # the name a speedup reports (nbkit_attached) is its row's
        assert CASES[spec.name][1]().name == spec.name
    assert {name for name, _, _ in LAYER_MODES} == set(MODES)  # and every mode of the runner on its own
    for name, role, _ in LAYER_MODES:
        mode = MODES[name][1]()
        assert mode.name == name and getattr(_all_modes(), role).name == name


def _held_to_the_contract(name: str, model: Any, speedup: Any, probe: Any, exercise: Callable,
                          ledger: Callable[[Any], Any]) -> None:
    assert probe.attach(model) is True  # a first attach/detach imports what the speedup needs: imports are not changes
    probe.detach()
    before = snapshot(model)
    assert speedup.attach(model) is True, f"{name} did not attach to its model: the contract test proves nothing"
    exercise(model, speedup)
    during = snapshot(model)
    assert differences(before, during), f"{name} attached but changed nothing this test can see"
    assert len(ledger(speedup)) > 0, f"{name} made its changes outside its ledger"
    speedup.detach()
    assert differences(before, snapshot(model)) == []
    speedup.detach()  # twice is safe
    assert differences(before, snapshot(model)) == []


@pytest.mark.parametrize("switch", sorted(CASES))
def test_attach_then_detach_leaves_model_modules_and_functions_as_found(switch, one_thread):
    build_model, build_speedup = CASES[switch]
    _held_to_the_contract(switch, build_model(), build_speedup(), build_speedup(),
                          EXERCISE.get(switch, lambda m, s: None), lambda speedup: speedup._ledger)


@pytest.mark.parametrize("switch", sorted(MODES))
def test_each_layer_mode_on_its_own_leaves_the_model_as_found(switch, one_thread):
    """``mode.attach(model)``: a standalone runner with the mode alone; its ledger is that runner's."""
    build_model, build_mode, exercise = MODES[switch]
    _held_to_the_contract(switch, build_model(), build_mode(), build_mode(), exercise,
                          lambda mode: mode._runner._ledger)


def test_a_change_made_outside_the_ledger_is_caught(one_thread):
    """Negative control: an instance forward left behind, and a module-level function left patched."""
    import transformers.models.qwen3.modeling_qwen3 as modeling

    model = tiny_model("qwen3", VOCAB)
    before = snapshot(model)
    model.model.norm.forward = lambda x: x
    original = modeling.apply_rotary_pos_emb
    modeling.apply_rotary_pos_emb = lambda *a, **k: None
    try:
        found = differences(before, snapshot(model))
    finally:
        modeling.apply_rotary_pos_emb = original
        del model.model.norm.forward
    assert any("model.norm" in d for d in found)
    assert any("modeling_qwen3" in d and "apply_rotary_pos_emb" in d for d in found)
    assert differences(before, snapshot(model)) == []


def test_the_trainer_stage_attaches_with_the_run_and_lists_only_switched_speedups(one_thread):
    """Inside ``nbkit_speedups`` the trainer-stage speedups are on the trainer (its ``compute_loss``, ``log``,
    ``_clip_grad_norm`` and ``floating_point_ops`` are theirs); ``nbkit_attached`` names the switched one
    (``sync_free_metrics``), not the always-on ones; after the block the trainer's own methods are back."""
    trainer = _trainer()
    with trainer.nbkit_speedups():
        names = trainer.active_speedups
        patched = {k for k in ("compute_loss", "log", "_clip_grad_norm", "floating_point_ops") if k in vars(trainer)}
        kinds = {type(s) for s in trainer._speedups}
    assert "sync_free_metrics" in names and not {"step_walks", "step_flops"} & set(names), names
    assert patched == {"compute_loss", "log", "_clip_grad_norm", "floating_point_ops"}
    assert {SyncFreeLoss, CachedTrainableWalks, CachedFlops} <= kinds
    assert not {"compute_loss", "log", "_clip_grad_norm", "floating_point_ops"} & set(vars(trainer))
