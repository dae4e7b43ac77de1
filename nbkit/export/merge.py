"""``save_merged``: a QLoRA run's adapter merged into the original 16-bit base, saved as a plain model folder.

Why not merge into the 4-bit model: its weights are NF4 approximations; merging there (PEFT dequantizes, adds the
adapter and quantizes again) writes a model that is neither the base you started from nor the one you trained.
The adapter was trained on top of NF4 weights, but its delta belongs on the original weights: that is the model
people deploy, and the one ``nbkit.export.gguf`` quantizes again for llama.cpp.

Contract:
- ``save_merged(model, tokenizer, out_dir, base=None, check_prompts=None)``: ``model`` is a PEFT model (adapters
  on a 4-bit or 16-bit base). The original base weights are loaded from ``base=`` or the adapter config's
  ``base_model_name_or_path`` (float32, CPU), the adapter is put on them and merged with PEFT's
  ``merge_and_unload``; ``out_dir`` gets safetensors weights in the base's own dtype, the config, the generation
  config, and the tokenizer with its chat template. When the base cannot be loaded (and ``base=`` was not given),
  the merge goes into the dequantized 4-bit weights instead, and the report (and a warning) says so. A model
  without adapters is saved as it is (dequantized if 4-bit).
- ``merge_folder(adapter_dir, out_dir, base=None)``: the same from a saved adapter folder (the CLI's path).
- Check, after saving: the folder is loaded back and its logits on held-out prompts are compared with those of
  the unmerged adapter model on the same base weights (float32). Past the tolerance for the saved dtype
  (``TOLERANCE``: the rounding of merged weights to that dtype, with margin) it raises ``ExportCheckError``. The
  figure against the in-memory model you trained (4-bit base: it includes the NF4 approximation) is reported
  beside it, informational.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..compat import quiet_peft_wrap
from .compare import LogitCheck, check, compare, logits_of, prompt_batches
from .source import dequantized_copy, load_16bit_base, saved_dtype

logger = logging.getLogger(__name__)

# relative logit difference (max |diff| / max |logit|) allowed between the reloaded merged model and the unmerged
# adapter model, by the dtype the merged weights are saved in: float32 merges exactly up to summation order; 16-bit
# dtypes round every merged weight (bf16 keeps 8 bits of mantissa, fp16 11)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass
class MergeReport:
    out_dir: Path
    base_weights: str  # where the weights the adapter went into came from
    dtype: str
    check: LogitCheck | None = None
    vs_trained: LogitCheck | None = None  # the in-memory model that was trained (informational)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"out_dir": str(self.out_dir), "base_weights": self.base_weights, "dtype": self.dtype,
                "check": self.check.as_dict() if self.check else None,
                "vs_trained": self.vs_trained.as_dict() if self.vs_trained else None, "notes": self.notes}


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _save(model: torch.nn.Module, tokenizer: Any, out_dir: Path, dtype: torch.dtype) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))


def _merge_on(base16: torch.nn.Module, adapter_dir: str | Path, tokenizer: Any, out_dir: Path,
              dtype: torch.dtype, rows: list[list[int]], report: MergeReport) -> list[torch.Tensor]:
    """Put the adapter on ``base16``, take reference logits, merge, save; returns the reference logits."""
    from peft import PeftModel

    with quiet_peft_wrap():  # PEFT reads a checkpointing name transformers deprecated
        peft16 = PeftModel.from_pretrained(base16, str(adapter_dir), is_trainable=False)
    reference = logits_of(peft16, rows) if rows else []
    merged = peft16.merge_and_unload()
    _save(merged, tokenizer, out_dir, dtype)
    report.notes.append(f"merged with PEFT merge_and_unload; saved in {str(dtype).replace('torch.', '')}")
    return reference


def _verify(out_dir: Path, rows: list[list[int]], reference: list[torch.Tensor], dtype: torch.dtype,
            report: MergeReport) -> list[torch.Tensor]:
    """Reload ``out_dir`` and hold its logits to the reference (raises past the tolerance); returns them."""
    from transformers import AutoModelForCausalLM

    if not rows:
        return []
    reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32, device_map={"": "cpu"})
    got = logits_of(reloaded, rows)
    report.check = check(compare("merged (reloaded) vs adapter model", reference, got, TOLERANCE[dtype]))
    return got


def merge_folder(adapter_dir: str | Path, out_dir: str | Path, *, base: str | None = None,
                 check_prompts: Sequence[str] | None = None, tokenizer: Any = None) -> MergeReport:
    """Merge the adapter saved in ``adapter_dir`` into its original base (see the module docstring)."""
    from transformers import AutoTokenizer

    from .source import describe

    source = describe(adapter_dir, base)
    if source.kind != "adapter":
        raise ValueError(f"{adapter_dir} is not a saved adapter (no adapter_config.json)")
    if not source.base:
        raise ValueError(f"{adapter_dir}/adapter_config.json names no base model: pass base=")
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(adapter_dir))
    dtype = saved_dtype(source.base)
    report = MergeReport(Path(out_dir), f"original weights of {source.base}", str(dtype).replace("torch.", ""))
    rows = prompt_batches(tokenizer, check_prompts) if check_prompts != [] else []
    reference = _merge_on(load_16bit_base(source.base), adapter_dir, tokenizer, Path(out_dir), dtype, rows, report)
    _verify(Path(out_dir), rows, reference, dtype, report)
    return report


def save_merged(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, *, base: str | None = None,
                check_prompts: Sequence[str] | None = None) -> MergeReport:
    """Merge ``model``'s adapter into the original 16-bit base and save it to ``out_dir`` (module docstring)."""
    out_dir = Path(out_dir)
    rows = prompt_batches(tokenizer, check_prompts) if check_prompts != [] else []
    trained = logits_of(model, rows) if rows else []
    if not _is_peft(model):
        quantized = getattr(getattr(model, "config", None), "quantization_config", None) is not None
        plain = dequantized_copy(model) if quantized else model
        dtype = torch.bfloat16 if quantized else next(model.parameters()).dtype
        report = MergeReport(out_dir, "the model as given (no adapters)" + (", dequantized" if quantized else ""),
                             str(dtype).replace("torch.", ""))
        _save(plain if quantized else _detached_copy(model), tokenizer, out_dir, dtype)
        _verify(out_dir, rows, trained, dtype, report)
        return report
    name = base or getattr(model.peft_config[model.active_adapter], "base_model_name_or_path", None)
    with tempfile.TemporaryDirectory(prefix="nbkit-adapter-") as adapter_dir:
        model.save_pretrained(adapter_dir)
        try:
            if not name:
                raise OSError("the adapter config names no base model")
            base16, dtype = load_16bit_base(name), saved_dtype(name)
            where = f"original weights of {name}"
        except (OSError, ValueError) as error:
            if base is not None:
                raise
            base16 = dequantized_copy(model)
            dtype = _compute_dtype(model)
            where = f"dequantized 4-bit weights of the model in memory (base {name!r} not loadable: {error})"
            logger.warning("nbkit export: merging into the dequantized 4-bit weights, not the original base: %s. "
                           "Pass base= the original model's folder for the exact merge.", error)
        report = MergeReport(out_dir, where, str(dtype).replace("torch.", ""))
        reference = _merge_on(base16, adapter_dir, tokenizer, out_dir, dtype, rows, report)
    reloaded = _verify(out_dir, rows, reference, dtype, report)
    if rows:
        report.vs_trained = compare("merged vs the trained model in memory", trained, reloaded, None)
        print(report.vs_trained.line(), flush=True)
    return report


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a dequantized base is saved in: the 4-bit layers' compute dtype, else bfloat16."""
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    dtype = getattr(quant, "bnb_4bit_compute_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    return dtype if dtype in TOLERANCE else torch.bfloat16


def _detached_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU float32 copy to save, so saving in another dtype does not change the caller's model."""
    import copy

    return copy.deepcopy(model).to("cpu", torch.float32)
