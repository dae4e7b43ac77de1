"""A small demo-like FastSFT run that records, per rank, what tests/test_distributed.py checks.

Same global batch, three ways (``--cpu``: every rank on the CPU, gloo; leave it out on GPUs)::

    python tests/dist_train.py --out DIR --batch 4 --cpu                              # 1 process x 4 rows
    accelerate launch --multi_gpu --num_processes 2 tests/dist_train.py --out DIR --batch 2 --cpu   # 2 x 2 rows
    accelerate launch --multi_gpu --num_processes 2 tests/dist_train.py --out DIR --batch 2 --cpu --fsdp2-direct

(``--multi_gpu`` is only accelerate's name for "start N processes with torchrun", as is the DDP config file of
docs/multi_gpu.md, which the test passes instead: with ``--cpu`` each process trains on the CPU over gloo.
``accelerate launch --cpu --num_processes 2`` starts one process unless an MPI hostfile is given.) A notebook runs
the same ``main`` through ``accelerate.notebook_launcher``. ``--fsdp`` (or the FSDP2 config file) shards through
the Trainer on GPUs only; ``--fsdp-plugin`` just records the FSDP plugin accelerate builds from the launch config.

The trainer run: nbkit's tiny ``--family`` model (default qwen3_moe, so all three speedups have something to do)
with the demo tokenizer, LoRA r=8 on every linear projection, packed conversational demo data with assistant-only
loss, gradient checkpointing with nbkit's offload forced on (``offload_checkpointing=True`` runs on CPUs too).
Settings that would make 1 and 2 processes differ for reasons that are not bugs are pinned: fp32 (TRL defaults
to bf16, i.e. CPU autocast), LoRA dropout 0 (a rank-dependent RNG), LoRA A drawn from a seeded RNG (PEFT uses the
global one), constant learning rate, MoE load-balancing loss off (TRL's aux loss is a per-rank mean).

Every rank attaches the dashboard (text mode, into a buffer) as ``FastSFT`` does in a notebook. Each rank writes
``DIR/<run>-rank<r>.json`` (what it saw and logged, and what its dashboard showed) and ``DIR/<run>-rank<r>.pt``
(trainable weights after training, or the gradients for ``fsdp2``). Runs: ``main``; with ``--control`` also ``noavg``
(``average_tokens_across_devices=False``: each rank divides by its own token count, which must differ);
``fsdp2`` with ``--fsdp2-direct``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

# Nothing here imports transformers / TRL / PEFT at module level: they import bitsandbytes, and
# accelerate.notebook_launcher refuses to fork a parent that has imported it.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, required=True, help="per-device packed rows per step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--max-length", type=int, default=96)
    p.add_argument("--cpu", action="store_true", help="train on the CPU (gloo when distributed)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU runs); default fp32")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 through TrainingArguments (GPUs; ignored on CPU)")
    p.add_argument("--fsdp2-direct", action="store_true", help="torch fully_shard + nbkit speedups, no Trainer")
    p.add_argument("--attach-after-shard", action="store_true", help="fsdp2-direct: attach all after fully_shard")
    p.add_argument("--fsdp-plugin", action="store_true", help="only record the FSDP plugin accelerate builds here")
    p.add_argument("--control", action="store_true", help="also run with average_tokens_across_devices=False")
    p.add_argument("--plain", action="store_true", help="TRL's SFTTrainer instead of FastSFT")
    return p.parse_args(argv)


class Recorder:
    """What one rank's training forwards ran on: the batch, the packed metadata, the experts implementation.

    ``attach`` goes after nbkit's speedups: its decoder pre-hook then runs after ``PackedAttention``'s and finds, in
    ``packed`` (that speedup, None without it), the ``PackedRun`` (metadata + kernel) every layer of that forward reads.
    """

    def __init__(self) -> None:
        self.forwards: list[dict[str, Any]] = []
        self.expert_calls: dict[str, int] = {}  # implementation -> experts calls in training forwards
        self._hooks: list = []
        self._packed: Any = None

    def attach(self, model: torch.nn.Module, packed: Any = None) -> None:
        from nbkit.model_parts import unwrap_model

        self._packed = packed
        base = unwrap_model(model)
        self._hooks = [base.get_decoder().register_forward_pre_hook(self._see, with_kwargs=True)]
        for m in base.modules():
            if hasattr(m, "num_experts") and hasattr(m, "down_proj") and hasattr(m, "config"):
                self._hooks.append(m.register_forward_pre_hook(self._see_experts))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._packed = None

    def _see(self, module, args, kwargs):
        if module.training:
            run = self._packed.run_for(kwargs) if self._packed is not None else None
            ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
            self.forwards.append({
                "input_ids": ids.reshape(-1).tolist(),
                "starts": (pos.reshape(-1) == 0).nonzero().flatten().tolist() if pos is not None else None,
                "cu_seqlens": list(run.host_offsets) if run is not None and run.host_offsets else None,
            })

    def _see_experts(self, module, args):
        impl = module.config._experts_implementation
        plan = getattr(module, "_nbkit_moe_plan", None)
        key = f"{impl}({plan.backend})" if impl == "nbkit" and plan is not None else str(impl)
        self.expert_calls[key] = self.expert_calls.get(key, 0) + 1


def speedup_report(speedups: list) -> list[dict[str, Any]]:
    """Name, kernel and counters of each attached speedup (what ran on this rank). The decoder layers' runner
    stands for its modes (the offload among them), each reported by its own switch name."""
    from nbkit.speedups import LAYERS

    report = []
    for s in (mode for one in speedups for mode in (one.modes if one.name == LAYERS else [one])):
        info: dict[str, Any] = {"name": s.name, "kernel": getattr(s, "kernel", None)}
        for attr in ("forwards", "metadata_builds", "plain_forwards"):
            if hasattr(s, attr):
                info[attr] = getattr(s, attr)
        if hasattr(s, "stats_dict"):
            info["stats"] = s.stats_dict()
        report.append(info)
    return report


def dashboard_record(summary: Any) -> dict[str, Any] | None:
    """What rank 0's dashboard showed at the end (None on the other ranks: they show nothing)."""
    if summary is None:
        return None
    return {"step": summary.step, "tokens": summary.tokens, "tokens_per_s_mean": summary.tokens_per_s_mean,
            "world_size": summary.world_size, "ranks": [r.as_dict() for r in summary.ranks]}


