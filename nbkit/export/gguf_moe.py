"""Mixture-of-experts layers in GGUF: llama.cpp's stacked expert tensors, its router and its expert metadata.

Why a module of its own: one set of expert weights has three layouts. A checkpoint saves one Linear per expert
(``mlp.experts.3.up_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w3.weight``, w1 the gate, w3 up, w2
down); transformers 5 holds them fused per layer (``mlp.experts.gate_up_proj``, (n_expert, 2 * n_ff, hidden), the
gate's rows first, and ``mlp.experts.down_proj``, (n_expert, hidden, n_ff)) and converts between the two when it
loads and saves; llama.cpp wants three stacked tensors per layer, ``ffn_gate_exps`` / ``ffn_up_exps``
(n_expert, n_ff, hidden) and ``ffn_down_exps`` (n_expert, hidden, n_ff) in numpy order (ggml's ``ne`` is the
reverse), and the router as ``ffn_gate_inp`` (n_expert, hidden), kept float32 as llama.cpp's converter and quantizer
keep it.

Contract:
- ``fuse_experts(state, config)``: the saved tensors, per-expert weights stacked into transformers' fused in-memory
  parameters and Mixtral's ``block_sparse_moe`` renamed ``mlp``, so every name it yields is a parameter of the
  loaded model (what ``export_gguf``'s round trip rounds as stored); a checkpoint already fused passes through;
  experts missing at the end raise ``ValueError``;
- ``split_experts(name, data, config)``: a fused parameter as its GGUF tensors (None for any other name), its
  shape checked against the config;
- ``write_moe_hparams`` writes what llama.cpp's converter writes (expert count, experts per token, the expert and
  shared-expert sizes for the Qwen families) and returns notes where llama.cpp computes otherwise (its qwen3moe and
  llama routers renormalize the chosen experts' weights, its qwen2moe does not; Mixtral's sliding window);
- ``check_layers`` refuses Qwen MoE configs with dense MLP layers (llama.cpp puts experts in every layer);
- ``check_metadata`` reads the written file's expert keys back and raises ``ExportCheckError`` where they differ
  from the config (transformers' reader would silently take the model's values in their place);
- ``keeps_f32(gguf_name)``: whether a tensor stays float32 whatever the requested type (the routers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np


@dataclass(frozen=True)
class ExpertLayout:
    count_key: str  # config attribute: number of experts
    ff_key: str  # config attribute: one expert's intermediate size
    shared: bool = False  # a shared expert beside the routed ones (qwen2_moe)
    llama_cpp_normalizes: bool = True  # llama.cpp renormalizes the top-k routing weights for this architecture


LAYOUTS = {
    "qwen3_moe": ExpertLayout("num_experts", "moe_intermediate_size"),
    "qwen2_moe": ExpertLayout("num_experts", "moe_intermediate_size", shared=True, llama_cpp_normalizes=False),
    "mixtral": ExpertLayout("num_local_experts", "intermediate_size"),
}

_PER_EXPERT = re.compile(r"^(?P<layer>.*layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<xid>\d+)\."
                         r"(?P<w>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
FUSED = re.compile(r"^(?P<layer>.*layers\.(?P<bid>\d+))\.mlp\.experts\.(?P<w>gate_up_proj|down_proj)$")


def layout(config: Any) -> ExpertLayout:
    return LAYOUTS[config.model_type]


def expert_count(config: Any) -> int:
    return int(getattr(config, layout(config).count_key))


def expert_ff(config: Any) -> int:
    return int(getattr(config, layout(config).ff_key))


def _normalizes(config: Any) -> bool:
    """Whether transformers renormalizes the chosen experts' weights for this config (Mixtral always does)."""
    return bool(getattr(config, "norm_topk_prob", True))


def check_layers(config: Any) -> None:
    sparse_step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense:
        raise NotImplementedError(
            f"{config.model_type} with dense MLP layers (decoder_sparse_step={sparse_step}, mlp_only_layers={dense}): "
            "llama.cpp's architecture has experts in every layer")


