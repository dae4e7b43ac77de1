"""Cached packed-sequence metadata and the ``"nbkit"`` attention function.

Why: with packing (or padding-free batches), plain transformers + SDPA detects the documents of a row from
``position_ids`` (a GPU-to-CPU sync) and builds a dense T x T block-diagonal mask that every layer then reads. At
16K tokens that mask is 256 M elements and SDPA with a mask is several times slower than a varlen kernel.

Contract:
- ``PackedCollator`` wraps TRL's padding-free collator. Per batch, on the host, it yields ``position_ids``,
  ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (ints), exactly TRL's keys, plus ``nbkit_cu_seqlens_host``
  (a tuple of ints) for kernels that loop over documents on the host. The metadata travels inside the batch
  (dataloader workers may collate in other processes). Its host values are ``HostInt`` / ``HostOffsets``: an int and
  a tuple whose ``.to(...)`` and ``pin_memory()`` return themselves, so code that moves every value of a batch to a
  device (``{k: v.to(device) ...}``, accelerate, the trainer) or feeds it to a model (``model(**batch)``) works on
  it as on a batch of tensors. FastSFT gives this collator to its own train and eval data loaders only;
  ``trainer.data_collator`` stays TRL's. The trainer moves the tensors to the device with the batch; nothing is
  rebuilt later.
- ``PackedAttention`` (a speedup, see ``nbkit.speedups.ledger``) switches one model to the ``"nbkit"`` attention
  implementation and installs a forward pre-hook on its decoder that makes one ``PackedRun`` per forward (metadata +
  the kernel chosen at attach) for every layer to share. If a forward arrives without collated metadata, the hook
  derives it once for that forward (counted in ``metadata_builds``); a forward with a padding mask or a KV cache
  (generation) runs on the model's original attention implementation for that call, so nothing is silently wrong.
- How a layer finds its forward's run: by what transformers hands every attention call anyway, the forward's
  ``cu_seq_lens_q`` tensor. The owner keeps a table from that tensor (by identity, the tensor held so its id stays
  its own) to its run: the latest decoder forward's, so a checkpointed layer recomputed in that forward's backward
  finds it; earlier forwards' while their tensor lives elsewhere (a checkpointed layer's saved arguments, where a
  loop runs two forwards before their backwards), held weakly and without their tensors, the run made again at
  each lookup; and the runs other code made over tensors of its own (``remember``: a CUDA graph capture's, over a
  bucket's static buffers). ``run_for(kwargs)`` looks one up.
- ``"nbkit"`` is registered with transformers' ``AttentionInterface`` at attach, as ``attend`` over the attached
  owner's runs, and put back at detach to what the registry held before (the unattached ``nbkit_attention_forward``,
  which raises, where it held nothing: transformers has no public way to unregister). A call whose
  ``cu_seq_lens_q`` the owner has no run for goes to that earlier entry: another owner's (attached before), or the
  unattached function, so a call without an attached owner or without a run it knows raises.
- ``"nbkit"`` is deliberately not registered as a mask function: transformers then builds no mask at all.

Kernels, chosen once at attach: ``flash_attn`` (flash-attn's varlen kernel, if installed), ``varlen``
(``torch.nn.attention.varlen.varlen_attn``, CUDA, fp16/bf16; gpt-oss's attention sinks through
``nbkit.ops.sink_attention`` on the same flash ops), ``flex`` (flex attention, block mask built once per
forward), ``sdpa`` (exact SDPA, soft-capping and attention sinks included: the whole row in one masked call while
its T x T mask is small, else one call per document; auto's path on CPUs, on GPUs without flash kernels such as the
T4, and for gemma2's soft-capping), ``sdpa_loop`` / ``sdpa_masked`` (either of those, always).
Kernels live in ``nbkit.ops.varlen_attention``; this module wires them into transformers.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch
from transformers import AttentionInterface

from ..model_parts import unwrap_model
from ..ops.packed_boundaries import metadata_from_lengths, metadata_from_position_ids
from ..ops.reference_attention import AttnCall
from ..ops.sink_attention import sink_kernel_works
from ..ops.varlen_attention import (
    KERNEL_FNS,
    PackedRun,
    flash_attn_available,
    varlen_available,
)
from ..settings import check_value
from .labelled_head import LABELLED_KEY, labelled_positions
from .ledger import PatchLedger

logger = logging.getLogger(__name__)

ATTN_NAME = "nbkit"
_FUSED_KERNELS = (KERNEL_FNS["varlen"], KERNEL_FNS["flash_attn"])  # CUDA fp16/bf16 only


class HostInt(int):
    """An int a batch carries on the host: moving it to a device (or pinning it) leaves it as it is."""

    def to(self, *args: Any, **kwargs: Any) -> HostInt:
        return self

    def pin_memory(self, *args: Any) -> HostInt:
        return self


class HostOffsets(tuple):
    """Document offsets a batch carries on the host (a tuple of ints): moving it to a device (or pinning it) leaves
    it as it is."""

    def to(self, *args: Any, **kwargs: Any) -> HostOffsets:
        return self

    def pin_memory(self, *args: Any) -> HostOffsets:
        return self


@dataclass
class PackedCollator:
    """Wraps a padding-free TRL ``DataCollatorForLanguageModeling`` and adds the host copy of the boundaries.

    TRL's collator already computes ``cu_seq_lens_*`` / ``max_length_*`` on the host; this keeps them and adds
    ``nbkit_cu_seqlens_host``. ``labelled``: also ``nbkit_labelled``, the positions the loss scores, listed on the
    host (``labelled_head``; the trainer takes the key out before any model sees the batch). ``builds`` counts
    metadata constructions (one per batch).
    """

    base: Callable[[list[dict[str, Any]]], dict[str, Any]]
    labelled: bool = False
    builds: int = 0

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.base(examples)
        if "cu_seq_lens_q" not in batch:
            if "position_ids" not in batch:
                raise ValueError("PackedCollator needs a padding-free collator (batches with position_ids)")
            batch.update(metadata_from_position_ids(batch["position_ids"]))
        cu = batch["cu_seq_lens_q"]
        batch["nbkit_cu_seqlens_host"] = HostOffsets(int(x) for x in cu.tolist())
        for key in ("max_length_q", "max_length_k"):
            batch[key] = HostInt(batch[key])
        if self.labelled and isinstance(batch.get("labels"), torch.Tensor):
            batch[LABELLED_KEY] = labelled_positions(batch["labels"])
        self.builds += 1
        return batch


def choose_kernel(requested: str, config: Any, device: torch.device) -> tuple[str, str | None]:
    """Pick the kernel for one model, once. Returns (kernel, reason when the best kernel could not be used).

    Raises ValueError when a kernel is requested by name and cannot run here.
    """
    softcap = getattr(config, "attn_logit_softcapping", None)
    sinks = getattr(config, "model_type", "") == "gpt_oss"
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    on_cuda = device.type == "cuda"
    if requested == "flash_attn":
        if not flash_attn_available():
            raise ValueError(
                "attention_kernel='flash_attn' but flash-attn is not installed: `pip install 'nbkit-sft[flash]'` "
                "(a prebuilt wheel for your torch/CUDA), or use attention_kernel='auto'."
            )
        if sinks:
            raise ValueError("flash-attn's varlen kernel has no attention sinks (gpt-oss): use 'auto'")
        return "flash_attn", None
    sinks_on_varlen = sinks and on_cuda and varlen_available() and sink_kernel_works(device)[0]
    if requested == "varlen":
        if not (on_cuda and varlen_available()):
            raise ValueError("attention_kernel='varlen' needs a CUDA GPU of compute capability 8.0+ (torch varlen)")
        if softcap or dropout or (sinks and not sinks_on_varlen):
            raise ValueError("torch's varlen kernel supports no soft-capping or attention dropout (and sinks only "
                             "where nbkit's sink probe passes): use 'auto'")
        return "varlen", None
    if requested == "flex":
        if sinks:
            raise ValueError("nbkit's flex path has no attention sinks (gpt-oss): use 'auto'")
        return "flex", None
    if requested in ("sdpa", "sdpa_loop", "sdpa_masked"):
        return requested, None
    # auto
    if on_cuda and flash_attn_available() and not sinks:
        return "flash_attn", None
    needs = [n for n, v in (("logit soft-capping", softcap), ("attention sinks", sinks and not sinks_on_varlen),
                            ("attention dropout", dropout)) if v]
    if on_cuda and varlen_available() and not needs:
        return "varlen", None
    if needs:
        return "sdpa", f"{getattr(config, 'model_type', 'model')} needs {', '.join(needs)}, which the varlen kernels lack"
    if on_cuda:
        return "sdpa", "no flash kernel on this GPU (flash-attn absent, torch varlen needs sm80+)"
    return "sdpa", None


def nbkit_attention_forward(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """What ``"nbkit"`` names where no attached ``PackedAttention`` knows the call's ``cu_seq_lens_q``: it raises."""
    raise RuntimeError(
        "the 'nbkit' attention was called without nbkit's per-forward metadata: no attached PackedAttention made a "
        "run for this call's cu_seq_lens_q. Attach nbkit.speedups.packed_attention.PackedAttention (FastSFT does "
        "this) instead of setting attn_implementation by hand"
    )


