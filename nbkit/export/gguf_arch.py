"""Per-family facts a GGUF file needs: llama.cpp's architecture, hyperparameter keys and tensor layout.

What llama.cpp's own converter does for each family, restated from the formats (not its code):
- names: transformers' module names map to GGUF's (``blk.N.attn_q`` ...) through the ``gguf`` package's
  ``TensorNameMap`` for the architecture;
- Llama and Mistral (GGUF architecture ``llama``): q and k projection rows are permuted from transformers'
  rotate-half layout to the interleaved pairs llama.cpp's rope uses (k with the key/value head count);
  Llama 3.1's "llama3" rope scaling becomes a ``rope_freqs`` tensor of per-frequency factors;
- Qwen2 (q/k/v biases) and Qwen3 (q/k RMS norms): tensors as they are;
- Gemma 2 and 3: transformers computes RMS norms as ``x * (1 + w)``, llama.cpp as ``x * w``, so every norm weight
  is stored plus one; embeddings are tied (no ``output`` tensor); Gemma 2's soft-capping and the sliding window go
  in the metadata;
- Qwen2-MoE, Qwen3-MoE (``qwen2moe``, ``qwen3moe``) and Mixtral (``llama`` with experts): the experts stacked
  per layer and the router kept float32 (``nbkit.export.gguf_moe``); Qwen2-MoE's shared expert as it is, its
  one-row gate as a vector;
- every family: 1-D tensors (norms, biases) stay float32; a tied ``lm_head`` is not written.

``Family.reader``: whether transformers' GGUF reader loads the architecture back (it has no llama with experts, so
a Mixtral file is read back by ``nbkit.export.gguf_readback``'s inverse of this module instead).

Not covered (``family_of`` raises, naming it): other architectures; gpt-oss (``GPT_OSS_MISSING`` says what it
lacks); Qwen MoE configs with dense MLP layers; Gemma 3 multimodal checkpoints (vision tower + ``language_model``),
Llama 4.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from .gguf_moe import check_layers, fuse_experts, split_experts, write_moe_hparams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    model_type: str
    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool = False
    norm_shift: float = 0.0  # added to every norm weight
    gemma: bool = False
    moe: bool = False  # experts: nbkit.export.gguf_moe
    reader: bool = True  # transformers' GGUF reader loads this architecture back


FAMILIES = {
    "llama": Family("llama", "LLAMA", permute_qk=True),
    "mistral": Family("mistral", "LLAMA", permute_qk=True),
    "qwen2": Family("qwen2", "QWEN2"),
    "qwen3": Family("qwen3", "QWEN3"),
    "gemma2": Family("gemma2", "GEMMA2", norm_shift=1.0, gemma=True),
    "gemma3_text": Family("gemma3_text", "GEMMA3", norm_shift=1.0, gemma=True),
    "qwen2_moe": Family("qwen2_moe", "QWEN2MOE", moe=True),
    "qwen3_moe": Family("qwen3_moe", "QWEN3MOE", moe=True),
    "mixtral": Family("mixtral", "LLAMA", permute_qk=True, moe=True, reader=False),
}
NOT_COVERED = ("gpt_oss, Gemma 3 multimodal checkpoints, Llama 4, Phi-3, other MoE families (olmoe, deepseek ...), "
               "and every architecture not in FAMILIES")
GPT_OSS_MISSING = ("llama.cpp's gpt-oss architecture needs what this exporter does not write: the attention sinks "
                   "(attn_sinks), biases on the router and on every expert, gate and up de-interleaved from "
                   "gate_up_proj and transposed, the experts in MXFP4 as llama.cpp's converter stores them, and YaRN "
                   "and sliding-window metadata; and transformers' GGUF reader does not load llama.cpp's gpt-oss "
                   "expert tensors, so such a file could not be checked here. Convert the merged folder with "
                   "llama.cpp's convert_hf_to_gguf.py")


def family_of(config: Any) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type == "gpt_oss":
        raise NotImplementedError(f"GGUF export of gpt_oss is not covered: {GPT_OSS_MISSING}")
    if model_type not in FAMILIES:
        raise NotImplementedError(f"GGUF export covers {', '.join(FAMILIES)}; not {model_type!r} ({NOT_COVERED})")
    family = FAMILIES[model_type]
    if family.moe:
        check_layers(config)
    return family


def head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _rope(config: Any) -> tuple[dict, dict | None]:
    """(full-attention rope parameters, sliding-attention ones or None), in transformers 5's ``rope_parameters``."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {}) or None
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"] = config.rope_theta
    return params, None


