"""Cached packed-sequence metadata and the ``"nbkit"`` attention function.

Why: with packing (or padding-free batches), plain transformers + SDPA detects the documents of a row from
``position_ids`` (a GPU-to-CPU sync) and builds a dense T x T block-diagonal mask that every layer then reads. At
16K tokens that mask is 256 M elements and SDPA with a mask is several times slower than a varlen kernel.

Contract:
- ``PackedCollator`` wraps TRL's padding-free collator. Per batch, on the host, it yields ``position_ids``,
  ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (Python ints), exactly TRL's keys, plus
  ``nbkit_cu_seqlens_host`` (a tuple of ints) for kernels that loop over documents on the host. The trainer moves
  the tensors to the device with the batch; nothing is rebuilt later.
- ``PackedAttention`` (a speedup, see ``nbkit.speedup``) switches one model to the ``"nbkit"`` attention
  implementation and installs a forward pre-hook on its decoder that hands every layer the same per-forward
  ``PackedRun`` (metadata + the kernel chosen at attach). If a forward arrives without collated metadata, the hook
  derives it once for that forward (counted in ``metadata_builds``); a forward with a padding mask or a KV cache
  (generation) runs on the model's original attention implementation for that call, so nothing is silently wrong.
- ``"nbkit"`` is deliberately not registered as a mask function: transformers then builds no mask at all.

Kernels, chosen once at attach: ``flash_attn`` (flash-attn's varlen kernel, if installed), ``varlen``
(``torch.nn.attention.varlen.varlen_attn``, CUDA, fp16/bf16; gpt-oss's attention sinks through
``nbkit.sink_attention`` on the same flash ops), ``flex`` (flex attention, block mask built once per
forward), ``sdpa_loop`` (one SDPA call per document over the host offsets; never a T x T mask; handles soft-capping
and attention sinks exactly; the path for CPUs and GPUs without flash kernels such as the T4).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .sink_attention import sink_attention, sink_kernel_works
from .speedup import unwrap_model

logger = logging.getLogger(__name__)

ATTN_NAME = "nbkit"
KERNELS = ("flash_attn", "varlen", "flex", "sdpa_loop")


# --------------------------------------------------------------------------------------------------------------------
# Metadata, built on the host
# --------------------------------------------------------------------------------------------------------------------
def metadata_from_lengths(lengths: list[int] | tuple[int, ...]) -> dict[str, Any]:
    """Boundaries of documents of the given lengths laid end to end in one row (host tensors + ints)."""
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) <= 0:
        raise ValueError(f"document lengths must be positive, got {lengths[:8]}")
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return {
        "position_ids": position_ids,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "nbkit_cu_seqlens_host": tuple(offsets),
    }


def metadata_from_position_ids(position_ids: torch.Tensor) -> dict[str, Any]:
    """Boundaries from a (1, T) or (B, S) position-id tensor: a document starts wherever the position is 0.

    Runs on the tensor's device and reads the result back once (one sync when it is on a GPU). Used only when a
    forward arrives without collated metadata.
    """
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    bounds = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    host = tuple(int(x) for x in bounds.cpu().tolist())
    lengths = [b - a for a, b in zip(host[:-1], host[1:])]
    return {
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "nbkit_cu_seqlens_host": host,
    }


@dataclass
class PackedCollator:
    """Wraps a padding-free TRL ``DataCollatorForLanguageModeling`` and adds the host copy of the boundaries.

    TRL's collator already computes ``cu_seq_lens_*`` / ``max_length_*`` on the host; this keeps them and adds
    ``nbkit_cu_seqlens_host``. ``builds`` counts metadata constructions (one per batch).
    """

    base: Callable[[list[dict[str, Any]]], dict[str, Any]]
    builds: int = 0

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.base(examples)
        if "cu_seq_lens_q" not in batch:
            if "position_ids" not in batch:
                raise ValueError("PackedCollator needs a padding-free collator (batches with position_ids)")
            batch.update(metadata_from_position_ids(batch["position_ids"]))
        cu = batch["cu_seq_lens_q"]
        batch["nbkit_cu_seqlens_host"] = tuple(int(x) for x in cu.tolist())
        self.builds += 1
        return batch


# --------------------------------------------------------------------------------------------------------------------
# Kernels: q, k, v are (T, H, D) views of one flattened row; each returns (T, Hq, D)
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class AttnCall:
    """What one layer's attention needs besides q, k, v."""

    scaling: float
    window: int | None  # transformers' sliding_window: a query sees the last `window` keys, itself included
    softcap: float | None
    sinks: torch.Tensor | None
    dropout: float


