"""TRL's fused LM head over labelled positions the collator listed on the host (part of ``sync_free_metrics``).

Why: TRL's fused head (``trl.trainer.utils.add_fused_lm_head``, which ``SFTTrainer`` puts on every model) picks
the positions with a label by a boolean mask on the device, ``hidden[mask]``. How many there are is then known
only after a device-to-host read, so the host waits for the whole forward before it can queue the head and the
backward, and the mask's backward reads again. The collator has the labels on the host already.

What: ``labelled_positions`` (called by ``PackedCollator``) lists, on the host, the flat positions of a ``(rows,
T)`` batch whose next-token label is not -100; the list travels to the device with the batch as
``nbkit_labelled``. ``LabelledHead`` replaces the forward TRL patched onto the model, for one ``train()`` /
``evaluate()`` (through the trainer's ``PatchLedger``): a call with ``fused_lm_head=True`` and ``nbkit_labelled``
on a device where TRL selects positions (a Triton device; elsewhere TRL scores every position, with no read)
runs the backbone, gathers those positions with ``index_select`` (their count is the index's shape: a host
number), runs TRL's own chunked kernel with the settings TRL's patch was made with (read from the patch:
temperature, soft-capping, logit scale, outputs), and scatters the per-position values back into zeros with
``index_copy``. Same kernel, same rows in the same order: the same numbers (tests/test_sync_free_loss.py
compares them bit for bit); every other call is TRL's forward.

Not covered (TRL's forward runs): pre-shifted ``shift_labels`` (sequence parallelism), a router auxiliary loss
(MoE models that request router logits), the head cast to fp32, a model whose forward is not TRL's patch.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .. import trl_seam  # TRL's private names, read at each call (as TRL's own module would be)
from ..trl_seam import ChunkedLogProbFunction, FusedCausalLMOutput, maybe_gather_lm_head_ctx

LABELLED_KEY = "nbkit_labelled"  # the batch key the collator adds and the trainer hands to this head
TRL_HEAD_SETTINGS = ("backbone_attr", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale", "outputs",
                     "temperature")


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices into ``labels``' ``(rows, T)`` grid of the positions whose next label is not -100 (host)."""
    scored = torch.zeros(labels.shape, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != -100
    return scored.reshape(-1).nonzero().squeeze(1)


def trl_head_settings(forward: Any) -> dict[str, Any] | None:
    """The arguments TRL's ``add_fused_lm_head`` patched ``forward`` with (the patch's closure), or None when
    ``forward`` is not that patch (or a release whose patch keeps other names)."""
    func = getattr(forward, "__func__", None)
    code = getattr(func, "__code__", None)
    # functools.wraps gave the patch the model's own name: its code and module tell it apart
    if code is None or code.co_name != "_fused_forward" or func.__globals__.get("__name__") != "trl.trainer.utils":
        return None
    cells = dict(zip(code.co_freevars, func.__closure__ or ()))
    if not all(name in cells for name in TRL_HEAD_SETTINGS):
        return None
    return {name: cells[name].cell_contents for name in TRL_HEAD_SETTINGS}


class LabelledHead:
    """The forward that replaces TRL's on one causal LM while attached (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, trl_forward: Any, settings: dict[str, Any]) -> None:
        self.model = model
        self.trl_forward = trl_forward
        self.settings = settings
        self.calls = 0  # forwards that took the host-listed positions (for tests)
        self.__signature__ = inspect.signature(trl_forward)  # generate() checks its kwargs against the forward's

    @classmethod
    def applies(cls, model: torch.nn.Module) -> dict[str, Any] | None:
        """TRL's settings when ``model``'s forward is TRL's patch and this head can stand in for it."""
        settings = trl_head_settings(vars(model).get("forward"))
        if settings is None or settings["cast_lm_head_to_fp32"]:
            return None
        return settings

    def __call__(self, *args: Any, nbkit_labelled: torch.Tensor | None = None, fused_lm_head: bool = False,
                 labels: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None,
                 num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        text_config = self.model.config.get_text_config()
        router = kwargs.get("output_router_logits", getattr(text_config, "output_router_logits", False))
        if nbkit_labelled is None or not fused_lm_head or labels is None or shift_labels is not None or router \
                or not trl_seam._use_triton(labels.device):  # TRL scores every position there: no selection
            for name, value in (("labels", labels), ("shift_labels", shift_labels),
                                ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return self.trl_forward(*args, fused_lm_head=fused_lm_head, **kwargs)
        self.calls += 1
        return self._labelled(nbkit_labelled, labels, num_items_in_batch, args, kwargs)

    def _labelled(self, index: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any, args: tuple,
                  kwargs: dict[str, Any]) -> Any:
        s = self.settings
        kwargs["use_cache"] = False
        hidden = getattr(self.model, s["backbone_attr"])(*args, **kwargs).last_hidden_state
        head = self.model.get_output_embeddings()
        rows, length = labels.shape
        hidden = hidden.to(head.weight.device).reshape(rows * length, -1)
        labels = labels.to(head.weight.device)
        index = index.to(head.weight.device)
        targets = labels.reshape(-1).index_select(0, index + 1)  # position p predicts the token at p + 1
        with maybe_gather_lm_head_ctx(head.weight, head.bias):
            per_token = ChunkedLogProbFunction.apply(
                hidden.index_select(0, index), head.weight, head.bias, targets, s["temperature"],
                trl_seam._CHUNKED_LOGPROB_CHUNK_SIZE, s["final_logit_softcapping"], s["logit_scale"], s["outputs"])
        mask = labels[:, 1:] != -100

        def spread(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            return x.new_zeros(rows * length).index_copy(0, index, x).view(rows, length)[:, :-1].contiguous()

        log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = (spread(x) for x in per_token)
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy,
                                             log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits,
                                             is_top1=is_top1, label_mask=mask, aux_loss=None)