def tiny_lora_model(family: str, tokenizer):
    from peft import LoraConfig, get_peft_model

    from nbkit.demo.models import tiny_model

    model = tiny_model(family, len(tokenizer), seed=0, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model.config.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # PEFT draws LoRA A from the global RNG; DDP would only align ranks with rank 0
        return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                                task_type="CAUSAL_LM"))


def train_once(opts: argparse.Namespace, run: str, **config_overrides: Any) -> None:
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from nbkit import FastSFT, FastSFTConfig
    from nbkit.dashboard import attach_dashboard
    from nbkit.demo.data import make_dataset
    from nbkit.demo.models import MOE_FAMILIES
    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.distributed import RankMemoryCallback

    out = Path(opts.out)
    fsdp = dict(fsdp=True, fsdp_config={"fsdp_version": 2, "reshard_after_forward": True}) if opts.fsdp else {}
    # The config first: it sets up this process's rank and device (a notebook's training function should too).
    config = FastSFTConfig(
        output_dir=str(out / f"trainer-{run}"), max_steps=opts.steps, per_device_train_batch_size=opts.batch,
        learning_rate=3e-3, lr_scheduler_type="constant", weight_decay=0.0,
        packing=True, max_length=opts.max_length, assistant_only_loss=True,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        offload_checkpointing=True, fast_moe_routing=True, cached_packing=True, live_dashboard=False,
        router_aux_loss_coef=0.0 if opts.family in MOE_FAMILIES else None,
        bf16=opts.bf16, use_cpu=opts.cpu, seed=0, dataloader_num_workers=0,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        **fsdp, **config_overrides,
    )
    tokenizer = load_demo_tokenizer()
    # on the rank's device before the trainer sees it, as nbkit.load_model does (FSDP would move it only at train())
    model = tiny_lora_model(opts.family, tokenizer).to(config.device)
    dataset = make_dataset("messages", n=160, split="train", seed=0)
    trainer = (SFTTrainer if opts.plain else FastSFT)(model=model, args=config, train_dataset=dataset,
                                                       processing_class=tokenizer)
    # the dashboard as FastSFT attaches it in a notebook, on every rank; text into a buffer, a line per render.
    # On 2 processes it brings the RankMemoryCallback this script records; on 1 there is none, so add one.
    board_text = io.StringIO()
    board = attach_dashboard(trainer, mode="text", stream=board_text, min_interval=0.0, text_interval=0.0)
    from_dashboard = board.rank_memory is not None
    recorder, memory = Recorder(), board.rank_memory or RankMemoryCallback()
    seen: dict[str, Any] = {}

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            packed = next((s for s in getattr(trainer, "_speedups", []) if s.name == "cached_packing"), None)
            recorder.attach(trainer.model, packed)

        def on_train_end(self, args, state, control, **kwargs):
            # still inside train(): the speedups are attached and their counters say what ran on this rank
            seen["speedups"] = speedup_report(getattr(trainer, "_speedups", []))
            recorder.detach()

    if not from_dashboard:
        trainer.add_callback(memory)
    trainer.add_callback(Record())
    trainer.train()

    state = trainer.accelerator.state
    rank = state.process_index
    record = {
        "run": run, "rank": rank, "world_size": state.num_processes, "distributed_type": str(state.distributed_type),
        "backend": state.backend, "device": str(trainer.args.device), "wrapper": type(trainer.model_wrapped).__name__,
        "family": opts.family, "moe": opts.family in MOE_FAMILIES,
        "average_tokens_across_devices": trainer.args.average_tokens_across_devices,
        "attached": getattr(trainer, "nbkit_attached", []), "speedups": seen.get("speedups", []),
        "expert_calls": recorder.expert_calls, "forwards": recorder.forwards,
        "log_history": trainer.state.log_history,
        "rank_memory": [m.as_dict() for m in memory.latest],
        "rank_memory_gathers": memory.gathers,
        "rank_memory_from_dashboard": from_dashboard,
        "rank_memory_callbacks": sum(isinstance(c, RankMemoryCallback) for c in trainer.callback_handler.callbacks),
        "dashboard": dashboard_record(board.summary), "dashboard_text": board_text.getvalue(),
        "pid": os.getpid(),
    }
    (out / f"{run}-rank{rank}.json").write_text(json.dumps(record))
    weights = {}
    for name, p in trainer.model.named_parameters():  # every rank, same order: full_tensor() is a collective
        if p.requires_grad:
            p = p.detach()
            weights[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).float().cpu().clone()
    torch.save(weights, out / f"{run}-rank{rank}.pt")