def write_hparams(writer: Any, config: Any, family: Family) -> list[str]:
    """Write the architecture's hyperparameters; returns warnings about what llama.cpp will read differently."""
    import gguf

    notes: list[str] = []
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    dim = head_dim(config)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    rope, local = _rope(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if family.arch == "LLAMA":
        writer.add_vocab_size(int(config.vocab_size))
        writer.add_rope_dimension_count(dim)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in ("default", "llama3"):
        raise NotImplementedError(f"rope scaling {kind!r} has no GGUF form here")
    if family.gemma:
        window = getattr(config, "sliding_window", None)
        if window:
            writer.add_sliding_window(int(window))
        scalar = getattr(config, "query_pre_attn_scalar", None)
        if scalar is not None and int(scalar) != dim:
            notes.append(f"query_pre_attn_scalar={scalar} differs from head_dim={dim}: llama.cpp scales attention "
                         "by head_dim (except for its 27B models)")
    if family.arch == "GEMMA2":
        for name, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                          ("final_logit_softcapping", writer.add_final_logit_softcapping)):
            if getattr(config, name, None) is not None:
                add(float(getattr(config, name)))
    if family.arch == "GEMMA3":
        if local and local.get("rope_theta") is not None:
            writer.add_rope_freq_base_swa(float(local["rope_theta"]))
        types = list(getattr(config, "layer_types", None) or [])
        expected = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(len(types))]
        if types and types != expected:
            notes.append("layer_types differ from Gemma 3's five sliding layers then one full, which llama.cpp assumes")
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
            notes.append("Gemma 3 with soft-capping: llama.cpp's gemma3 applies none")
    if family.model_type == "mistral" and getattr(config, "sliding_window", None):
        notes.append(f"Mistral's sliding window ({config.sliding_window}) has no place in the llama architecture: "
                     "llama.cpp attends to the whole context")
    if family.moe:
        notes += write_moe_hparams(writer, config)
    return notes


def llama3_rope_factors(config: Any) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs`` for "llama3" rope scaling: per rotary frequency, the factor its period is divided
    by (1 for short periods, ``factor`` for long ones, a smooth blend between), as Llama 3.1 defines it."""
    rope, _ = _rope(config)
    if (rope.get("rope_type") or rope.get("type")) != "llama3":
        return None
    dim = head_dim(config)
    freqs = 1.0 / (float(rope.get("rope_theta", 10000.0)) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))
    return out.astype(np.float32)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from (half, half) rotate-half order to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: Iterator[tuple[str, np.ndarray]], config: Any,
                 family: Family) -> Iterator[tuple[str | None, str, np.ndarray]]:
    """(the loaded model's parameter name or None, GGUF name, float32 array) for each tensor, transformed for
    llama.cpp."""
    import gguf

    arch = getattr(gguf.MODEL_ARCH, family.arch)
    names = gguf.get_tensor_name_map(arch, int(config.num_hidden_layers))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    factors = llama3_rope_factors(config)
    if factors is not None:
        yield None, gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors
    if family.moe:
        state = fuse_experts(state, config)
    for name, data in state:
        if name.endswith(("rotary_emb.inv_freq", "attention.masked_bias")):
            continue
        if tied and name == "lm_head.weight":
            continue
        experts = split_experts(name, data, config) if family.moe else None
        if experts is not None:
            yield from ((name, out, part) for out, part in experts)
            continue
        stem, dot, suffix = name.rpartition(".")
        mapped = names.get_name(stem) if suffix in ("weight", "bias") else None
        if mapped is None:
            raise ValueError(f"no GGUF name for tensor {name!r} in architecture {family.arch.lower()}")
        out = f"{mapped}.{suffix}"
        if family.permute_qk and mapped.endswith(".attn_q"):
            data = _permute(data, heads)
        elif family.permute_qk and mapped.endswith(".attn_k"):
            data = _permute(data, kv_heads)
        if family.norm_shift and name.endswith("norm.weight"):
            data = data + np.float32(family.norm_shift)
        if mapped.endswith(".ffn_gate_inp_shexp"):  # (1, hidden) in transformers, a vector in llama.cpp
            data = data.reshape(-1)
        yield name, out, data
