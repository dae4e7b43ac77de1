"""Whole training steps against float64: does FastSFT round worse than plain TRL, or only differently?

Why: in the fp16 curve runs (``benchmarks.curves``) some families' FastSFT curves sit further from plain TRL's than
plain TRL's eager-attention curve does, while on a CPU in fp32 the two runs agree to the logged precision and
switching FastSFT's speedups off one at a time does not close the gap. A 500-step curve amplifies any per-step
difference chaotically, so a curve gap alone cannot say whether FastSFT's steps are less exact or only rounded
another way. This benchmark measures the steps themselves, each path's distance to an exact (float64) step; it is
``benchmarks.moe_rounding`` (the MoE experts block alone) generalized to whole steps through the real trainers.

Workload: curves' demo workload, built by curves' own code (``curves.train_run``, intercepted where it would start
training): per family the same random tiny model saved and loaded as a user loads a checkpoint, QLoRA NF4 with LoRA
r16 on the 7 projections and the embeddings and head trained in full, word-reversal chats with assistant-only loss
packed into rows of 512 tokens, batch 2, the same seed (base weights, LoRA initialisation, data order). Each path's
trainer runs ``--batches`` steps of its own dataloader (the same batches for every path: checked by a fingerprint of
each batch's tokens and trained positions) through its own ``train()`` (its speedups attached, its mixed precision,
its loss), with the optimizer replaced by one that does not step: every batch sees the same weights. Those weights
are the trl path's at step 0, or, with ``--at-step K``, after K optimizer steps of plain TRL on curves' schedule
(``--steps``); every path loads them, and measures the batches that run would see next (steps K+1 to K+N).
Recorded per batch: the training loss and the gradient of every trainable weight (LoRA, embeddings, head), read
right after the backward (under fp16 divided by the grad scaler's scale; a batch whose scaled gradient overflows is
recomputed at half the scale, as the scaler would settle; the first measured batch finds the scaler in its initial
state, whatever K).

Reference: the same step, on the same batches, by plain TRL (``SFTTrainer``) in float64: the trl path's model
(same quantized base, same LoRA) with each NF4 weight dequantized exactly into a float64 ``nn.Linear`` (the NF4 code
times its block's absmax, which bitsandbytes stores in fp32) and every other weight and buffer cast to float64,
eager attention (and eager experts on MoE families), no mixed precision. transformers and TRL compute norms,
softmaxes, RoPE angles and the loss in float32 whatever the input: inside the reference step every float32 (or
half) dtype an op asks for is turned into float64, a lower-precision tensor an op reads is read in float64, and the
default dtype is float64 (a ``TorchDispatchMode``, which also checks that no op of the step, forward or backward,
returns a lower-precision float tensor: the reference fails otherwise); TRL's Triton log-prob kernel gives way to
its torch tiles, and the backward runs on the calling thread so that the mode holds there. What stays of lower
precision is the model's definition, the same for every path: NF4's code table and absmaxes, the inv_freq buffers,
the frozen weights as the path's load stores them (bf16 under bf16), and the trl path's trainable weights, which
every path, the reference included, starts from.
gpt-oss: plain TRL's packed gpt-oss lets the documents of a row attend to each other (transformers' ``GptOssModel``
builds its masks without position ids; BENCHMARKS.md), FastSFT's packed attention does not, so the two compute
different functions. There a second reference, ``fp64_per_document`` (the same float64 step with masks built from
the position ids), is the reference of every FastSFT path whose batches go through nbkit's packed attention
(``cached_packing`` on); the plain paths keep ``fp64``. A row's ``reference`` says which.

Figures per (family, precision, weights, path): the relative distance to its reference of the loss
(``|l - l64| / |l64|``), of all gradients concatenated (``||g - g64|| / ||g64||``) and of each parameter group
(attention LoRA, MLP/experts LoRA, embeddings, head), median and quartiles over the batches; the same distances to
the ``trl`` path directly (``vs_trl_*``). A reference row is the reference against itself (0 by construction: it
checks the arithmetic of the comparison, not float64's determinism).

Verdict per family and weights: FastSFT's median gradient distance to float64 against the range of the plain paths'
(``trl``, ``trl_eager``, and ``trl_experts`` / ``trl_liger`` when run): "within" when it is at most ``1 + --margin``
(default 0.1: a median over a few batches is itself uncertain) times the largest plain one, so FastSFT rounds no
worse than some correct plain path; "ABOVE" otherwise; the ratio is reported either way. The gradients judge: one
loss per batch is a sum of rounding errors of either sign, its median over 16 batches noisy, while the gradients'
distance pools every trainable weight; the loss's comparison is reported beside it (``loss_within_plain_range``). A
family where FastSFT is within but its curve gap is not says the curve amplifies a different rounding; one where it
is above says FastSFT's step itself is less exact, and its switches (``fastsft[switch=value;...]``) tell where.
gemma2 and gpt-oss have no sdpa path: trl is eager there, trl_eager is not run, and the range is trl alone (plus
trl_experts on gpt-oss if asked for).

Isolation: every path runs in its own process (``--jobs`` at a time; speedups and Liger patch modules), the trl
weights first; ``--jobs 0`` runs them in this process, one after another (the tests: monkeypatches reach them). The
gradients pass through files in a temporary folder, removed once compared.

    python -m benchmarks.step_rounding --paths trl,trl_eager,fastsft --precision bf16 --at-step 0,250 --jobs 12
    python -m benchmarks.step_rounding --paths trl,trl_eager,fastsft --precision fp16 --at-step 0,250 --jobs 12
    python -m benchmarks.step_rounding --paths trl,trl_eager,fastsft --precision fp32   # a CPU: all families, fp32
    python -m benchmarks.step_rounding --tiny   # CPU smoke run: qwen3, 3 batches; its figures mean nothing

``--precision fp16`` is curves' T4 path (the compute dtype forced to fp16, fp32 trainable weights and the grad
scaler, FastSFT's attention per-document SDPA); ``--precision bf16,fp16`` runs both from the same bases. On a CPU
the trainers run fp32 (``--precision`` other than fp16 is ignored there, as curves does).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from transformers import TrainerCallback

from . import curves
from .common import parse_path, run_workers, split_paths, write_results

DEFAULT_PATHS = "trl,trl_eager,fastsft"
DEFAULT_BATCHES = 16
PLAIN = ("trl", "trl_eager", "trl_experts", "trl_liger")  # correct plain paths: the verdict's range
REFERENCE = "fp64"
PER_DOCUMENT = "fp64_per_document"
# families whose plain packed attention lets the documents of a row see each other (transformers' GptOssModel builds
# its masks without position_ids): FastSFT keeps them apart, so its step is another function; it is measured against
# a second float64 reference, the plain step with per-document masks
CROSS_DOCUMENT = ("gpt_oss",)
REFUSED = {"trl_order": "another data order gives other batches: nothing to compare step by step"}
LOW = (torch.float32, torch.float16, torch.bfloat16)
MAX_HALVINGS = 40  # fp16 loss scale: 2**16 down to 2**-24
MARGIN = 0.1  # a median over a few batches is not exact: a tie with the plain range is not a difference


# ---------------------------------------------------------------------------------------------------------------
# the float64 reference


class Float64Arithmetic(TorchDispatchMode):
    """Every float32 / fp16 / bf16 dtype an op asks for becomes float64, and such a tensor an op reads (made
    before the step: a token count, a buffer) is read in float64, except by in-place ops and views, which must keep
    their tensor; records the ops that still return a lower-precision float tensor (``low``: op names), so a
    reference that is not float64 throughout shows."""

    def __init__(self) -> None:
        super().__init__()
        self.low: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") in LOW:
            kwargs["dtype"] = torch.float64
        if not func._schema.is_mutable and not func.is_view:  # a lower-precision input is read in float64 (exact)
            args, kwargs = tree_map(_upcast, (args, kwargs))
        out = func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and t.dtype in LOW for t in tree_leaves(out)):
            self.low.append(str(func))
        return out


def _upcast(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) and x.dtype in LOW else x


@contextlib.contextmanager
def float64_step(mode: Float64Arithmetic) -> Iterator[None]:
    """The reference step's context: ``mode`` on, float64 default dtype, the backward on this thread (modes are
    thread-local state; autograd's device threads need not see them)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.autograd.set_multithreading_enabled(False), mode:
            yield
    finally:
        torch.set_default_dtype(before)


