"""The dense copy of a model the dense decoder reads: each projection's weight dequantized, its active LoRA adapters
merged in float32 and rounded once to the compute dtype, q/k/v fused into one matrix and gate/up into another.

Contract: ``DenseWeights(model)`` never modifies ``model``; it raises ``Unsupported`` for what it cannot copy
(adapters other than LoRA, DoRA and other LoRA variants, ``lora_bias``, ``fan_in_fan_out`` weights, embeddings
that are not a plain ``nn.Embedding``, an lm_head with a bias). ``dense_bytes`` sizes the copy without making it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model_parts import unwrap_model
from .shared import Unsupported, text_config


@dataclass
class _Layer:
    """One decoder layer's dense weights (``[out, in]``, compute dtype) and norm weights."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    wgu: torch.Tensor
    bgu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: the per-head norms of queries and keys
    k_norm: torch.Tensor | None


def _dense(module: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``module``'s effective weight and bias as a dense ``dtype`` tensor: 4-bit/8-bit weights dequantized, active
    LoRA adapters that are not merged yet added in float32."""
    from ..trl_seam import BaseTunerLayer, LoraLayer, dequantize_module_weight

    base, deltas = module, []
    if isinstance(module, BaseTunerLayer):
        if not isinstance(module, LoraLayer):
            raise Unsupported(f"adapters of kind {type(module).__name__} (only LoRA is merged)")
        base = module.get_base_layer()
        if not module.disable_adapters:
            for name in module.active_adapters:
                if name not in module.lora_A or name in module.merged_adapters:
                    continue
                if getattr(module, "lora_variant", {}).get(name) is not None:
                    raise Unsupported(f"LoRA variant {type(module.lora_variant[name]).__name__} (DoRA, ...)")
                if getattr(module, "lora_bias", {}).get(name):
                    raise Unsupported("LoRA adapters with lora_bias")
                deltas.append(name)
    if getattr(base, "fan_in_fan_out", False):
        raise Unsupported("fan_in_fan_out weights")
    weight = dequantize_module_weight(base)
    if weight.dim() != 2:
        raise Unsupported(f"a {type(base).__name__} weight of shape {tuple(weight.shape)}")
    if deltas:
        weight = weight.to(torch.float32, copy=True)  # the model's weight is not touched
        for name in deltas:
            weight += module.get_delta_weight(name).float()
    bias = getattr(base, "bias", None)
    return weight.detach().to(dtype), (None if bias is None else bias.detach().to(dtype))


def _fused(parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([w for w, _ in parts])
    if all(b is None for _, b in parts):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _compute_dtype(base: torch.nn.Module) -> torch.dtype:
    for module in base.modules():
        dtype = getattr(module, "compute_dtype", None)  # bitsandbytes' 4-bit layers
        if isinstance(dtype, torch.dtype):
            return dtype
    return base.get_input_embeddings().weight.dtype


class DenseWeights:
    """The dense, merged, fused weights of a supported model, and what a step needs to know of its shape."""

    def __init__(self, model: torch.nn.Module) -> None:
        base = unwrap_model(model)
        config = text_config(base)
        inner = base.model
        self.dtype = _compute_dtype(base)
        embed = base.get_input_embeddings()
        if type(embed) is not torch.nn.Embedding:
            raise Unsupported(f"input embeddings of type {type(embed).__name__}")
        self.embed = embed.weight.detach().to(self.dtype)
        self.lm_head, lm_bias = _dense(base.get_output_embeddings(), self.dtype)
        if lm_bias is not None:
            raise Unsupported("an lm_head with a bias")
        self.final_norm, self.eps = inner.norm.weight.detach().to(self.dtype), _eps(inner.norm)
        self.rotary = inner.rotary_emb
        first = inner.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.scaling = float(first.scaling)
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _fused([_dense(attn.q_proj, self.dtype), _dense(attn.k_proj, self.dtype),
                          _dense(attn.v_proj, self.dtype)])
            gu = _fused([_dense(mlp.gate_proj, self.dtype), _dense(mlp.up_proj, self.dtype)])
            wo, bo = _dense(attn.o_proj, self.dtype)
            wd, bd = _dense(mlp.down_proj, self.dtype)
            q_norm = k_norm = None
            if hasattr(attn, "q_norm"):
                q_norm, k_norm = (attn.q_norm.weight.detach().to(self.dtype),
                                  attn.k_norm.weight.detach().to(self.dtype))
            self.layers.append(_Layer(layer.input_layernorm.weight.detach().to(self.dtype),
                                      layer.post_attention_layernorm.weight.detach().to(self.dtype),
                                      qkv[0], qkv[1], wo, bo, gu[0], gu[1], wd, bd, q_norm, k_norm))
        self.intermediate = self.layers[0].wgu.shape[0] // 2
        self.nbytes = sum(t.numel() * t.element_size() for layer in self.layers for t in vars(layer).values()
                          if isinstance(t, torch.Tensor))
        if self.lm_head.data_ptr() != base.get_output_embeddings().weight.data_ptr():
            self.nbytes += self.lm_head.numel() * self.lm_head.element_size()


def dense_bytes(model: torch.nn.Module) -> int:
    """The bytes a dense copy of ``model``'s decoder-layer projections takes in its compute dtype (nothing is made)."""
    base = unwrap_model(model)
    size = torch.tensor([], dtype=_compute_dtype(base)).element_size()
    names = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
             ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
    total = 0
    for layer in base.model.layers:
        for part, name in names:
            module = getattr(getattr(layer, part), name)
            module = module.get_base_layer() if hasattr(module, "get_base_layer") else module
            total += int(module.in_features) * int(module.out_features)
    return total * size