def _packed_batches(tokenizer, world: int, docs_per_rank: int) -> list[dict[str, Any]]:
    """One packed, padding-free batch per rank from the demo data, through TRL's collator and nbkit's."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from nbkit.demo.data import make_dataset
    from nbkit.speedups.packed_attention import PackedCollator

    docs = [tokenizer.apply_chat_template(ex["messages"], tokenize=True, return_dict=True)["input_ids"]
            for ex in make_dataset("messages", n=world * docs_per_rank, split="train", seed=0)]
    collate = PackedCollator(DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True))
    return [collate([{"input_ids": d} for d in docs[r * docs_per_rank:(r + 1) * docs_per_rank]]) for r in range(world)]


def fsdp2_direct(opts: argparse.Namespace) -> None:
    """nbkit's three speedups on a model sharded by torch's FSDP2 ``fully_shard``, against the unsharded plain model.

    accelerate 1.15 shards only on accelerators (with ``use_cpu`` its FSDP plugin is ignored and the Trainer runs
    DDP), so on CPUs this drives FSDP2 itself, in the order FastSFT + accelerate use on GPUs: packed attention and
    MoE routing attach to the unsharded model (``train()`` start), ``fully_shard`` per decoder layer and at the root
    (``accelerator.prepare``), offloaded checkpointing last (``on_train_begin``). Each rank runs its own packed
    batch; FSDP2 averages the gradients, so they must equal the mean of the plain model's per-batch gradients.
    """
    import copy

    from accelerate import PartialState
    from torch.distributed.fsdp import fully_shard

    from nbkit.demo.tokenizer import load_demo_tokenizer
    from nbkit.speedups.moe import FastMoERouting
    from nbkit.speedups.offload import OffloadedCheckpointing
    from nbkit.speedups.packed_attention import PackedAttention

    state = PartialState(cpu=opts.cpu)
    rank, world = state.process_index, state.num_processes
    device = state.device
    tokenizer = load_demo_tokenizer()
    model = tiny_lora_model(opts.family, tokenizer).to(device)
    with torch.no_grad():  # B = 0 at init keeps the adapters out of the forward: give them values
        gen = torch.Generator().manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    reference = copy.deepcopy(model)  # unsharded: transformers' attention and experts, plain checkpointing
    batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()}
               for b in _packed_batches(tokenizer, world, opts.batch * 4)]

    packed, moe, offload = PackedAttention(), FastMoERouting(), OffloadedCheckpointing(mode=True)
    attached = [] if opts.attach_after_shard else [s for s in (packed, moe) if s.attach(model)]
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    if opts.attach_after_shard:  # what FastSFT would do if it attached everything at on_train_begin
        attached = [s for s in (packed, moe) if s.attach(model)]
    if offload.attach(model):
        attached.append(offload)
    recorder = Recorder()
    recorder.attach(model, packed if packed in attached else None)
    loss = model(**batches[rank]).loss
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n] = g.detach().float().cpu().clone()
    record = {
        "run": "fsdp2", "rank": rank, "world_size": world, "backend": state.backend,
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "attached": [s.name for s in attached], "speedups": speedup_report(attached),
        "expert_calls": recorder.expert_calls, "forwards": recorder.forwards, "loss": loss.item(),
    }
    recorder.detach()
    for s in reversed(attached):
        s.detach()

    ref_losses = []
    for b in batches:
        ref_loss = reference(**b).loss
        (ref_loss / world).backward()
        ref_losses.append(ref_loss.item())
    record["ref_losses"] = ref_losses
    ref_grads = {n: p.grad.detach().float().cpu().clone() for n, p in reference.named_parameters()
                 if p.requires_grad and p.grad is not None}
    out = Path(opts.out)
    (out / f"fsdp2-rank{rank}.json").write_text(json.dumps(record))
    torch.save({"grads": grads, "ref_grads": ref_grads}, out / f"fsdp2-rank{rank}.pt")


def fsdp_plugin(opts: argparse.Namespace) -> None:
    """What accelerate makes of the launch config in this process: the FSDP plugin a GPU run's Trainer would use."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    rank = int(os.environ.get("RANK", "0"))
    record: dict[str, Any] = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                              "use_fsdp": os.environ.get("ACCELERATE_USE_FSDP")}
    if record["use_fsdp"] == "true":
        plugin = FullyShardedDataParallelPlugin()
        record.update(
            fsdp_version=plugin.fsdp_version, reshard_after_forward=plugin.reshard_after_forward,
            auto_wrap_policy=getattr(plugin.auto_wrap_policy, "__name__", str(plugin.auto_wrap_policy)),
            state_dict_type=str(plugin.state_dict_type), activation_checkpointing=plugin.activation_checkpointing,
            cpu_ram_efficient_loading=plugin.cpu_ram_efficient_loading,
            offload_params=type(plugin.cpu_offload).__name__,
        )
    (Path(opts.out) / f"plugin-rank{rank}.json").write_text(json.dumps(record))


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    if opts.fsdp_plugin:
        fsdp_plugin(opts)
        return
    if opts.fsdp2_direct:
        fsdp2_direct(opts)
        return
    train_once(opts, "main")
    if opts.control:
        train_once(opts, "noavg", average_tokens_across_devices=False)


if __name__ == "__main__":
    main()
