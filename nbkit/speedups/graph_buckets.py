"""Token buckets and their static metadata: what the graphed decoder layers read instead of per-step tensors.

Why: a CUDA graph has fixed shapes and reads fixed addresses, and packed or padding-free micro-batches have neither.
A micro-batch of ``T`` tokens runs on the graphs of the smallest bucket (``BUCKETS``: 256 tokens up, steps of at
most 1.5x) that holds it. Its per-step metadata is copied into the bucket's static buffers: ``cu_seqlens`` (the real
documents, then the bucket's padding as one more document, then zero-length documents up to the bucket's capacity),
the per-token arguments (position ids and the like; the padding reads 0) and the (cos, sin) position embeddings, one
pair per layer type (``rope_key``: gemma3's sliding and full layers are handed other ones). Nothing is read on the
host.

Contract: ``BucketMetadata.load`` copies one forward's metadata in (the rows' once per forward, the position
embeddings once per layer type) and says False when a layer is handed other (cos, sin) than the first layer of its
type: that call must run eagerly. The forward's metadata is its ``PackedRun``, found through the attached
``PackedAttention`` (``run_for``: by the forward's ``cu_seq_lens_q``). ``static_kwargs`` gives a layer's keyword
arguments for a capture, over the static buffers, with a new ``PackedRun`` at each call, remembered by that
``PackedAttention`` as the run of the static ``cu_seqlens`` (so the attention calls inside the capture find it, and a
mask an attention kernel builds on first use is built inside the capture). Replays run no Python: only captures and
eager calls look a run up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..ops.varlen_attention import PackedRun

if TYPE_CHECKING:
    from .packed_attention import PackedAttention

BUCKETS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
MIN_DOCS, MAX_DOCS = 16, 256  # documents a bucket holds: tokens / 8 within these (its padding document on top)
TOKENWISE_KWARGS = ("position_ids", "cache_position", "seq_idx")  # one value per token: copied into static twins
DROPPED_KWARGS = ("nbkit_cu_seqlens_host", "num_items_in_batch")  # read by no kernel in a decoder layer


def bucket_for(tokens: int, max_tokens: int) -> Optional[int]:
    """The smallest bucket holding ``tokens`` (None above ``max_tokens``)."""
    for size in BUCKETS:
        if size > max_tokens:
            return None
        if tokens <= size:
            return size
    return None


def doc_capacity(bucket: int) -> int:
    """Real documents a bucket's static ``cu_seqlens`` holds (its padding document comes on top)."""
    return min(MAX_DOCS, max(MIN_DOCS, bucket // 8))


class BucketMetadata:
    """One bucket's static metadata, shared by its layers and refreshed once per forward. ``packed``: the attached
    ``PackedAttention`` whose runs it reads (a forward's) and adds to (each capture's)."""

    def __init__(self, bucket: int, packed: PackedAttention, device: torch.device) -> None:
        self.bucket = bucket
        self.packed = packed
        # (cos, sin) per layer type (``rope_key``): gemma3's sliding and full layers are handed other ones
        self.rope: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_given: dict[Any, torch.Tensor] = {}  # this forward's cos per layer type, by identity
        self.tokenwise: dict[str, torch.Tensor] = {}  # position_ids, cache_position, seq_idx: made at first sight
        slots = doc_capacity(bucket) + 2  # 0, the real documents' ends, the padding's end
        self.cu_q = torch.full((slots,), bucket, dtype=torch.int32, device=device)
        self.cu_k = torch.full((slots,), bucket, dtype=torch.int32, device=device)
        self.grad_out: Optional[torch.Tensor] = None  # (1, bucket, hidden), made with the first layer's graphs
        self._source: Optional[PackedRun] = None  # the run of the forward loaded last (held: its id stays its own)

    def load(self, tokens: int, kwargs: dict, key: Any, run: Optional[PackedRun] = None) -> bool:
        """Copy this forward's metadata in: the rows' once per forward, the position embeddings once per layer type.
        False when a layer of an already loaded type is handed other (cos, sin): its call must run eagerly. ``run``:
        the forward's ``PackedRun`` (default: looked up from ``kwargs``, which finds it only during the forward)."""
        run = run if run is not None else self.packed.run_for(kwargs)
        if run is None:
            raise RuntimeError("nbkit cuda_graphs: a graphed forward without its packed metadata (cached_packing)")
        if self._source is not run:
            self._load_rows(tokens, kwargs, run)
            self._rope_given = {}
        cos, sin = kwargs["position_embeddings"]
        if key in self._rope_given:
            return self._rope_given[key] is cos
        static = self.rope_slot(key, (cos, sin))
        if static[0].shape[-1] != cos.shape[-1] or static[1].shape[-1] != sin.shape[-1]:
            return False
        static[0][:, :tokens].copy_(cos)
        static[1][:, :tokens].copy_(sin)
        self._rope_given[key] = cos
        return True

    def rope_slot(self, key: Any, like: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The static (cos, sin) of one layer type (made on first sight, shaped as ``like``)."""
        if key not in self.rope:
            self.rope[key] = tuple(t.new_zeros((1, self.bucket, t.shape[-1])) for t in like)
        return self.rope[key]

    def _load_rows(self, tokens: int, kwargs: dict, run: PackedRun) -> None:
        for key in TOKENWISE_KWARGS:
            if kwargs.get(key) is not None:
                self._static(key, kwargs[key])[..., :tokens].copy_(kwargs[key])
        for static, cu in ((self.cu_q, run.cu_q), (self.cu_k, run.cu_k)):
            n = cu.numel()
            static[:n].copy_(cu)
            static[n:].fill_(self.bucket)  # the padding's end, then zero-length documents
        self._source = run

    def _static(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The bucket-long static twin of a per-token tensor (tokens on its last dimension; the padding reads 0)."""
        if key not in self.tokenwise:
            self.tokenwise[key] = like.new_zeros((*like.shape[:-1], self.bucket))
        return self.tokenwise[key]

    def static_kwargs(self, given: dict, key: Any) -> Callable[[], dict]:
        """The layer's keyword arguments for a capture: the given ones with the static tensors in their place (the
        position embeddings of its layer type), and at each call a new ``PackedRun`` over the static buffers (on the
        kernel of the forward loaded last), remembered as the static ``cu_seqlens``' run: its caches are filled
        inside the capture."""
        out = {k: v for k, v in given.items() if k not in DROPPED_KWARGS}
        out["position_embeddings"] = self.rope_slot(key, given["position_embeddings"])
        for key in TOKENWISE_KWARGS:
            if given.get(key) is not None:
                out[key] = self._static(key, given[key])
        out.update(cu_seq_lens_q=self.cu_q, cu_seq_lens_k=self.cu_k, max_length_q=self.bucket,
                   max_length_k=self.bucket)

        def make() -> dict:
            self.packed.remember(PackedRun(kernel=self._source.kernel, cu_q=self.cu_q, cu_k=self.cu_k,
                                           max_q=self.bucket, max_k=self.bucket, host_offsets=None, training=True,
                                           tokens=self.bucket))
            return dict(out)

        return make


def rope_key(layer: torch.nn.Module) -> Any:
    """Which (cos, sin) a decoder layer is handed: one per attention type where the model has several (gemma3's
    sliding layers take the local rope, its full ones the global), the same for all otherwise. A guess checked at
    every call (``BucketMetadata.load``): a layer handed other ones than its type's runs eagerly."""
    types, index = getattr(getattr(layer, "config", None), "layer_types", None), getattr(layer, "layer_idx", None)
    if types and isinstance(index, int) and 0 <= index < len(types):
        return types[index]
    return getattr(layer, "attention_type", None)
