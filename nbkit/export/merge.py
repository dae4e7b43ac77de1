"""``save_merged``: a QLoRA run's adapter merged into the original 16-bit base, saved as a plain model folder.

Why not merge into the 4-bit model: its weights are NF4 approximations; merging there (PEFT dequantizes, adds the
adapter and quantizes again) writes a model that is neither the base you started from nor the one you trained.
The adapter was trained on top of NF4 weights, but its delta belongs on the original weights: that is the model
people deploy, and the one ``nbkit.export.gguf`` quantizes again for llama.cpp.

Contract:
- ``save_merged(model, tokenizer, out_dir, base=None, check_prompts=None, dtype=None, check_logits=True)``:
  ``model`` is a PEFT model (adapters on a 4-bit or 16-bit base). The original base weights are loaded from
  ``base=`` or the adapter config's ``base_model_name_or_path`` (float32, CPU), the adapter is put on them and merged
  with PEFT's ``merge_and_unload``; ``out_dir`` gets safetensors weights in ``dtype`` (default: the base's own
  dtype), the config, the generation config, and the tokenizer with its chat template. When the base cannot be
  loaded (and ``base=`` was not given), the merge goes into the dequantized 4-bit weights instead, and the report
  (and a warning) says so. A model without adapters is saved as it is (dequantized if 4-bit).
- ``merge_folder(adapter_dir, out_dir, base=None, dtype=None, check_logits=True)``: the same from a saved adapter
  folder (the CLI's path).
- Checks (``nbkit.export.merge_check``, skipped with ``check_logits=False`` or ``check_prompts=[]``), on held-out
  prompts against the unmerged adapter model on the same base weights (float32): the merge before rounding (to
  float32 summation order; a wrong merge raises ``ExportCheckError`` before anything is saved), then the saved
  folder, reloaded, within a margin of the rounding floor of the saved dtype measured on this model. The figure
  against the in-memory model you trained (4-bit base: it includes the NF4 approximation) is reported beside it,
  informational.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..compat import quiet_peft_wrap
from .compare import LogitCheck, compare, logits_of, prompt_batches
from .merge_check import MergeCheck, dtype_name
from .source import dequantized_copy, load_16bit_base, saved_dtype

logger = logging.getLogger(__name__)

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class MergeReport:
    out_dir: Path
    base_weights: str  # where the weights the adapter went into came from
    dtype: str
    check: LogitCheck | None = None  # the saved folder vs the adapter model, within the floor's margin
    vs_trained: LogitCheck | None = None  # the in-memory model that was trained (informational)
    merge: LogitCheck | None = None  # the merge in float32 vs the adapter model, before rounding
    floor: LogitCheck | None = None  # what rounding to the saved dtype alone does to this model's logits
    effect: LogitCheck | None = None  # the base without the adapter vs the adapter model
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        figures = {k: getattr(self, k).as_dict() if getattr(self, k) else None
                   for k in ("check", "vs_trained", "merge", "floor", "effect")}
        return {"out_dir": str(self.out_dir), "base_weights": self.base_weights, "dtype": self.dtype, **figures,
                "notes": self.notes}

    def _take(self, checks: MergeCheck) -> None:
        self.check, self.merge, self.floor, self.effect = checks.check, checks.merge, checks.floor, checks.effect
        self.notes.extend(checks.notes)


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _dtype(value: torch.dtype | str | None, default: torch.dtype) -> torch.dtype:
    """The dtype to save in: ``value`` (a torch dtype or its name), else ``default``."""
    if value is None or value == "auto":
        return default
    name = dtype_name(value) if isinstance(value, torch.dtype) else str(value).replace("torch.", "")
    if name not in SAVE_DTYPES:
        raise ValueError(f"dtype {value!r}: save in one of {', '.join(SAVE_DTYPES)}")
    return SAVE_DTYPES[name]


def _save(model: torch.nn.Module, tokenizer: Any, out_dir: Path, dtype: torch.dtype) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))


def _merge(adapter_model: torch.nn.Module) -> torch.nn.Module:
    """The adapter merged into its base weights (PEFT's ``merge_and_unload``)."""
    return adapter_model.merge_and_unload()


def _merge_on(base16: torch.nn.Module, adapter_dir: str | Path, tokenizer: Any, out_dir: Path, dtype: torch.dtype,
              checks: MergeCheck | None, report: MergeReport) -> None:
    """Put the adapter on ``base16``, take reference logits, merge, check the merge, round, save."""
    from peft import PeftModel

    with quiet_peft_wrap():  # PEFT reads a checkpointing name transformers deprecated
        peft16 = PeftModel.from_pretrained(base16, str(adapter_dir), is_trainable=False)
    if checks:
        checks.reference(peft16)
    merged = _merge(peft16)
    if checks:
        checks.merged(merged)
        checks.rounded(merged)
    _save(merged, tokenizer, out_dir, dtype)
    report.notes.append(f"merged with PEFT merge_and_unload; saved in {dtype_name(dtype)}")


def _verify(out_dir: Path, checks: MergeCheck | None, report: MergeReport) -> list[torch.Tensor]:
    """Reload ``out_dir`` and hold its logits to the adapter model's (raises past the floor); returns them."""
    from transformers import AutoModelForCausalLM

    if not checks:
        return []
    reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32, device_map={"": "cpu"})
    got = logits_of(reloaded, checks.rows)
    try:
        checks.saved(got)
    finally:
        report._take(checks)
    return got


