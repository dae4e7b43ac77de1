"""``selective_checkpointing`` on a CUDA GPU in bf16, every other switch at its default: the same training as plain
checkpointing, no recompute where the activations fit, and a measure that matches what the allocator holds.

Tolerance: the LoRA gradients of every step within max(2 x the plain run's own run-to-run difference, 1e-2)
relative, losses within 1e-2 relative. The recompute reproduces the forward's values with the same kernels, so the
two usually agree bit for bit (printed); the bound covers kernels whose backward is not deterministic (atomics).
"""

from __future__ import annotations

import pytest
import torch
from grad_steps import StepGrads, max_relative

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4)
STEPS = 3


def _attention_calls(model) -> list[int]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    counts = [0] * len(base.model.layers)
    for i, layer in enumerate(base.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def _train(tmp_path, tag: str, build, selective, **kw):
    from nbkit import FastSFT, FastSFTConfig
    from nbkit.demo.data import make_dataset
    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    model, peft_config = build(tok)
    args = FastSFTConfig(output_dir=str(tmp_path / tag), max_steps=STEPS, per_device_train_batch_size=2,
                         packing=True, max_length=512, bf16=True, learning_rate=1e-2, optim="sgd", logging_steps=1,
                         report_to=[], save_strategy="no", seed=0, shuffle_dataset=False, gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": False}, live_dashboard=False,
                         selective_checkpointing=selective, **kw)
    grads = StepGrads()
    torch.cuda.reset_peak_memory_stats()  # the budget counts the process's peak: not the earlier tests'
    torch.manual_seed(0)
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=200), processing_class=tok,
                      peft_config=peft_config, callbacks=[grads])
    calls = _attention_calls(trainer.model)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, grads.steps, calls, trainer


def _bf16(family: str):
    def build(tok):
        from peft import LoraConfig

        from nbkit.demo.models import tiny_model

        extra = {"moe_intermediate_size": 128} if family == "qwen3_moe" else {}
        model = tiny_model(family, len(tok), dtype=torch.bfloat16, pad_token_id=tok.pad_token_id, seed=0, **SHAPE,
                           **extra)
        return model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)

    return build


def _four_bit(folder):
    def build(tok):
        from nbkit.demo.models import tiny_model
        from nbkit.loading import load_model

        if not (folder / "config.json").exists():
            tiny_model("qwen3", len(tok), pad_token_id=tok.pad_token_id, seed=0, **SHAPE).save_pretrained(folder)
            tok.save_pretrained(folder)
        torch.manual_seed(0)  # LoRA A's init
        model, _ = load_model(str(folder), load_in_4bit=True, dtype=torch.bfloat16, lora_r=8)
        return model, None

    return build


def _check(plain, again, fast, layers: int) -> None:
    noise = max(max_relative(a, b) for a, b in zip(again[1], plain[1]))
    err = max(max_relative(a, b) for a, b in zip(fast[1], plain[1]))
    print(f"losses {plain[0]} vs {fast[0]}; LoRA gradients: plain vs plain {noise:.2e}, selective vs plain "
          f"{err:.2e}, bitwise {err == 0}; attached {fast[3].nbkit_attached}")
    assert fast[0] == pytest.approx(plain[0], rel=1e-2)
    assert err <= max(2 * noise, 1e-2)
    assert plain[2] == [2 * STEPS] * layers
    assert fast[2] == [2 + (STEPS - 1)] * layers  # short rows on a big GPU: every layer fits, none recomputes
    assert "selective_checkpointing" in fast[3].nbkit_attached


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_auto_trains_as_plain_checkpointing_in_bf16(tmp_path, family):
    build = _bf16(family)
    plain = _train(tmp_path, "plain", build, False)
    again = _train(tmp_path, "again", build, False)
    fast = _train(tmp_path, "auto", build, "auto")
    _check(plain, again, fast, SHAPE["num_hidden_layers"])


def test_auto_beside_offload_trains_as_offloaded_checkpointing(tmp_path):
    """Offloaded checkpointing forced on for both runs: step 1 offloads every layer input, then 'auto' keeps every
    layer's activations (short rows on a big GPU) and the un-checkpointed layers bypass the offload."""
    build = _bf16("qwen3")
    plain = _train(tmp_path, "plain", build, False, offload_checkpointing=True)
    again = _train(tmp_path, "again", build, False, offload_checkpointing=True)
    fast = _train(tmp_path, "auto", build, "auto", offload_checkpointing=True)
    _check(plain, again, fast, SHAPE["num_hidden_layers"])
    assert "offload_checkpointing" in fast[3].nbkit_attached


def test_auto_trains_as_plain_checkpointing_on_a_4bit_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    build = _four_bit(tmp_path / "base")
    plain = _train(tmp_path, "plain", build, False)
    again = _train(tmp_path, "again", build, False)
    fast = _train(tmp_path, "auto", build, "auto")
    _check(plain, again, fast, SHAPE["num_hidden_layers"])


def test_a_per_process_cap_is_honoured(tmp_path, monkeypatch):
    """The limit is the per-process fraction of the GPU; one that leaves no room (faked, so the run itself cannot hit
    it) keeps every layer checkpointed."""
    from nbkit.memory import gpu_limit

    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(0.5, device)
    try:
        assert gpu_limit(device) == int(total * 0.5)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                        lambda device=None: torch.cuda.max_memory_allocated() / total)  # the limit: the peak
    _, _, calls, trainer = _train(tmp_path, "capped", _bf16("qwen3"), "auto")
    assert calls == [2 * STEPS] * SHAPE["num_hidden_layers"]
    assert "selective_checkpointing" not in trainer.nbkit_attached