def _flash_attn_kernel(q, k, v, run: "PackedRun", call: AttnCall) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    kwargs = {"softmax_scale": call.scaling, "causal": True, "dropout_p": call.dropout}
    if call.window is not None:
        kwargs["window_size"] = (call.window - 1, 0)
    if call.softcap:
        kwargs["softcap"] = call.softcap
    return flash_attn_varlen_func(q, k, v, run.cu_q, run.cu_k, run.max_q, run.max_k, **kwargs)


_VARLEN_HAS_GQA: bool | None = None


def _varlen_kernel(q, k, v, run: "PackedRun", call: AttnCall) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    global _VARLEN_HAS_GQA
    if call.sinks is not None:  # gpt-oss: the same flash kernel, rows rescaled by the sink (nbkit.sink_attention)
        return sink_attention(q, k, v, call.sinks, run.cu_q, run.max_q, call.scaling, call.window)
    if _VARLEN_HAS_GQA is None:  # read the signature once per process
        _VARLEN_HAS_GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters
    window = (call.window - 1, 0) if call.window is not None else (-1, 0)
    kwargs = {"scale": call.scaling, "window_size": window}
    if _VARLEN_HAS_GQA and q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, run.cu_q, run.cu_k, run.max_q, run.max_k, **kwargs)