def _checks(tokenizer: Any, check_prompts: Sequence[str] | None, check_logits: bool,
            dtype: torch.dtype) -> MergeCheck | None:
    if not check_logits or check_prompts == []:
        return None
    return MergeCheck(prompt_batches(tokenizer, check_prompts), dtype)


def merge_folder(adapter_dir: str | Path, out_dir: str | Path, *, base: str | None = None,
                 check_prompts: Sequence[str] | None = None, tokenizer: Any = None,
                 dtype: torch.dtype | str | None = None, check_logits: bool = True) -> MergeReport:
    """Merge the adapter saved in ``adapter_dir`` into its original base (see the module docstring)."""
    from transformers import AutoTokenizer

    from .source import describe

    source = describe(adapter_dir, base)
    if source.kind != "adapter":
        raise ValueError(f"{adapter_dir} is not a saved adapter (no adapter_config.json)")
    if not source.base:
        raise ValueError(f"{adapter_dir}/adapter_config.json names no base model: pass base=")
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(adapter_dir))
    dtype = _dtype(dtype, saved_dtype(source.base))
    report = MergeReport(Path(out_dir), f"original weights of {source.base}", dtype_name(dtype))
    checks = _checks(tokenizer, check_prompts, check_logits, dtype)
    _merge_on(load_16bit_base(source.base), adapter_dir, tokenizer, Path(out_dir), dtype, checks, report)
    _verify(Path(out_dir), checks, report)
    return report


def save_merged(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, *, base: str | None = None,
                check_prompts: Sequence[str] | None = None, dtype: torch.dtype | str | None = None,
                check_logits: bool = True) -> MergeReport:
    """Merge ``model``'s adapter into the original 16-bit base and save it to ``out_dir`` (module docstring)."""
    out_dir = Path(out_dir)
    checks = _checks(tokenizer, check_prompts, check_logits, torch.float32)
    trained = logits_of(model, checks.rows) if checks else []
    if not _is_peft(model):
        quantized = getattr(getattr(model, "config", None), "quantization_config", None) is not None
        plain = dequantized_copy(model) if quantized else _detached_copy(model)
        dtype = _dtype(dtype, torch.bfloat16 if quantized else next(model.parameters()).dtype)
        report = MergeReport(out_dir, "the model as given (no adapters)" + (", dequantized" if quantized else ""),
                             dtype_name(dtype))
        if checks:
            checks.dtype = dtype
            checks.reference(plain)
            checks.merged_logits = checks.reference_logits  # nothing to merge
            checks.rounded(plain)
        _save(plain, tokenizer, out_dir, dtype)
        reloaded = _verify(out_dir, checks, report)
        if checks:
            report.vs_trained = compare("saved vs the model in memory", trained, reloaded, None)
        return report
    name = base or getattr(model.peft_config[model.active_adapter], "base_model_name_or_path", None)
    with tempfile.TemporaryDirectory(prefix="nbkit-adapter-") as adapter_dir:
        model.save_pretrained(adapter_dir)
        try:
            if not name:
                raise OSError("the adapter config names no base model")
            base16, default = load_16bit_base(name), saved_dtype(name)
            where = f"original weights of {name}"
        except (OSError, ValueError) as error:
            if base is not None:
                raise
            base16 = dequantized_copy(model)
            default = _compute_dtype(model)
            where = f"dequantized 4-bit weights of the model in memory (base {name!r} not loadable: {error})"
            logger.warning("nbkit export: merging into the dequantized 4-bit weights, not the original base: %s. "
                           "Pass base= the original model's folder for the exact merge.", error)
        dtype = _dtype(dtype, default)
        if checks:
            checks.dtype = dtype
        report = MergeReport(out_dir, where, dtype_name(dtype))
        _merge_on(base16, adapter_dir, tokenizer, out_dir, dtype, checks, report)
    reloaded = _verify(out_dir, checks, report)
    if checks:
        report.vs_trained = compare(_vs_trained_label(model, where), trained, reloaded, None)
        print(report.vs_trained.line(), flush=True)
    return report


def _vs_trained_label(model: torch.nn.Module, where: str) -> str:
    """The name of the informational figure against the model in memory. A 4-bit model computes with NF4-rounded
    weights while the merge went into the original ones: the gap is that rounding, which the line says, so that a
    large figure next to the passed checks is not read as a failed merge."""
    quantized = getattr(getattr(model, "config", None), "quantization_config", None) is not None
    if quantized and where.startswith("original weights"):
        return ("merged vs the trained model in memory (informational: that model computes with its base rounded "
                "to 4 bits, the merge went into the original weights)")
    return "merged vs the trained model in memory"


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a dequantized base is saved in: the 4-bit layers' compute dtype, else bfloat16."""
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    dtype = getattr(quant, "bnb_4bit_compute_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    return dtype if dtype in SAVE_DTYPES.values() else torch.bfloat16


def _detached_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU float32 copy to save, so saving in another dtype does not change the caller's model."""
    import copy

    return copy.deepcopy(model).to("cpu", torch.float32)