def test_the_measure_matches_the_memory_an_unchecked_layer_holds():
    """Per layer, what the recompute measured against what the allocator holds more after the forward when every
    layer is un-checkpointed (bf16, 4096 tokens, no backward yet). The measure is conservative (it counts the layer
    input, which checkpointing keeps too, and per layer the cos/sin shared by all): it may exceed the held memory by
    a little, never fall short of it."""
    from nbkit.demo.models import tiny_model
    from nbkit.speedups.selective_checkpointing import SelectiveCheckpointing

    tokens, layers = 4096, 4
    model = tiny_model("qwen3", 1024, dtype=torch.bfloat16, seed=0, hidden_size=1024, intermediate_size=3072,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_hidden_layers=layers,
                       attn_implementation="sdpa").cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)  # so every layer's input needs grad
    ids = torch.randint(0, 1024, (1, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def forward() -> tuple[int, torch.Tensor]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(input_ids=ids).logits
        return torch.cuda.memory_allocated() - before, out

    speedup = SelectiveCheckpointing(mode=True, max_tokens=tokens)
    assert speedup.attach(model)
    checkpointed, out = forward()  # step 1: every layer checkpointed
    out.float().sum().backward()  # its recompute: the measure
    del out
    unchecked, out = forward()  # step 2: decided (every layer fits on this GPU)
    del out
    assert speedup.kept == layers
    measured = [layer.saved for layer in speedup.runner.layers]
    speedup.detach()
    actual = (unchecked - checkpointed) / layers
    print(f"per layer: measured {[m / 2**20 for m in measured]} MiB, held {actual / 2**20:.1f} MiB")
    assert all(actual * 0.98 <= m <= actual * 1.3 for m in measured)


def test_the_limit_counts_what_other_processes_hold():
    """The limit never exceeds what the allocator holds plus the device's free memory (the CUDA context alone,
    ~0.5 GiB, is outside the allocator)."""
    from nbkit.memory import memory_readings

    device = torch.device("cuda", torch.cuda.current_device())
    limit, peak, allocated = memory_readings(device)
    free, total = torch.cuda.mem_get_info(device)
    assert peak >= allocated and limit <= torch.cuda.memory_reserved(device) + free < total


def test_the_second_look_trains_as_plain_checkpointing_on_a_4bit_base(tmp_path, monkeypatch):
    """The budget's looks replaced so that the plan keeps the last layer whole and the second look (at micro-batch 3,
    after the first optimizer step) the other 3, every other switch at its default (the call-counting hooks keep the
    layers out of CUDA graphs, so no memory is held back for them): the same training as plain checkpointing."""
    pytest.importorskip("bitsandbytes")
    from nbkit.speedups.layer_budget import Budget, Look
    from nbkit.speedups.layer_runner import LayerRunner

    build = _four_bit(tmp_path / "base")
    plain = _train(tmp_path, "plain", build, False)
    again = _train(tmp_path, "again", build, False)
    looks, runners, at_detach, reserves = [], [], [], []
    real_init, real_detach = LayerRunner.__init__, LayerRunner.detach

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        runners.append(self)

    def detach(self):  # what was decided, read before detach clears it
        if self.layers:
            at_detach.append((self.kept, self.added))
        real_detach(self)

    def reserve(runner):  # what the runner holds back for the checkpointed layers' graphs (cuda_graphs_checkpointed):
        return runner.graphs.recompute_reserve(runner) if runner.graphs is not None else 0  # none here (hooked)

    def first(budget):
        runner = runners[-1]
        c = runner.costs
        looks.append("first")
        reserves.append(reserve(runner))
        # the last layer whole; no room for another's attention
        return Look(c[-1].kept - c[-1].input + reserves[-1], "test")

    def second(budget, scale):
        runner = runners[-1]
        looks.append("second")
        reserves.append(reserve(runner))
        return Look(sum(x.kept - x.input + x.weights for x in runner.costs) + reserves[-1], "test")  # every layer

    monkeypatch.setattr(LayerRunner, "__init__", init)
    monkeypatch.setattr(LayerRunner, "detach", detach)
    monkeypatch.setattr(Budget, "first_look", first)
    monkeypatch.setattr(Budget, "second_look", second)
    fast = _train(tmp_path, "auto", build, "auto")
    layers = SHAPE["num_hidden_layers"]
    noise = max(max_relative(a, b) for a, b in zip(again[1], plain[1]))
    err = max(max_relative(a, b) for a, b in zip(fast[1], plain[1]))
    print(f"losses {plain[0]} vs {fast[0]}; LoRA gradients: plain vs plain {noise:.2e}, two looks vs plain "
          f"{err:.2e}; attached {fast[3].nbkit_attached}; plan {fast[3].nbkit_layer_stats['plan']}")
    assert looks == ["first", "second"] and at_detach[-1] == (layers, layers - 1)
    assert reserves == [0, 0]  # the hooks inside the layers keep them eager: no graphs' memory held back
    assert fast[0] == pytest.approx(plain[0], rel=1e-2)
    assert err <= max(2 * noise, 1e-2)
    assert fast[2] == [2 + 2 + 1] * (layers - 1) + [2 + 1 + 1]  # recomputed until the second look, at micro-batch 3