def attend(
    run: PackedRun,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over one forward's ``run``: (B, H, S, D) inputs, (B, S, H, D) output, no
    attention weights. The B rows are laid end to end; ``run`` says where documents start (no mask is read)."""
    bsz, _, seq, _ = query.shape
    q = query.transpose(1, 2).reshape(bsz * seq, query.shape[1], query.shape[3])
    k = key.transpose(1, 2).reshape(bsz * seq, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(bsz * seq, value.shape[1], value.shape[3])
    if run.kernel in _FUSED_KERNELS and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        kernel = KERNEL_FNS["sdpa"]  # fp32 or CPU tensors: the fused kernels do not run them
    else:
        kernel = run.kernel
    call = AttnCall(
        scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,
        window=sliding_window,
        softcap=softcap,
        sinks=s_aux,
        dropout=dropout if module.training else 0.0,
    )
    out = kernel(q, k, v, run, call)
    return out.reshape(bsz, seq, out.shape[1], out.shape[2]), None


# --------------------------------------------------------------------------------------------------------------------
# The speedup
# --------------------------------------------------------------------------------------------------------------------
SUPPORTED_FAMILIES = {
    "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "gemma3", "phi3", "olmo2",
    "granite", "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "smollm3", "cohere", "starcoder2",
}


class PackedAttention:
    """Switches one model to the ``"nbkit"`` attention for the duration of training (see module docstring).

    Other code finds a forward's ``PackedRun`` here: ``run_for(kwargs)`` (the keyword arguments a decoder layer or an
    attention call is handed), and adds runs it makes itself with ``remember(run)``.
    """

    name = "cached_packing"

    def __init__(self, kernel: str = "auto") -> None:
        check_value("attention_kernel", kernel)
        self.requested = kernel
        self.kernel: str | None = None
        self.metadata_builds = 0  # forwards whose metadata had to be derived in the forward (no collator)
        self.forwards = 0
        self.plain_forwards = 0  # forwards routed to the original implementation (padding mask / KV cache)
        self._model: torch.nn.Module | None = None
        self._config = None
        self._original_impl: str | None = None
        self._flex_fn = None
        # id(cu_seq_lens_q) -> (that tensor, its run): the tensor held, so that no other tensor takes its id; an
        # earlier forward's: (a weak reference to it, its run without tensors), dropped when the tensor goes
        self._runs: dict[int, tuple[torch.Tensor | weakref.ref, PackedRun]] = {}
        self._forward_key: int | None = None  # the latest decoder forward's entry, made weak by the next forward
        self._ledger = PatchLedger(self.name)

    # -- attach / detach -------------------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> bool:
        self.detach()
        base = unwrap_model(model)
        config = getattr(base, "config", None)
        text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        family = getattr(text_config, "model_type", None)
        decoder = self._find_decoder(base)
        if config is None or decoder is None or not getattr(base, "_can_set_attn_implementation", lambda: False)():
            logger.warning("nbkit: packed attention not attached: %s has no AttentionInterface dispatch; plain path kept",
                           type(base).__name__)
            return False
        if family not in SUPPORTED_FAMILIES:
            logger.warning("nbkit: packed attention is not validated for model family %r; plain attention kept", family)
            return False
        device = next(base.parameters()).device
        self.kernel, reason = choose_kernel(self.requested, text_config, device)
        if reason:
            logger.warning("nbkit: attention runs on the exact SDPA path (%s): slower than varlen", reason)
        if self.kernel == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            self._flex_fn = torch.compile(flex_attention, dynamic=True) if device.type == "cuda" else flex_attention
        self._register()
        self._model, self._config = base, config
        self._original_impl = original = config._attn_implementation
        base.set_attn_implementation(ATTN_NAME)
        self._ledger.call("attn_implementation", lambda: base.set_attn_implementation(original))
        self._ledger.hook(decoder.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._ledger.hook(decoder.register_forward_hook(self._post_forward, always_call=True))
        logger.info("nbkit: packed attention attached (%s kernel, family %s)", self.kernel, family)
        return True

    def detach(self) -> None:
        self._ledger.undo()
        self._model = self._config = None
        self._original_impl = None
        self._flex_fn = None
        self._runs, self._forward_key = {}, None

    def _register(self) -> None:
        """``"nbkit"`` in transformers' registry: ``attend`` over this owner's runs. A call whose ``cu_seq_lens_q``
        it has no run for goes to what the registry held before (another owner attached earlier, or the unattached
        function, which raises). The owner is held weakly: one never detached (an exception mid-attach) does not keep
        its model alive through the registry. At undo, the registry holds what it held before, unless something
        else has been registered since."""
        previous = AttentionInterface().get(ATTN_NAME, nbkit_attention_forward)
        owner = weakref.ref(self)

        def attention(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            found = owner()
            run = found.run_for(kwargs) if found is not None else None
            if run is None:
                return previous(module, query, *args, **kwargs)
            return attend(run, module, query, *args, **kwargs)

        AttentionInterface.register(ATTN_NAME, attention)

        def restore() -> None:
            if AttentionInterface().get(ATTN_NAME) is attention:
                AttentionInterface.register(ATTN_NAME, previous)
            else:
                logger.warning("nbkit %s: the %r attention was registered again by someone else; left as it is",
                               self.name, ATTN_NAME)

        self._ledger.call(f"AttentionInterface[{ATTN_NAME!r}]", restore)

    # -- the runs --------------------------------------------------------------------------------------------------
    def run_for(self, kwargs: Mapping[str, Any]) -> PackedRun | None:
        """The ``PackedRun`` of the forward whose keyword arguments these are (found by their ``cu_seq_lens_q``
        tensor, by identity), or None: no such tensor, or one this owner has no run for (not attached, a forward on
        the plain path, a tensor of another forward)."""
        cu = kwargs.get("cu_seq_lens_q")
        entry = self._runs.get(id(cu)) if isinstance(cu, torch.Tensor) else None
        if entry is None:
            return None
        held, run = entry
        if isinstance(held, weakref.ref):  # an earlier forward's, its checkpointed layers recomputing: made again
            return replace(run, cu_q=cu, cu_k=kwargs.get("cu_seq_lens_k", cu)) if held() is cu else None
        return run if held is cu else None

    def _keep_earlier(self, key: int) -> None:
        """The latest forward's run, as another forward starts: kept, without holding its tensors or mask caches,
        for as long as its ``cu_seq_lens_q`` tensor lives elsewhere (a checkpointed layer's saved arguments, in a
        loop that runs two forwards before their backwards), then dropped."""
        entry = self._runs.get(key)
        if entry is None or isinstance(entry[0], weakref.ref):
            return
        owner = weakref.ref(self)

        def gone(ref: weakref.ref) -> None:
            found = owner()
            if found is not None and found._runs.get(key, (None,))[0] is ref:
                del found._runs[key]

        self._runs[key] = (weakref.ref(entry[0], gone), replace(entry[1], cu_q=None, cu_k=None,
                                                                       _flex_masks={}, _dense_masks={}))

    def remember(self, run: PackedRun) -> None:
        """Let ``run`` be found by its ``cu_q`` tensor (a run made outside a decoder forward: a graph capture's, over
        a bucket's static buffers). It replaces an earlier run over the same tensor and is kept until then or
        ``detach``."""
        self._runs[id(run.cu_q)] = (run.cu_q, run)

    @staticmethod
    def _find_decoder(base: torch.nn.Module) -> torch.nn.Module | None:
        """The module whose forward builds the mask and calls the layers (``model.model`` for a CausalLM)."""
        getter = getattr(base, "get_decoder", None)
        if callable(getter):
            try:
                dec = getter()
                if isinstance(dec, torch.nn.Module):
                    return dec
            except Exception:  # some wrappers raise when there is no decoder
                pass
        inner = getattr(base, getattr(base, "base_model_prefix", ""), None)
        return inner if isinstance(inner, torch.nn.Module) else None

    # -- hooks -----------------------------------------------------------------------------------------------------
    def _set_impl(self, impl: str) -> None:
        if self._config._attn_implementation != impl:
            self._model.set_attn_implementation(impl)

    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.forwards += 1
        past = kwargs.get("past_key_values")
        has_cache = past is not None and (not hasattr(past, "get_seq_length") or past.get_seq_length() > 0
                                          or kwargs.get("use_cache"))
        if kwargs.get("attention_mask") is not None or has_cache or args:
            # A padded batch or generation: this call runs on the original implementation, with its own mask.
            self.plain_forwards += 1
            self._set_impl(self._original_impl)
            return args, kwargs
        self._set_impl(ATTN_NAME)
        kwargs = dict(kwargs)
        if kwargs.get("cu_seq_lens_q") is None:
            ref = kwargs.get("input_ids")
            if ref is None:
                ref = kwargs["inputs_embeds"]
            bsz, seq = ref.shape[0], ref.shape[1]
            pos = kwargs.get("position_ids")
            if pos is None:  # unpacked rows: each row is one document
                meta = metadata_from_lengths([seq] * bsz)
                meta["cu_seq_lens_q"] = meta["cu_seq_lens_k"] = meta["cu_seq_lens_q"].to(ref.device)
                del meta["position_ids"]
            else:
                meta = metadata_from_position_ids(pos)
            self.metadata_builds += 1
            kwargs.update(meta)
        host = kwargs.get("nbkit_cu_seqlens_host")
        run = PackedRun(
            kernel=KERNEL_FNS[self.kernel],
            cu_q=kwargs["cu_seq_lens_q"],
            cu_k=kwargs["cu_seq_lens_k"],
            max_q=int(kwargs["max_length_q"]),
            max_k=int(kwargs["max_length_k"]),
            host_offsets=tuple(host) if host is not None else self._host_offsets(kwargs["cu_seq_lens_q"]),
            training=module.training,
            flex_fn=self._flex_fn,
        )
        # this forward's run is the latest; the previous forward's stays findable, weakly, while its tensors live (a
        # checkpointed layer of it may recompute after this forward); no forward ever reads another's
        if self._forward_key is not None:
            self._keep_earlier(self._forward_key)
        self.remember(run)
        self._forward_key = id(run.cu_q)
        return args, kwargs

    def _host_offsets(self, cu: torch.Tensor) -> tuple[int, ...] | None:
        if self.kernel not in ("sdpa", "sdpa_loop") and cu.is_cuda:
            return None  # not needed by the fused kernels: no sync
        return tuple(int(x) for x in cu.tolist())

    def _post_forward(self, module: torch.nn.Module, args: tuple, kwargs: Any, output: Any = None) -> None:
        if self._model is not None:
            self._set_impl(ATTN_NAME)