def dequantized_linear(layer: torch.nn.Module) -> torch.nn.Linear:
    """A frozen float64 ``nn.Linear`` holding a bitsandbytes 4-bit layer's weight exactly: code x absmax in float64
    (both fp32 numbers, so the product is exact), checked against bitsandbytes' own dequantization."""
    from bitsandbytes import functional as bnbf

    weight, state = layer.weight, layer.weight.quant_state
    blocks = -(-state.shape.numel() // state.blocksize)
    ones = torch.ones(blocks, dtype=torch.float32, device=weight.device)
    unit = bnbf.QuantState(absmax=ones, shape=state.shape, code=state.code, blocksize=state.blocksize,
                           quant_type=state.quant_type, dtype=torch.float32)
    codes = bnbf.dequantize_4bit(weight.data, unit)  # each weight's NF4 code (its block's absmax set to 1)
    absmax = state.absmax
    if state.nested:
        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    flat = codes.double().flatten()
    scale = absmax.double().repeat_interleave(state.blocksize)[: flat.numel()]
    exact = (flat * scale).view(state.shape)
    theirs = bnbf.dequantize_4bit(weight.data, state).double()  # rounded to the layer's dtype
    if not torch.allclose(theirs, exact, rtol=2 * torch.finfo(state.dtype).eps, atol=0):
        raise RuntimeError("NF4 dequantization to float64 disagrees with bitsandbytes' own")
    linear = torch.nn.Linear(exact.shape[1], exact.shape[0], bias=layer.bias is not None, device=weight.device,
                             dtype=torch.float64)
    linear.weight.data = exact
    if layer.bias is not None:
        linear.bias.data = layer.bias.data.double()
    return linear.requires_grad_(False)


def to_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64 in place: 4-bit layers replaced by ``dequantized_linear``, every floating weight and
    buffer cast (trainability unchanged)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        Linear4bit = ()  # noqa: N806  (no 4-bit layers without bitsandbytes)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if Linear4bit and isinstance(child, Linear4bit):
                setattr(module, name, dequantized_linear(child))
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.double()
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = buf.double()
    return model


@contextlib.contextmanager
def per_document_masks() -> Iterator[None]:
    """gpt-oss's masks built from the packed rows' position ids, as every other family builds them: documents apart."""
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

    positions: list[Any] = [None]
    forward = gpt_oss.GptOssModel.forward

    def model_forward(self, *args: Any, position_ids: Any = None, **kwargs: Any):
        positions[0] = position_ids
        try:
            return forward(self, *args, position_ids=position_ids, **kwargs)
        finally:
            positions[0] = None

    def with_positions(make: Any) -> Any:
        return lambda **kwargs: make(**kwargs, position_ids=positions[0])

    with mock.patch.object(gpt_oss.GptOssModel, "forward", model_forward), \
            mock.patch.object(gpt_oss, "create_causal_mask", with_positions(gpt_oss.create_causal_mask)), \
            mock.patch.object(gpt_oss, "create_sliding_window_causal_mask",
                              with_positions(gpt_oss.create_sliding_window_causal_mask)):
        yield


def reference_of(family: str, path: str) -> str:
    """The float64 reference a path is measured against: the one computing the same function."""
    name, overrides = parse_path(path)
    packed = name.startswith("fastsft") and overrides.get("cached_packing", True) is not False
    return PER_DOCUMENT if family in CROSS_DOCUMENT and packed else REFERENCE


def _float64_loader(load_model: Any, family: str) -> Any:
    """``nbkit.loading.load_model`` as curves calls it, then the model made the reference's (see the docstring)."""

    def load(base: str, **kwargs: Any):
        kwargs["attn_implementation"] = "eager"
        if family in curves.MOE:
            kwargs["experts_implementation"] = "eager"
        model, tokenizer = load_model(base, **kwargs)
        return to_float64(model), tokenizer

    return load


def _float64_config(config_cls: type) -> Any:
    def config(**kwargs: Any):
        return config_cls(**{**kwargs, "bf16": False, "fp16": False})  # no autocast, no grad scaler

    return config


# ---------------------------------------------------------------------------------------------------------------
# one path's steps


class _Captured(Exception):
    """Raised out of ``train()`` with what it measured: curves' ``train_run`` stops there, before its evaluation."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("captured")
        self.result = result


class _NoStep(torch.optim.Optimizer):
    """An optimizer that leaves every weight as it is (the trainer's loop, scheduler and grad scaler still run)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.0})

    def step(self, closure: Any = None) -> None:
        return None


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def group_of(name: str) -> str:
    """The parameter group a trainable weight is reported in."""
    if "embed_tokens" in name:
        return "embeddings"
    if "lm_head" in name:
        return "head"
    if "self_attn" in name:
        return "attention_lora"
    return "mlp_lora"  # dense MLP, experts and router LoRA


def fingerprint(inputs: dict[str, Any]) -> str:
    """A batch's identity: its tokens and which positions are trained (the same data for every path)."""
    digest = hashlib.sha1(inputs["input_ids"].detach().cpu().to(torch.int64).numpy().tobytes())
    if inputs.get("labels") is not None:
        digest.update((inputs["labels"] != -100).detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class _Capture:
    """Mixed in before the path's trainer class. ``job["kind"]``: "weights" (save the trainable weights at step 0,
    or after ``at_step`` real optimizer steps), "measure" or "reference" (per batch: loss and gradients)."""

    nbkit_job: dict[str, Any] = {}

    def create_optimizer(self, *args: Any, **kwargs: Any):
        if self.nbkit_job["kind"] == "weights":
            return super().create_optimizer(*args, **kwargs)
        if self.optimizer is None:
            self.optimizer = _NoStep([p for p in self.model.parameters() if p.requires_grad])
        return self.optimizer

    def train(self, *args: Any, **kwargs: Any):
        job = self.nbkit_job
        self._nbkit_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if job["kind"] == "weights":
            if job["at_step"] > 0:
                self.add_callback(_StopAt(job["at_step"]))
                super().train(*args, **kwargs)
            torch.save({n: p.detach().cpu().clone() for n, p in self._nbkit_params}, job["weights"])
            raise _Captured({"steps": int(self.state.global_step)})
        if job["kind"] == "reference":
            to_float64(self.model)  # curves casts trainable weights to fp32 on a CPU and under fp16
        saved = torch.load(job["weights"], weights_only=True)
        if sorted(saved) != sorted(n for n, _ in self._nbkit_params):
            raise RuntimeError("this path's trainable weights are not the trl path's")
        with torch.no_grad():
            for name, param in self._nbkit_params:
                param.copy_(saved[name])
        self._nbkit_mode = Float64Arithmetic() if job["kind"] == "reference" else None
        self._nbkit_record: dict[str, list] = {"losses": [], "grads": [], "fingerprints": [], "loss_scales": []}
        scaler = getattr(self.accelerator, "scaler", None)
        self._nbkit_scaler_start = scaler.state_dict() if scaler is not None else None
        self.args.max_steps = job["at_step"] + job["batches"]
        start = time.perf_counter()
        super().train(*args, **kwargs)
        record = self._nbkit_record
        if len(record["losses"]) != job["batches"]:
            raise RuntimeError(f"{len(record['losses'])} batches measured of {job['batches']}")
        if self._nbkit_mode is not None and self._nbkit_mode.low:
            ops = sorted(set(self._nbkit_mode.low))
            raise RuntimeError(f"the reference ran {len(self._nbkit_mode.low)} ops in low precision: {ops[:8]}")
        raise _Captured({
            "losses": torch.tensor(record["losses"], dtype=torch.float64), "grads": torch.stack(record["grads"]),
            "names": [n for n, _ in self._nbkit_params], "sizes": [p.numel() for _, p in self._nbkit_params],
            "fingerprints": record["fingerprints"], "loss_scales": record["loss_scales"],
            "nbkit_attached": list(getattr(self, "nbkit_attached", [])), "seconds": time.perf_counter() - start,
        })

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        """Measure or reference: the batches the weights' run took are passed over (zero gradients, no forward);
        each later batch is measured, from the grad scaler's initial state on, whatever ``at_step`` is.

        A passed-over batch still ends in the trainer's clip and optimizer step, which under fp16 unscale, step and
        update through the scaler: those need a scale, which only ``scaler.scale`` sets (lazily, on its first
        call), so the batch scales its zero loss. Those steps move the scaler's growth count, so the first measured
        batch puts the scaler back as it was before training."""
        job = self.nbkit_job
        if job["kind"] == "weights":
            return super().training_step(model, inputs, *args, **kwargs)
        params = [p for _, p in self._nbkit_params]
        scaler = getattr(self.accelerator, "scaler", None)
        if self.state.global_step < job["at_step"]:  # batches the weights' run took: passed over
            for p in params:
                p.grad = torch.zeros_like(p)
            loss = torch.zeros((), device=self.args.device)
            if scaler is not None:
                scaler.scale(loss)  # sets the scale accelerate's unscale_ / step / update read
            return loss
        if scaler is not None and not self._nbkit_record["losses"]:
            scaler.load_state_dict(self._nbkit_scaler_start)  # as at step 0: initial scale, no growth counted
        for _ in range(MAX_HALVINGS):
            with float64_step(self._nbkit_mode) if self._nbkit_mode is not None else contextlib.nullcontext():
                loss = super().training_step(model, inputs, *args, **kwargs)
            missing = [n for n, p in self._nbkit_params if p.grad is None]
            if missing:
                raise RuntimeError(f"no gradient for {missing[:3]}")
            grads = torch.cat([p.grad.detach().reshape(-1).double() for p in params])
            if scaler is None or torch.isfinite(grads).all():
                break
            model.zero_grad(set_to_none=True)
            scaler.update(scaler.get_scale() / 2)  # what the scaler would settle at: a batch at a scale that fits
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        store = torch.float64 if self._nbkit_mode is not None else torch.float32  # exact for bf16/fp16/fp32 grads
        record = self._nbkit_record
        record["losses"].append(float(loss.double()))
        record["grads"].append((grads / scale).to(store).cpu())
        record["fingerprints"].append(fingerprint(inputs))
        record["loss_scales"].append(scale)
        return loss


def capture(job: dict[str, Any]) -> dict[str, Any]:
    """One job (see ``_Capture``) through curves' ``train_run``: its trainer, model and data, intercepted."""
    import trl

    import nbkit
    import nbkit.loading

    name, _ = parse_path(job["path"])
    fast = name.startswith("fastsft")
    base = nbkit.FastSFT if fast else trl.SFTTrainer
    cls = type(f"Capture{base.__name__}", (_Capture, base), {"nbkit_job": job})
    patches = [mock.patch.object(nbkit if fast else trl, base.__name__, cls)]
    if job["kind"] == "reference":
        from trl.kernels import chunked_logprob
        from trl.trainer import utils as trl_utils

        patches += [mock.patch.object(nbkit.loading, "load_model",
                                      _float64_loader(nbkit.loading.load_model, job["family"])),
                    mock.patch.object(trl, "SFTConfig", _float64_config(trl.SFTConfig)),
                    mock.patch.object(chunked_logprob, "_use_triton", lambda device: False),
                    mock.patch.object(trl_utils, "_use_triton", lambda device: False)]
        if job.get("per_document"):
            patches.append(per_document_masks())
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        try:
            curves.train_run(job)
        except _Captured as done:
            return done.result
    raise RuntimeError("curves.train_run returned without training")


# ---------------------------------------------------------------------------------------------------------------
# comparison


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2]}


def distances(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, list[float]]:
    """Per batch: relative distance of the loss, of all gradients, and of each parameter group's gradients."""
    if result["names"] != reference["names"]:
        raise ValueError("the two runs have different trainable weights")
    if result["fingerprints"] != reference["fingerprints"]:
        raise ValueError("the two runs took different batches")
    out: dict[str, list[float]] = {"loss": [abs(a - b) / max(abs(b), 1e-300) for a, b in
                                             zip(result["losses"].tolist(), reference["losses"].tolist())],
                                   "grads": [_rel(a, b) for a, b in zip(result["grads"], reference["grads"])]}
    bounds, start = {}, 0
    for name, size in zip(result["names"], result["sizes"]):
        bounds.setdefault(group_of(name), []).append((start, start + size))
        start += size
    for group, spans in bounds.items():
        index = torch.cat([torch.arange(a, b) for a, b in spans])
        out[f"group:{group}"] = [_rel(a[index], b[index]) for a, b in zip(result["grads"], reference["grads"])]
    return out


def compare(results: dict[str, dict | str], workload: dict[str, Any]) -> list[dict]:
    """Rows of one workload (family, precision, weights): every path against the reference and against trl.
    ``results`` maps a path (the references included) to its captured result, or to the error that stopped it."""
    rows = []
    trl_result = results.get("trl")
    for path, result in results.items():
        against = path if path in (REFERENCE, PER_DOCUMENT) else reference_of(workload["family"], path)
        ref = results.get(against)
        row: dict[str, Any] = {"kind": "path", **workload, "path": path, "reference": against}
        if isinstance(result, str) or not isinstance(ref, dict):
            rows.append(row | {"error": result if isinstance(result, str) else f"no reference: {ref}"})
            continue
        try:
            d = distances(result, ref)
            v = distances(result, trl_result) if isinstance(trl_result, dict) else None
        except ValueError as exc:
            rows.append(row | {"error": str(exc)})
            continue
        row.update(batches=len(result["losses"]), loss_median=statistics.median(result["losses"].tolist()))
        for key in ("loss", "grads"):
            s = _spread(d[key])
            row.update({f"{key}_rel": s["median"], f"{key}_rel_q1": s["q1"], f"{key}_rel_q3": s["q3"]})
            if v is not None:
                s = _spread(v[key])
                row.update({f"vs_trl_{key}_rel": s["median"], f"vs_trl_{key}_rel_q1": s["q1"],
                            f"vs_trl_{key}_rel_q3": s["q3"]})
        row["groups"] = {k.removeprefix("group:"): _spread(x) for k, x in d.items() if k.startswith("group:")}
        row["per_batch"] = {"loss_rel": d["loss"], "grads_rel": d["grads"],
                            **({"vs_trl_grads_rel": v["grads"]} if v is not None else {})}
        row.update(loss_scales=result["loss_scales"], nbkit_attached=result["nbkit_attached"],
                   seconds=round(result["seconds"], 2))
        rows.append(row)
    return rows


def verdict(rows: list[dict], margin: float = MARGIN) -> list[dict]:
    """Per workload: each FastSFT path's median distance to float64 against the range of the plain paths': within
    when no larger than ``1 + margin`` times the largest plain one. Judged on the gradients (``within_plain_range``):
    one loss per batch is a sum of rounding errors of either sign, so its median over a few batches is noisy, while
    the gradients' distance pools every trainable weight; the loss's comparison is reported beside it."""
    groups: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if row.get("kind") == "path" and "error" not in row:
            groups.setdefault(_workload(row), {})[row["path"]] = row
    out = []
    for (family, precision, seed, at_step), paths in groups.items():
        plain = {p: paths[p] for p in PLAIN if p in paths}
        for path, row in paths.items():
            if not path.startswith("fastsft"):
                continue
            v: dict[str, Any] = {"kind": "verdict", "family": family, "precision": precision, "seed": seed,
                                 "at_step": at_step, "path": path, "reference": row.get("reference", REFERENCE),
                                 "plain_paths": list(plain), "margin": margin}
            for key, field in (("loss_rel", "loss_within_plain_range"), ("grads_rel", "within_plain_range")):
                values = [r[key] for r in plain.values()]
                v[key] = row[key]
                v[f"plain_{key}_range"] = [min(values), max(values)] if values else None
                v[f"{key}_ratio_to_largest_plain"] = row[key] / max(values) if values and max(values) else None
                v[field] = row[key] <= (1 + margin) * max(values) if values else None
            out.append(v)
    return out


def _workload(row: dict) -> tuple:
    return row["family"], row["precision"], row["seed"], row["at_step"]


def table(rows: list[dict]) -> str:
    """One markdown line per path: distances to float64 (median, quartiles), to trl, per group (median)."""
    lines = ["| family | precision | step | path | loss: rel. distance to fp64, median (quartiles) | gradients: the "
             "same | vs trl: loss, gradients (medians) | gradients per group (medians) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['family']} | {r['precision']} | {r['at_step']} | {r['path']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:100]} | | | |")
            continue
        vs = (f"{r['vs_trl_loss_rel']:.1e}, {r['vs_trl_grads_rel']:.1e}" if "vs_trl_grads_rel" in r else "-")
        groups = ", ".join(f"{k} {s['median']:.1e}" for k, s in r["groups"].items())
        lines.append(f"{head} {r['loss_rel']:.2e} ({r['loss_rel_q1']:.1e}-{r['loss_rel_q3']:.1e}) | "
                     f"{r['grads_rel']:.2e} ({r['grads_rel_q1']:.1e}-{r['grads_rel_q3']:.1e}) | {vs} | {groups} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# the benchmark


def _worker(spec_path: str) -> None:
    job = json.loads(Path(spec_path).read_text())
    _run_here(job)


def _run_here(job: dict[str, Any]) -> None:
    """One job in this process: its result to ``job["out"]``, or why it failed to ``job["out"].error``."""
    try:
        result = capture(job)
    except Exception as exc:  # a failed path is a row that says why, not a lost benchmark
        Path(job["out"] + ".error").write_text(f"{type(exc).__name__}: {exc}"[:2000])
        return
    torch.save(result, job["out"])


def _run_jobs(jobs: list[dict], parallel: int) -> None:
    """Each job in its own process (``common.run_workers``), ``parallel`` at a time (0: all here, one after
    another); a job that left neither its result nor an error file gets its log's tail as its error."""
    def finished(job: dict, returncode: int, tail: str) -> None:
        if not Path(job["out"]).is_file() and not Path(job["out"] + ".error").is_file():
            Path(job["out"] + ".error").write_text(f"exit {returncode}: {tail}")
        error = Path(job["out"] + ".error")
        print(f"done {job['key']}: {error.read_text()[:300] if error.is_file() else 'ok'}", flush=True)

    if parallel == 0:
        for job in jobs:
            _run_here(job)
            finished(job, 0, "")
        return
    run_workers(jobs, parallel, "benchmarks.step_rounding", finished)


def _outcome(job: dict[str, Any]) -> dict | str:
    if Path(job["out"]).is_file():
        return torch.load(job["out"], weights_only=True)
    return Path(job["out"] + ".error").read_text()


def main(argv: list[str] | None = None) -> dict:
    from nbkit.demo.models import FAMILIES, build_base

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_rounding", description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="all", help=f"'all' or some of {','.join(FAMILIES)}")
    parser.add_argument("--paths", default=None, help="comma-separated: trl, trl_eager, trl_experts, trl_liger, "
                        f"fastsft, fastsft[switch=value;...] (default {DEFAULT_PATHS})")
    parser.add_argument("--precision", default="bf16", help="comma-separated: bf16, fp16 (a GPU); a CPU runs fp32")
    parser.add_argument("--batches", type=int, default=None, help=f"batches per path (default {DEFAULT_BATCHES})")
    parser.add_argument("--at-step", default="0", help="comma-separated K: the weights after K plain-TRL optimizer "
                        "steps (0: the initial weights) (default %(default)s)")
    parser.add_argument("--steps", type=int, default=None, help="the curve run the data and schedule are curves' "
                        "of (default 500)")
    parser.add_argument("--margin", type=float, default=MARGIN, help="verdict: within when FastSFT's median "
                        "distance is at most (1 + margin) x the largest plain path's (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="paths at a time, each its own process; 0: all in this "
                        "process (default %(default)s)")
    parser.add_argument("--name", default=None, help="results file name under $OUT (default: step_rounding)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: qwen3, 3 batches of a 6-step run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return {}
    if args.tiny:
        args.families = "qwen3" if args.families == "all" else args.families
        args.batches, args.steps = args.batches or 3, args.steps or 6
    batches, steps = args.batches or DEFAULT_BATCHES, args.steps or 500
    paths = split_paths(args.paths or DEFAULT_PATHS)
    for path in paths:
        name, _ = parse_path(path)
        if name in REFUSED:
            parser.error(f"{path}: {REFUSED[name]}")
        if name == "trl_liger" and not curves.liger_runs():
            parser.error("trl_liger needs liger-kernel and a CUDA GPU")
    if "trl" not in paths:
        paths.insert(0, "trl")  # the weights and the direct comparison are trl's
    precisions = args.precision.split(",")
    if not torch.cuda.is_available():
        if "fp16" in precisions:
            parser.error("--precision fp16 needs a CUDA GPU")
        precisions = ["fp32"]  # what the trainers run in on a CPU
    at_steps = [int(k) for k in args.at_step.split(",")]
    families = list(FAMILIES) if args.families == "all" else args.families.split(",")
    if max(at_steps) >= steps:
        parser.error(f"--at-step {max(at_steps)} is past the {steps}-step run")

    work = tempfile.mkdtemp(prefix="nbkit-step-rounding-")
    bases = {}
    for family in families:
        bases[family] = os.path.join(work, f"base-{family}")
        build_base(bases[family], family, args.seed)
    workloads, weights_jobs, measure_jobs = [], [], []
    for precision in precisions:
        for family in families:
            for at_step in at_steps:
                tag = f"{family}-{precision}-{at_step}"
                common = {"task": "demo", "family": family, "precision": precision, "seed": args.seed,
                          "steps": steps, "base": bases[family], "work": work, "load_in_4bit": True,
                          "batches": batches, "at_step": at_step,
                          "weights": os.path.join(work, f"{tag}.weights.pt"), "weights_key": f"{tag}-weights"}
                weights = common | {"kind": "weights", "path": "trl", "key": f"{tag}-weights"}
                jobs = {REFERENCE: common | {"kind": "reference", "path": "trl", "key": f"{tag}-fp64"}}
                if family in CROSS_DOCUMENT and any(reference_of(family, p) == PER_DOCUMENT for p in paths):
                    jobs[PER_DOCUMENT] = common | {"kind": "reference", "path": "trl", "key": f"{tag}-fp64doc",
                                                   "per_document": True}
                for i, path in enumerate(paths):
                    if path == "trl_eager" and family in curves.EAGER_ONLY or \
                            path == "trl_experts" and family not in curves.MOE:
                        continue  # its reference is eager already / it has no experts (as curves skips them)
                    jobs[path] = common | {"kind": "measure", "path": path, "key": f"{tag}-{i}"}
                for job in [weights, *jobs.values()]:
                    job["out"] = os.path.join(work, f"{job['key']}.pt")
                weights_jobs.append(weights)
                measure_jobs += list(jobs.values())
                workloads.append(({"family": family, "precision": precision, "seed": args.seed,
                                   "at_step": at_step}, weights, jobs))
    start = time.perf_counter()
    _run_jobs(weights_jobs, args.jobs)
    ready = {w["key"] for w in weights_jobs if Path(w["out"]).is_file()}
    _run_jobs([j for j in measure_jobs if j["weights_key"] in ready], args.jobs)
    rows = []
    for workload, weights, jobs in workloads:
        if weights["key"] not in ready:
            failure = f"the trl weights failed: {_outcome(weights)}"
            rows += [{"kind": "path", **workload, "path": p, "error": failure} for p in jobs]
            continue
        rows += compare({path: _outcome(job) for path, job in jobs.items()}, workload)
    for job in [*weights_jobs, *measure_jobs]:  # the gradients: large, and in the rows now
        for name in (job["out"], job["weights"]):
            Path(name).unlink(missing_ok=True)
    verdicts = verdict(rows, args.margin)
    how = (f"{len(weights_jobs) + len(measure_jobs)} jobs, {args.jobs} at a time, "
           f"{time.perf_counter() - start:.0f} s in all")
    if args.tiny:
        how = "CPU smoke run (--tiny): figures mean nothing; " + how
    notes = (f"{how}; {batches} batches per path of curves' {steps}-step demo run, the same weights for every batch; "
             "median and quartiles over the batches of |x - x_fp64| / |x_fp64| (loss; all gradients; per group)")
    payload = write_results("step_rounding", rows + verdicts, notes, argv=argv, name=args.name)
    print(table(rows))
    for v in verdicts:
        lo, hi = v["plain_grads_rel_range"] or (float("nan"),) * 2
        state = {True: "within", False: "ABOVE", None: "no plain path"}[v["within_plain_range"]]
        llo, lhi = v["plain_loss_rel_range"] or (float("nan"),) * 2
        ratio = v["grads_rel_ratio_to_largest_plain"]
        print(f"verdict {v['family']} {v['precision']} step {v['at_step']} {v['path']} (against {v['reference']}): "
              f"gradients {v['grads_rel']:.2e} vs plain {lo:.2e}..{hi:.2e} "
              f"(x{float('nan') if ratio is None else ratio:.2f}) -> {state}; loss {v['loss_rel']:.2e} vs plain "
              f"{llo:.2e}..{lhi:.2e}")
    return payload


if __name__ == "__main__":
    main()
