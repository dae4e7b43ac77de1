"""``export_gguf``: a model folder (e.g. ``save_merged``'s) to one GGUF file, in pure Python, and proof it loads.

No llama.cpp build and no download: the ``gguf`` package writes the file (``GGUFWriter``) and quantizes
(``gguf.quants.quantize``: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, the ternary tq2_0 / tq1_0, checked for
gguf 0.19); ``nbkit.export.kquants`` encodes the K-quants that package cannot, byte for byte as llama.cpp's
reference quantizers, for llama.cpp's file types q6_k, q5_k_m and q4_k_m (the usual default). ``QUANT_TYPES`` is
all of them. The other K mixes and the i-quants (q3_k_m, iq4_nl ...) need llama.cpp's ``llama-quantize``, run on
the f16 file this writes; mxfp4 the package can write, but llama.cpp uses it only for MoE experts.

Which tensors get the requested type (as llama.cpp's converter and quantizer do): 1-D tensors (norms, biases)
stay f32; weights of two or more axes (3-D: stacked experts) take the type, in blocks along their last axis.
- K-quant file types: each tensor's type is the one llama.cpp's ``llama_tensor_get_type`` picks (``k_quant_type``):
  the output projection (``output``, or the embedding when it doubles as the output) q6_k; with q4_k_m and q5_k_m,
  ``attn_v`` and ``ffn_down`` q6_k in the layers llama.cpp gives more bits (the first and last eighth, and every
  third between); the 70B and 8-expert adjustments; the rest the file type's own (q4_k, q5_k, q6_k). Rows that are
  not whole 256-value super-blocks fall back as llama.cpp does: q4_k to q5_0, q5_k to q5_1, q6_k (and the output)
  to q8_0, and to f16 when not even 32-value blocks fit. The file's ``general.file_type`` is llama.cpp's
  (``MOSTLY_Q4_K_M`` ...), so llama.cpp and Ollama name it as their own quantizer's file.
- Other types: with a 4- or 5-bit type, the output projection is q8_0 (llama.cpp would use q6_k); with a ternary
  type the embedding and output are f16. A tensor whose rows do not split into the type's blocks falls back to f16.

Round trip (``check_logits=True``): transformers' own GGUF reader loads the file back
(``from_pretrained(folder, gguf_file=name)``) and its float32 logits on held-out prompts are compared twice:
- with the source whose weights are rounded exactly as the file stores them (quantized with ``gguf.quants`` or
  ``kquants``, dequantized with ``gguf.quants``): the file must reproduce it to ``FILE_TOLERANCE`` (relative, max
  |diff| / max |logit|) whatever the type, which proves layout, names, permutations, norms and metadata; past it
  ``ExportCheckError`` is raised;
- with the unquantized source: what the type costs this model (``GgufReport.quantization``), held only to the
  per-type sanity limit ``BOUND``; past it (a type too coarse for this model: a fine-tune's small weight changes can
  fall below its step) ``ExportCheckError`` says so and what to do (more bits, or ``check_logits=False``).
The tokenizer read back must encode the prompts to the same ids. The reader rebuilds the config from the file's
metadata, which is checked against the model's config on what it reads (``READ_BACK``); what it does not read
(Gemma's soft-capping and query scaling, Qwen3's head size: written for llama.cpp) is taken from the model's config
and named in the report's notes.

An Ollama ``Modelfile`` is written beside the file (``nbkit.export.modelfile``) unless ``modelfile=False``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .compare import ExportCheckError, LogitCheck, check, compare, logits_of, prompt_batches
from .gguf_arch import family_of, gguf_tensors, write_hparams
from .gguf_moe import keeps_f32
from .gguf_readback import load_back
from .gguf_vocab import write_vocab
from .kquants import ENCODERS as K_ENCODERS

logger = logging.getLogger(__name__)

QUANT_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q5_1", "q5_0", "q4_1", "q4_0", "tq2_0",
               "tq1_0")
_FILE_TYPE = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q6_k": "MOSTLY_Q6_K", "q5_k_m": "MOSTLY_Q5_K_M", "q4_k_m": "MOSTLY_Q4_K_M",
              "q5_1": "MOSTLY_Q5_1", "q5_0": "MOSTLY_Q5_0", "q4_1": "MOSTLY_Q4_1", "q4_0": "MOSTLY_Q4_0",
              "tq2_0": "MOSTLY_TQ2_0", "tq1_0": "MOSTLY_TQ1_0"}
# llama.cpp's K-quant file types: the type every tensor starts from, and each K type's fallback for rows that are
# not whole 256-value super-blocks (llama-quant.cpp's tensor_type_fallback)
K_FILE_TYPES = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K"}
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# the file, read back, against the source with its weights rounded as the file stores them: the same numbers up
# to float32 summation order, for every type
FILE_TOLERANCE = 1e-4
# the file against the unquantized source, a sanity limit per type (relative logit difference): a broken export
# (wrong layout, names, norms) lands near 1. Measured on SmolLM2-135M-Instruct, which is sensitive to quantization
# (its weights are a Q4_1 GGUF's): q8_0 0.035, q5_1 0.43, q5_0 0.22, q4_1 0.007 (its own grid), q4_0 0.63. A K
# mix holds its fallbacks where rows are not super-blocks (SmolLM2's width, 576, is not), so its limit is theirs:
# q5_k_m that of q5_1, q4_k_m that of the 4-bit types; q6_k, between q8_0 and q5, gets 0.3. Measured on SmolLM2:
# q6_k 0.072, q5_k_m 0.29, q4_k_m 0.23; on a tiny random Llama whose rows all fit: 0.043, 0.086, 0.16. The
# ternary types are for ternary-trained (BitNet) weights; any other model keeps little of itself: no limit.
BOUND = {"f32": 1e-5, "f16": 1e-2, "bf16": 2e-2, "q8_0": 0.1, "q6_k": 0.3, "q5_k_m": 0.6, "q4_k_m": 0.8,
         "q5_1": 0.6, "q5_0": 0.6, "q4_1": 0.8, "q4_0": 0.8, "tq2_0": None, "tq1_0": None}


@dataclass
class GgufReport:
    path: Path
    quant: str
    arch: str
    tensor_types: dict[str, int]  # GGML type name -> number of tensors
    vocab: dict
    check: LogitCheck | None = None
    tokenizer_round_trip: bool | None = None
    modelfile: Path | None = None
    quantization: LogitCheck | None = None  # the file read back vs the unquantized source (what the type costs)
    notes: list[str] = field(default_factory=list)
    stored_as: dict[str, Any] = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict:
        return {"path": str(self.path), "quant": self.quant, "arch": self.arch, "tensor_types": self.tensor_types,
                "vocab": self.vocab, "check": self.check.as_dict() if self.check else None,
                "quantization": self.quantization.as_dict() if self.quantization else None,
                "tokenizer_round_trip": self.tokenizer_round_trip,
                "modelfile": str(self.modelfile) if self.modelfile else None, "notes": self.notes}


def _state(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the folder's safetensors files, as float32 numpy arrays, one at a time."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights (save the model with save_pretrained)")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(torch.float32).numpy()


@dataclass(frozen=True)
class KQuantModel:
    """What llama.cpp's choice of tensor types reads from the model besides a tensor's name and shape."""

    n_layer: int
    tied: bool  # no ``output`` tensor: the embedding doubles as the output projection
    n_expert: int = 0
    is_70b: bool = False  # llama.cpp's LLM_TYPE_70B: 80 layers, Llama with grouped-query attention or Qwen2

    @classmethod
    def of(cls, config: Any, arch: str) -> KQuantModel:
        n_layer = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        n_expert = int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)
        is_70b = n_layer == 80 and (arch == "QWEN2" or (arch == "LLAMA" and kv_heads != heads))
        return cls(n_layer, bool(getattr(config, "tie_word_embeddings", False)), n_expert, is_70b)


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers, and every third one between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _block_size(type_name: str) -> int:
    return 256 if type_name.endswith("_K") else 32


def k_quant_type(name: str, shape: Sequence[int], quant: str, model: KQuantModel) -> str:
    """The GGML type (name) llama.cpp's ``llama_tensor_get_type`` gives a quantizable tensor in the K-quant file
    type ``quant`` (``K_FILE_TYPES``), without an importance matrix or overrides, restated from llama-quant.cpp.

    llama.cpp counts ``attn_v`` and (without experts) ``ffn_down`` tensors in its layer-major order; with one of
    each per layer, as in every architecture exported here, the count is the layer number read from the name.
    Falcon's exceptions are left out (not an architecture exported here)."""
    default = K_FILE_TYPES[quant]
    chosen = default
    match = re.match(r"blk\.(\d+)\.", name)
    more_bits = match is not None and _use_more_bits(int(match.group(1)), model.n_layer)
    ncols = int(shape[-1])
    if name == "output.weight" or (model.tied and name == "token_embd.weight"):
        chosen = "Q8_0" if ncols % _block_size(default) else "Q6_K"
    elif any(part in name for part in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight")):
        if quant in ("q4_k_m", "q5_k_m") and more_bits:
            chosen = "Q6_K"
        if model.is_70b and chosen == "Q4_K":
            chosen = "Q5_K"
        if model.n_expert == 8:
            chosen = "Q8_0"
    elif "attn_k.weight" in name:
        if model.n_expert == 8:
            chosen = "Q8_0"
    elif "attn_output.weight" in name:
        if model.n_expert == 8 and quant == "q4_k_m":
            chosen = "Q5_K"
    elif "ffn_down" in name:
        if quant in ("q4_k_m", "q5_k_m") and more_bits:
            chosen = "Q6_K"
    if ncols % _block_size(chosen):
        chosen = _K_FALLBACK.get(chosen, chosen)
        if ncols % _block_size(chosen):
            chosen = "F16"
    return chosen


def _tensor_type(name: str, data: np.ndarray, quant: str, tied: bool, model: KQuantModel | None = None) -> Any:
    import gguf

    t = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight") or quant == "f32":
        return t.F32
    if quant in K_FILE_TYPES:
        if model is None:
            raise ValueError(f"{quant}: the tensor types depend on the model (KQuantModel.of(config, arch))")
        return getattr(t, k_quant_type(name, data.shape, quant, model))
    is_output = name == "output.weight" or (tied and name == "token_embd.weight")
    if quant.startswith("tq") and (is_output or name == "token_embd.weight"):
        return t.F16
    if quant[0] == "q" and quant[1] in "45" and is_output:
        return t.Q8_0
    return getattr(t, quant.upper())


def encode(data: np.ndarray, qtype: Any) -> np.ndarray:
    """``data`` in GGML type ``qtype`` (float32 for f32): the K-quants with ``nbkit.export.kquants``, every other
    type with ``gguf.quants``; raises ``gguf.QuantError`` when the last axis does not split into its blocks."""
    import gguf

    encoder = K_ENCODERS.get(qtype.name)
    if encoder is None:
        return gguf.quants.quantize(data, qtype)
    if data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        raise gguf.QuantError(f"{qtype.name}: rows of {data.shape[-1]} are not whole blocks")
    return encoder(data)


def _quantize(data: np.ndarray, qtype: Any) -> tuple[np.ndarray, Any, bool]:
    """(bytes or floats, the type used, whether it fell back to f16 because rows do not fit the blocks)."""
    import gguf

    try:
        return encode(data, qtype), qtype, False
    except gguf.QuantError:
        f16 = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(data, f16), f16, True


def _require_model_folder(model_dir: Path) -> None:
    """Refuse, saying what to do, what is not a model folder: a saved adapter (merged first; the CLI does both) or a
    path with neither file, which transformers would otherwise look up on the Hub and fail on with a network error
    or a missing ``model_type``."""
    if (model_dir / "config.json").is_file():
        return
    if (model_dir / "adapter_config.json").is_file():
        raise ValueError(
            f"{model_dir} is a saved adapter, not a model folder: merge it into its base first, "
            f"nbkit.export.merge_folder({str(model_dir)!r}, 'merged') (or save_merged(model, tokenizer, 'merged') on "
            f"the model in memory), then export 'merged'; or, in one go, `python -m nbkit export {model_dir} --to gguf "
            "--out model.gguf`")
    raise FileNotFoundError(f"{model_dir} holds no config.json: export_gguf takes a model folder with its weights "
                            "and tokenizer, as save_merged or save_pretrained write it")


def export_gguf(model_dir: str | Path, out_path: str | Path, *, quant: str = "f16", check_logits: bool = True,
                check_prompts: Sequence[str] | None = None, modelfile: bool = True, name: str | None = None,
                tokenizer: Any = None) -> GgufReport:
    """Write ``model_dir`` (a transformers model folder with its tokenizer) as GGUF ``out_path`` (module docstring)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    quant = quant.lower()
    if quant not in QUANT_TYPES:
        raise ValueError(f"quant {quant!r}: choose one of {', '.join(QUANT_TYPES)} (other K mixes and i-quants "
                         "need llama.cpp's llama-quantize, run on the f16 file this writes)")
    model_dir, out_path = Path(model_dir), Path(out_path)
    _require_model_folder(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir))
    family = family_of(config)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_dir))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    arch_name = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)]
    writer = gguf.GGUFWriter(str(out_path), arch_name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or model_dir.name)
    notes = write_hparams(writer, config, family)
    writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPE[quant]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = write_vocab(writer, tokenizer, int(config.vocab_size))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    written: dict[str, Any] = {}  # transformers tensor name -> the GGML type it was stored in
    counts: dict[str, int] = {}
    fallbacks = []
    kmodel = KQuantModel.of(config, family.arch) if quant in K_FILE_TYPES else None
    short_rows: dict[str, list[str]] = {}  # K-quant file types: type -> tensors whose rows are not super-blocks
    for source_name, tensor_name, data in gguf_tensors(_state(model_dir), config, family):
        if keeps_f32(tensor_name):
            wanted = gguf.GGMLQuantizationType.F32
        else:
            wanted = _tensor_type(tensor_name, data, quant, tied, kmodel)
        if kmodel is not None and data.ndim > 1 and data.shape[-1] % 256 and wanted.name != "F32":
            short_rows.setdefault(wanted.name, []).append(tensor_name)
        packed, used, fell_back = _quantize(data, wanted)
        if fell_back:
            fallbacks.append(tensor_name)
        writer.add_tensor(tensor_name, packed, raw_dtype=used)
        counts[used.name] = counts.get(used.name, 0) + 1
        if source_name is not None:
            written[source_name] = used
    if fallbacks:
        notes.append(f"{len(fallbacks)} tensor(s) stored f16: rows do not split into {quant} blocks "
                     f"({', '.join(fallbacks[:3])}{'...' if len(fallbacks) > 3 else ''})")
    for used_name, names in short_rows.items():
        notes.append(f"{len(names)} tensor(s) stored {used_name}, as llama.cpp does: rows of {quant} tensors must "
                     f"be whole 256-value super-blocks ({', '.join(names[:3])}{'...' if len(names) > 3 else ''})")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for note in notes:
        logger.warning("nbkit export: %s", note)
    report = GgufReport(out_path, quant, arch_name, counts, vocab, notes=notes, stored_as=written)
    if modelfile:
        from .modelfile import write_modelfile

        report.modelfile = write_modelfile(out_path, tokenizer)
    if check_logits:
        round_trip(report, model_dir, tokenizer, check_prompts)
    return report


def _as_stored(model: torch.nn.Module, stored_as: dict[str, Any]) -> None:
    """Round every weight of ``model`` in place the way the file stores it (quantize, dequantize with ``gguf``)."""
    import gguf

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, qtype in stored_as.items():
            if qtype == gguf.GGMLQuantizationType.F32 or name not in params:
                continue
            p = params[name]
            back = gguf.quants.dequantize(encode(p.detach().numpy(), qtype), qtype)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)).reshape(p.shape))


def round_trip(report: GgufReport, model_dir: Path, tokenizer: Any, prompts: Sequence[str] | None) -> None:
    """Load the file with transformers' GGUF reader and hold its logits and tokenizer to the source's.

    Two figures: ``check`` compares with the source model whose weights are rounded exactly as the file stores
    them (the file must reproduce it: ``FILE_TOLERANCE`` for every type, past which it raises), and
    ``quantization`` with the unquantized source (what the type costs this model; reported, bounded by ``BOUND``
    only as a sanity limit)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(report.path.parent), report.path.name
    rows = prompt_batches(tokenizer, prompts)
    back_tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    texts = [tokenizer.decode(r) for r in rows]
    report.tokenizer_round_trip = all(back_tok(t, add_special_tokens=False)["input_ids"]
                                      == tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts)
    source = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    unquantized = logits_of(source, rows)
    _as_stored(source, report.stored_as)
    as_stored = logits_of(source, rows)
    config = reader_config(folder, file, source.config, report)
    reader, back = load_back(report.path, config, source.config)
    loaded = logits_of(back, rows)
    report.check = check(compare(f"GGUF {report.quant} read back by {reader} vs the source as stored",
                                 as_stored, loaded, FILE_TOLERANCE))
    report.quantization = compare(f"GGUF {report.quant} vs the unquantized source", unquantized, loaded,
                                  BOUND[report.quant])
    print(report.quantization.line(), flush=True)
    if not report.tokenizer_round_trip:
        raise ExportCheckError(f"the tokenizer read back from {file} encodes the check prompts differently")
    if not report.quantization.ok:
        raise ExportCheckError(
            f"{report.quantization.line()}: the file holds the model as {report.quant} stores it (checked above), "
            f"but {report.quant} changes this model far more than it costs a model ({BOUND[report.quant]:g}): "
            "weight changes a fine-tune made can be smaller than the type's step and rounded away. Export a type with "
            "more bits (q8_0, f16), or pass check_logits=False (--no-check from the command line) to keep this file.")


# what transformers' GGUF reader rebuilds from the metadata, held to the source config exactly (floats: to f32)
READ_BACK = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
_NOT_MODEL = {"model_type", "architectures", "dtype", "torch_dtype", "quantization_config", "_name_or_path",
              "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "use_cache", "name_or_path"}


def reader_config(folder: str, file: str, source: Any, report: GgufReport) -> Any:
    """The config transformers' reader builds from the file, checked against ``source`` on what it reads; the
    values it does not read (e.g. Qwen3's head size, Gemma's soft-capping) are taken from ``source`` and named in
    the report's notes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    wrong = [f"{k}: file {getattr(config, k, None)!r}, model {getattr(source, k)!r}" for k in READ_BACK
             if not _same(getattr(config, k, None), getattr(source, k))]
    if wrong:
        raise ExportCheckError("the GGUF metadata, read back, does not describe the model: " + "; ".join(wrong))
    taken = []
    for key, value in source.to_dict().items():
        if key in _NOT_MODEL or key in READ_BACK or key.startswith("_"):
            continue
        if not _same(getattr(config, key, None), value):
            setattr(config, key, getattr(source, key))
            taken.append(key)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if taken:
        report.notes.append("not read back by transformers' GGUF reader, taken from the model's config for the "
                            f"check: {', '.join(sorted(taken))}")
    return config


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and np.float32(a) == np.float32(b)
    return a == b


def write_report(report: GgufReport) -> Path:
    """The report as JSON beside the GGUF file."""
    path = report.path.with_suffix(".export.json")
    path.write_text(json.dumps(report.as_dict(), indent=1, default=str) + os.linesep)
    return path
