"""A written GGUF file loaded back as a transformers model, for ``export_gguf``'s logit round trip.

Why: the round trip proves the file by running it. transformers' own GGUF reader is the independent reader, and
it is used wherever it has the architecture. It has no llama with experts (its llama reader builds a dense
``LlamaForCausalLM``, and it cannot map the in-memory Mixtral model's names), so a Mixtral file is read here: every
tensor dequantized with the ``gguf`` package, put back in transformers' layout by the inverse of
``nbkit.export.gguf_arch`` (q/k rows from llama.cpp's interleaved rope pairs back to rotate-half, norms shifted
back, stacked experts fused again into ``gate_up_proj``), and loaded into the model built from the source config
with every parameter required and every file tensor used. This inverse is itself checked against transformers'
reader on the architectures both read (tests/test_export_moe.py), so the parts of a Mixtral file it relies on (llama's
permuted q/k, the stacked experts of qwen3moe) are each proved by an independent reader there.

Contract: ``load_back(path, reader_config, source_config)`` returns (which reader, the float32 model); for an MoE
family it first checks the file's expert metadata (``gguf_moe.check_metadata``). ``read_with_nbkit(path, config)``
is the inverse reader on its own; it raises ``ExportCheckError`` for a missing, extra or misshapen tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .compare import ExportCheckError
from .gguf_arch import family_of


def load_back(path: Path, reader_config: Any, source_config: Any) -> tuple[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    family = family_of(source_config)
    if family.moe:
        from .gguf_moe import check_metadata

        check_metadata(path, source_config)
    if family.reader:
        return "transformers", AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, config=reader_config, dtype=torch.float32)
    return "nbkit (transformers' reader has no such architecture)", read_with_nbkit(path, source_config)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from interleaved pairs back to (half, half) rotate-half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_with_nbkit(path: Path, config: Any) -> torch.nn.Module:
    """The GGUF file at ``path`` as a float32 transformers model of ``config`` (module docstring)."""
    import gguf
    from transformers import AutoModelForCausalLM

    from .gguf_moe import FUSED

    family = family_of(config)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, family.arch), int(config.num_hidden_layers))
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    tied = bool(getattr(config, "tie_word_embeddings", False))

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise ExportCheckError(f"{path.name} has no tensor {name}")
        t = tensors.pop(name)
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = model.state_dict()
    state = {}
    for hf_name, param in params.items():
        if tied and hf_name == "lm_head.weight":
            continue
        m = FUSED.match(hf_name)
        if m is not None:
            bid = m["bid"]
            if m["w"] == "gate_up_proj":
                data = np.concatenate([take(f"blk.{bid}.ffn_gate_exps.weight"), take(f"blk.{bid}.ffn_up_exps.weight")],
                                      axis=1)
            else:
                data = take(f"blk.{bid}.ffn_down_exps.weight")
        else:
            stem, _, suffix = hf_name.rpartition(".")
            mapped = names.get_name(stem)
            if mapped is None:
                raise ExportCheckError(f"no GGUF name for parameter {hf_name!r}")
            data = take(f"{mapped}.{suffix}")
            if family.permute_qk and mapped.endswith(".attn_q"):
                data = _unpermute(data, heads)
            elif family.permute_qk and mapped.endswith(".attn_k"):
                data = _unpermute(data, kv_heads)
            if family.norm_shift and hf_name.endswith("norm.weight"):
                data = data - np.float32(family.norm_shift)
            if mapped.endswith(".ffn_gate_inp_shexp"):
                data = data.reshape(param.shape)
        if tuple(data.shape) != tuple(param.shape):
            raise ExportCheckError(f"{hf_name}: the file holds {tuple(data.shape)}, the model {tuple(param.shape)}")
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(data))
    tensors.pop(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", None)  # computed from the config
    if tensors:
        raise ExportCheckError(f"{path.name} holds tensors the model has no place for: {', '.join(sorted(tensors))}")
    if tied and "lm_head.weight" in params:
        state["lm_head.weight"] = state[next(k for k in state if k.endswith("embed_tokens.weight"))]
    model.load_state_dict(state, strict=True)
    return model.eval()