def _doc_attention(q, k, v, call: AttnCall, training: bool) -> torch.Tensor:
    """Exact causal attention of one document; q/k/v are (H, n, D) with k/v already expanded to q's heads."""
    n = q.shape[1]
    simple = call.softcap is None and call.sinks is None and (call.window is None or call.window >= n)
    if simple:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=call.scaling, dropout_p=call.dropout if training else 0.0
        )
    q, k = q.float(), k.float()  # this path exists for exactness: scores and softmax in fp32
    scores = torch.matmul(q, k.transpose(-1, -2)) * call.scaling
    if call.softcap is not None:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    i = torch.arange(n, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if call.window is not None:
        allowed &= i[None, :] > i[:, None] - call.window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if call.sinks is not None:
        sink = call.sinks.float().reshape(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if training and call.dropout > 0:
        probs = F.dropout(probs, p=call.dropout)
    return torch.matmul(probs, v.float()).to(v.dtype)


def _sdpa_loop_kernel(q, k, v, run: "PackedRun", call: AttnCall) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, T, D)
    out = torch.empty_like(qh)
    offsets = run.host_offsets
    for a, b in zip(offsets[:-1], offsets[1:]):
        if b > a:
            out[:, a:b] = _doc_attention(qh[:, a:b], kh[:, a:b], vh[:, a:b], call, run.training)
    return out.transpose(0, 1)


def _flex_kernel(q, k, v, run: "PackedRun", call: AttnCall) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = run.flex_block_mask(call.window, q.device)
    score_mod = None
    if call.softcap is not None:
        cap = call.softcap

        def score_mod(score, b, h, qi, ki):  # noqa: ANN001 - flex's signature
            return torch.tanh(score / cap) * cap

    out = run.flex_fn(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block_mask,
        score_mod=score_mod,
        scale=call.scaling,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


_KERNEL_FNS = {
    "flash_attn": _flash_attn_kernel,
    "varlen": _varlen_kernel,
    "flex": _flex_kernel,
    "sdpa_loop": _sdpa_loop_kernel,
}


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def varlen_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except Exception:
        return False
    return torch.cuda.get_device_capability() >= (8, 0)  # the flash kernel behind it needs sm80+


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
                "attention_kernel='flash_attn' but flash-attn is not installed: `pip install nbkit[flash]` "
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
    if requested == "sdpa_loop":
        return "sdpa_loop", None
    # auto
    if on_cuda and flash_attn_available() and not sinks:
        return "flash_attn", None
    needs = [n for n, v in (("logit soft-capping", softcap), ("attention sinks", sinks and not sinks_on_varlen),
                            ("attention dropout", dropout)) if v]
    if on_cuda and varlen_available() and not needs:
        return "varlen", None
    if needs:
        return "sdpa_loop", f"{getattr(config, 'model_type', 'model')} needs {', '.join(needs)}, which the varlen kernels lack"
    if on_cuda:
        return "sdpa_loop", "no flash kernel on this GPU (flash-attn absent, torch varlen needs sm80+)"
    return "sdpa_loop", None


# --------------------------------------------------------------------------------------------------------------------
# Per-forward state and the attention function
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class PackedRun:
    """Everything the layers of one forward share. Built once per forward by the decoder pre-hook."""

    kernel: Callable[..., torch.Tensor]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    host_offsets: tuple[int, ...] | None
    training: bool
    flex_fn: Callable | None = None
    _flex_masks: dict = field(default_factory=dict)

    def flex_block_mask(self, window: int | None, device: torch.device):
        """The flex block mask for this forward's documents, built once per (window) and reused by every layer."""
        key = window
        if key not in self._flex_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            total = self.host_offsets[-1] if self.host_offsets else None
            lengths = self.cu_q.diff()
            doc = torch.repeat_interleave(
                torch.arange(lengths.numel(), device=device), lengths.to(device), output_size=total
            )

            def mask_mod(b, h, qi, ki):  # noqa: ANN001 - flex's signature
                ok = (doc[qi] == doc[ki]) & (ki <= qi)
                if window is not None:
                    ok = ok & (qi - ki < window)
                return ok

            self._flex_masks[key] = create_block_mask(mask_mod, None, None, doc.numel(), doc.numel(), device=device)
        return self._flex_masks[key]


def nbkit_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: (B, H, S, D) inputs, (B, S, H, D) output, no attention weights.

    The B rows are laid end to end; the per-forward ``PackedRun`` (kwarg ``nbkit_run``) says where documents start.
    """
    run: PackedRun | None = kwargs.get("nbkit_run")
    if run is None:
        raise RuntimeError(
            "the 'nbkit' attention was called without nbkit's per-forward metadata: attach it with "
            "nbkit.packing.PackedAttention (FastSFT does this) instead of setting attn_implementation by hand"
        )
    bsz, _, seq, _ = query.shape
    q = query.transpose(1, 2).reshape(bsz * seq, query.shape[1], query.shape[3])
    k = key.transpose(1, 2).reshape(bsz * seq, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(bsz * seq, value.shape[1], value.shape[3])
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)) and run.kernel in (_varlen_kernel, _flash_attn_kernel):
        kernel = _sdpa_loop_kernel  # fp32 or CPU tensors: the fused kernels do not run them
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


def register_attention() -> None:
    """Register ``"nbkit"`` with transformers' AttentionInterface (idempotent; the only global act)."""
    AttentionInterface.register(ATTN_NAME, nbkit_attention_forward)


# --------------------------------------------------------------------------------------------------------------------
# The speedup
# --------------------------------------------------------------------------------------------------------------------
SUPPORTED_FAMILIES = {
    "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "gemma3", "phi3", "olmo2",
    "granite", "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "smollm3", "cohere", "starcoder2",
}


class PackedAttention:
    """Switches one model to the ``"nbkit"`` attention for the duration of training (see module docstring)."""

    name = "cached_packing"

    def __init__(self, kernel: str = "auto") -> None:
        if kernel not in ("auto", *KERNELS):
            raise ValueError(f"attention kernel {kernel!r}: choose 'auto' or one of {KERNELS}")
        self.requested = kernel
        self.kernel: str | None = None
        self.metadata_builds = 0  # forwards whose metadata had to be derived in the forward (no collator)
        self.forwards = 0
        self.plain_forwards = 0  # forwards routed to the original implementation (padding mask / KV cache)
        self._model: torch.nn.Module | None = None
        self._config = None
        self._original_impl: str | None = None
        self._hooks: list = []
        self._flex_fn = None

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
            logger.warning("nbkit: attention runs on the per-document SDPA path (%s): exact, slower than varlen", reason)
        if self.kernel == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            self._flex_fn = torch.compile(flex_attention, dynamic=True) if device.type == "cuda" else flex_attention
        register_attention()
        self._model, self._config = base, config
        self._original_impl = config._attn_implementation
        base.set_attn_implementation(ATTN_NAME)
        self._hooks = [
            decoder.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            decoder.register_forward_hook(self._post_forward, always_call=True),
        ]
        logger.info("nbkit: packed attention attached (%s kernel, family %s)", self.kernel, family)
        return True

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._model is not None and self._original_impl is not None:
            self._model.set_attn_implementation(self._original_impl)
        self._model = self._config = None
        self._original_impl = None

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
        has_cache = past is not None and (not hasattr(past, "get_seq_length") or past.get_seq_length() > 0 or kwargs.get("use_cache"))
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
        kwargs["nbkit_run"] = PackedRun(
            kernel=_KERNEL_FNS[self.kernel],
            cu_q=kwargs["cu_seq_lens_q"],
            cu_k=kwargs["cu_seq_lens_k"],
            max_q=int(kwargs["max_length_q"]),
            max_k=int(kwargs["max_length_k"]),
            host_offsets=tuple(host) if host is not None else self._host_offsets(kwargs["cu_seq_lens_q"]),
            training=module.training,
            flex_fn=self._flex_fn,
        )
        return args, kwargs

    def _host_offsets(self, cu: torch.Tensor) -> tuple[int, ...] | None:
        if self.kernel != "sdpa_loop" and cu.is_cuda:
            return None  # not needed by the fused kernels: no sync
        return tuple(int(x) for x in cu.tolist())

    def _post_forward(self, module: torch.nn.Module, args: tuple, kwargs: Any, output: Any = None) -> None:
        if self._model is not None:
            self._set_impl(ATTN_NAME)
