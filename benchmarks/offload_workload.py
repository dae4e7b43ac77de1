"""The offload benchmarks' workload: a random-weight QLoRA Qwen3, one padding-free packed row, the loss, the configs.

Shared by the side-by-side (``benchmarks.offload``) and the longest-row search (``benchmarks.offload_longest``), so
both measure the same model, batch and loss. Contract: ``build_qlora`` returns a PEFT model in train mode whose
decoder Linears are bitsandbytes nf4 (double quant, bf16 compute) with LoRA r=16 on all 7 projections;
``packed_batch`` is what TRL's padding-free collator hands the model; ``set_config`` puts the model in one of the
checkpointing configs and returns the ``OffloadedCheckpointing`` to detach afterwards (nbkit configs only).
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nbkit.speedups.offload import OffloadedCheckpointing

COMMON = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=False, head_dim=128)
SHAPES = {
    "8b": dict(COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8),
    "14b": dict(COMMON, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=8),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CPU_SKIP = "skipped on CPU (save_on_cpu pins host memory, which needs CUDA)"


# ------------------------------------------------------------------------------------------------------- the model
def _nf4(lin: nn.Linear) -> nn.Module:
    """bitsandbytes nf4 (double quant, bf16 compute) copy of ``lin``, quantized where its weight lives."""
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                          compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                 module=q).to(lin.weight.device)
    if lin.bias is not None:
        q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
    return q


def build_qlora(shape: str, layers: int, device: str, seed: int = 0,
                overrides: Optional[dict] = None) -> tuple[nn.Module, nn.Module, float]:
    """Random-weight QLoRA model: built in bf16 on ``device``, each decoder Linear swapped for nf4 layer by layer.

    Returns (peft_model, causal_lm, seconds). Building in bf16 first needs the bf16 size transiently (~30 GB for 14B,
    fine on an H200); quantizing is one kernel per Linear.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    t0 = time.perf_counter()
    cfg = dict(SHAPES[shape], **(overrides or {}))
    if layers:
        cfg["num_hidden_layers"] = layers
    config = Qwen3Config(**cfg, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        causal = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for layer in causal.model.layers:
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, nn.Linear):
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent), attr, _nf4(mod))
    causal.requires_grad_(False)
    causal.is_loaded_in_4bit = True  # PEFT then wraps the Linear4bit layers with its bnb LoRA layers
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(causal, lora)
    model.train()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return model, causal, time.perf_counter() - t0


def attach_attention(model: nn.Module, requested: str) -> tuple[Any, str]:
    """nbkit's packed attention when available (and not overridden), else plain "sdpa" (dense block mask)."""
    if requested in ("auto", "nbkit"):
        try:
            from nbkit.speedups.packed_attention import PackedAttention
        except ImportError as err:
            if requested == "nbkit":
                raise
            return None, f"sdpa (dense block mask; nbkit.speedups.packed_attention unavailable: {err})"
        packed = PackedAttention("auto")
        if packed.attach(model):
            return packed, f"nbkit ({packed.kernel} kernel)"
    return None, "sdpa (dense T x T block mask: O(T^2) time and memory)"


# ------------------------------------------------------------------------------------------------------- the batch
def packed_batch(tokens: int, vocab: int, device: str, seed: int = 0, mean_len: int = 400, spread: int = 100) -> dict:
    """One padding-free row like TRL's collator: documents of ~400 tokens, labels -100 at each document start."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(mean_len - spread, mean_len + spread), tokens - sum(lengths)))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (1, tokens), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[pos == 0] = -100
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    return dict(input_ids=ids.to(device), labels=labels.to(device), position_ids=pos.to(device),
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
                nbkit_cu_seqlens_host=tuple(offsets))


def _ce_sum(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100, reduction="sum")


def loss_fn(causal: nn.Module, batch: dict, chunk: int = 4096) -> torch.Tensor:
    """Next-token loss; the LM head + CE in checkpointed chunks (never the full T x vocab logits)."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = causal.model(**kwargs, use_cache=False).last_hidden_state[0, :-1]
    target = batch["labels"][0, 1:]
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(_ce_sum, hidden[s:s + chunk], target[s:s + chunk], causal.lm_head.weight,
                                   use_reentrant=False)
    return total / (target != -100).sum()


# ------------------------------------------------------------------------------------------------------ the configs
def set_config(model: nn.Module, causal: nn.Module, name: str) -> Optional[OffloadedCheckpointing]:
    """Put the model in one config; returns the OffloadedCheckpointing to detach afterwards (nbkit configs)."""
    if name == "no_ckpt":
        causal.gradient_checkpointing_disable()
        return None
    offload = {"offload": True} if name == "ckpt_offload" else {}  # transformers 5.17 on; a TypeError before
    causal.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **offload)
    if name.startswith("nbkit"):
        oc = OffloadedCheckpointing(mode=True, double_buffer=name == "nbkit_double")
        if not oc.attach(model):
            raise RuntimeError("OffloadedCheckpointing.attach returned False")
        return oc
    return None


def is_oom(err: BaseException) -> bool:
    """torch's OOM, or a library (cuBLAS, bitsandbytes) failing to allocate at the memory edge."""
    text = str(err)
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def cleanup(model: nn.Module) -> None:
    for p in trainable(model):
        p.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