def fuse_experts(state: Iterator[tuple[str, np.ndarray]], config: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors under the loaded model's parameter names (module docstring)."""
    n = expert_count(config)
    pending: dict[str, dict[tuple[str, int], np.ndarray]] = {}
    for name, data in state:
        m = _PER_EXPERT.match(name)
        if m is None:
            yield name.replace(".block_sparse_moe.", ".mlp."), data
            continue
        xid = int(m["xid"])
        if xid >= n:
            raise ValueError(f"{name}: expert {xid}, but the config has {n} experts")
        layer = pending.setdefault(m["layer"], {})
        layer[(_ROLE[m["w"]], xid)] = data
        if len(layer) == 3 * n:
            del pending[m["layer"]]
            gate, up, down = (np.stack([layer[(role, i)] for i in range(n)]) for role in ("gate", "up", "down"))
            yield f"{m['layer']}.mlp.experts.gate_up_proj", np.concatenate([gate, up], axis=1)
            yield f"{m['layer']}.mlp.experts.down_proj", down
    if pending:
        short = {layer: 3 * n - len(found) for layer, found in pending.items()}
        raise ValueError("expert weights missing from the checkpoint: "
                         + ", ".join(f"{layer} lacks {k} of {3 * n}" for layer, k in short.items()))


def _gguf_name(tensor: str, bid: int) -> str:
    import gguf

    return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, tensor)].format(bid=bid) + ".weight"


def split_experts(name: str, data: np.ndarray, config: Any) -> list[tuple[str, np.ndarray]] | None:
    """[(GGUF name, array)] for a fused experts parameter; None for every other tensor."""
    m = FUSED.match(name)
    if m is None:
        return None
    n, ff, hidden, bid = expert_count(config), expert_ff(config), int(config.hidden_size), int(m["bid"])
    want = (n, 2 * ff, hidden) if m["w"] == "gate_up_proj" else (n, hidden, ff)
    if tuple(data.shape) != want:
        raise ValueError(f"{name} has shape {tuple(data.shape)}; this exporter reads {want} (experts, out, in)")
    if m["w"] == "down_proj":
        return [(_gguf_name("FFN_DOWN_EXP", bid), data)]
    return [(_gguf_name("FFN_GATE_EXP", bid), np.ascontiguousarray(data[:, :ff])),
            (_gguf_name("FFN_UP_EXP", bid), np.ascontiguousarray(data[:, ff:]))]


def keeps_f32(gguf_name: str) -> bool:
    """Routers stay float32: llama.cpp's converter writes them so and its quantizer leaves them."""
    return gguf_name.endswith((".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight"))


def write_moe_hparams(writer: Any, config: Any) -> list[str]:
    notes = []
    spec = layout(config)
    writer.add_expert_count(expert_count(config))
    writer.add_expert_used_count(int(config.num_experts_per_tok))
    if spec.ff_key != "intermediate_size":  # llama's MoE (Mixtral) sizes its experts with feed_forward_length
        writer.add_expert_feed_forward_length(expert_ff(config))
    if spec.shared:
        writer.add_expert_shared_feed_forward_length(int(config.shared_expert_intermediate_size))
    if _normalizes(config) != spec.llama_cpp_normalizes:
        notes.append(f"norm_topk_prob={_normalizes(config)}: llama.cpp's {writer.arch} "
                     f"{'renormalizes' if spec.llama_cpp_normalizes else 'does not renormalize'} the chosen experts' "
                     "routing weights, so its outputs will differ from transformers'")
    if config.model_type == "mixtral" and getattr(config, "sliding_window", None):
        notes.append(f"Mixtral's sliding window ({config.sliding_window}) has no place in the llama architecture: "
                     "llama.cpp attends to the whole context")
    return notes


def expected_metadata(config: Any, arch: str) -> dict[str, int]:
    """The expert keys (with their values) llama.cpp's converter writes for ``config`` under ``arch``."""
    spec = layout(config)
    keys = {f"{arch}.expert_count": expert_count(config), f"{arch}.expert_used_count": int(config.num_experts_per_tok)}
    if spec.ff_key != "intermediate_size":
        keys[f"{arch}.expert_feed_forward_length"] = expert_ff(config)
    if spec.shared:
        keys[f"{arch}.expert_shared_feed_forward_length"] = int(config.shared_expert_intermediate_size)
    return keys


def check_metadata(path: Path, config: Any) -> None:
    from gguf import GGUFReader

    from .compare import ExportCheckError

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    wrong = []
    for key, value in expected_metadata(config, arch).items():
        field = reader.fields.get(key)
        got = field.contents() if field is not None else None
        if got != value:
            wrong.append(f"{key}: file {got!r}, model {value!r}")
    if wrong:
        raise ExportCheckError("the GGUF expert metadata, read back, does not describe the model: " + "; ".join(wrong))
