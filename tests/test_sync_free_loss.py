"""``sync_free_metrics``: FastSFT's loss and every logged value equal TRL's own ``compute_loss``, and its step reads
nothing on the host between forward and backward.

Compared (CPU, fp32): the whole log history (loss, grad_norm, entropy, mean_token_accuracy, num_tokens, MoE aux_loss,
the learning rate), and the trained weights, of FastSFT with the switch on and off; with packing (padding-free:
token counts from the batch shape) and without (padded: from the attention mask), with logging every step and every
second step under gradient accumulation (TRL averages a window's micro-steps), a MoE family (its auxiliary loss)
and an evaluation. Equal to 1e-6 relative (the same expressions, evaluated in the same order). Host reads are counted
by wrapping ``Tensor.item`` / ``Tensor.__bool__`` / ``Tensor.tolist`` during ``compute_loss``.

The LM head over the positions the collator lists (``labelled_head``) runs where TRL selects positions by a boolean
mask, a Triton device; here TRL's device test is forced true on the CPU (TRL's kernel still folds its tiles in
torch), so both select, and the head is compared with TRL's selection: directly (outputs and input gradients of a
two-row batch, bitwise) and over whole runs (log history and trained weights, bitwise).
"""

from __future__ import annotations

import logging

import pytest
import torch
from parity import assert_same_tensors, fast_sft, train, trainable

from nbkit.demo.data import make_dataset


def _trainer(tmp_path, sync_free: bool, family="qwen3", packing=True, logging_steps=1, accumulation=1, **settings):
    return fast_sft(
        tmp_path / f"{sync_free}-{family}-{packing}", family=family, max_steps=4, gradient_accumulation_steps=accumulation,
        logging_steps=logging_steps, shuffle_dataset=False, packing=packing, sync_free_metrics=sync_free,
        per_device_eval_batch_size=2, eval_strategy="no", eval_dataset=make_dataset("messages", n=8, split="eval"),
        **settings)


def _history(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in ("train_runtime", "train_samples_per_second",
                                                       "train_steps_per_second", "eval_runtime",
                                                       "eval_samples_per_second", "eval_steps_per_second")}
            for h in trainer.state.log_history]


@pytest.mark.parametrize("family, packing, logging_steps, accumulation", [
    ("qwen3", True, 1, 1), ("qwen3", False, 1, 1), ("qwen3", True, 2, 2), ("qwen3_moe", True, 1, 1)])
def test_logged_values_and_weights_equal_trls(tmp_path, one_thread, family, packing, logging_steps, accumulation):
    runs = {}
    for sync_free in (False, True):
        run = train(_trainer(tmp_path, sync_free, family, packing, logging_steps, accumulation))
        run.trainer.evaluate()
        runs[sync_free] = (_history(run.trainer), run)
    (plain, plain_run), (fast, fast_run) = runs[False], runs[True]
    assert len(plain) == len(fast) and len(plain) >= 3
    keys = {k for h in plain for k in h}
    assert {"loss", "entropy", "mean_token_accuracy", "num_tokens", "eval_loss", "eval_entropy"} <= keys, keys
    if family == "qwen3_moe":
        assert "aux_loss" in keys
    for a, b in zip(plain, fast):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-6), (key, a[key], b[key])
            assert not isinstance(b[key], torch.Tensor), key
    assert [h["num_tokens"] for h in plain if "num_tokens" in h][-1] > 0
    assert isinstance(fast_run.trainer._total_train_tokens, int)
    assert_same_tensors(fast_run.weights, plain_run.weights, where="trained weight")  # bitwise


def test_the_step_reads_nothing_on_the_host(tmp_path, one_thread, monkeypatch):
    """TRL's compute_loss reads the metrics on the host in every micro-step; the sync-free one never does."""
    counts = {}
    for sync_free in (False, True):
        trainer = _trainer(tmp_path, sync_free, packing=False)  # padded: TRL reads the mask's token count too
        batch = next(iter(trainer.get_train_dataloader()))
        reads = []
        for name in ("item", "__bool__", "tolist"):
            original = getattr(torch.Tensor, name)

            def counted(self, *a, _original=original, _name=name, _reads=reads, **k):
                _reads.append(_name)
                return _original(self, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)
        trainer.model.train()
        with trainer.nbkit_speedups():  # as in train(): nbkit's packed attention builds no mask (no read there)
            loss = trainer.compute_loss(trainer.model, batch)
            monkeypatch.undo()
            counts[sync_free] = len(reads)
            loss.backward()
    assert counts[False] >= 3, counts  # the control: TRL's own reads are seen
    assert counts[True] == 0, counts


def test_cases_it_does_not_mirror_take_trls_path(tmp_path):
    from nbkit.speedups import sync_free_loss

    trainer = _trainer(tmp_path, True)
    assert sync_free_loss.applies(trainer, return_outputs=False)
    assert not sync_free_loss.applies(trainer, return_outputs=True)
    trainer.compute_loss_func = lambda *a, **k: None
    assert not sync_free_loss.applies(trainer, return_outputs=False)
    trainer.compute_loss_func = None
    trainer.args.sync_free_metrics = False
    assert not sync_free_loss.applies(trainer, return_outputs=False)


def test_the_installed_trl_is_the_release_it_mirrors():
    """The TRL code sync_free_metrics reproduces has the fingerprints recorded in ``MIRRORS``. A new TRL release
    fails here: compare its compute_loss, log and add_fused_lm_head with this module, then record their fingerprints
    (``nbkit.trl_seam.fingerprint``); until then FastSFT runs TRL's own loss on it."""
    from nbkit.speedups import sync_free_loss
    from nbkit.trl_seam import mirror_differs

    assert mirror_differs(sync_free_loss.MIRRORS) == []


def test_another_trl_release_takes_trls_own_loss_and_says_so_once(tmp_path, one_thread, monkeypatch, caplog):
    """A TRL whose compute_loss differs from the mirrored one (simulated: another function in its place that counts
    its calls): sync_free_metrics does not attach, TRL's compute_loss computes every loss, the log history is the
    switch-off run's, and one warning, over two runs, names the speedup and what differs."""
    from trl import SFTTrainer

    from nbkit.speedups import sync_free_loss

    plain = train(_trainer(tmp_path / "off", False))
    original, calls = SFTTrainer.compute_loss, []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        calls.append(self.state.global_step)
        return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    monkeypatch.setattr(SFTTrainer, "compute_loss", compute_loss)
    monkeypatch.setattr(sync_free_loss.SAY_ONCE, "_said", set())
    with caplog.at_level(logging.WARNING, logger="nbkit.speedups.sync_free_loss"):
        fallback = train(_trainer(tmp_path / "other", True))
        assert "sync_free_metrics" not in fallback.trainer.nbkit_attached
        assert len(calls) == 4  # max_steps micro-steps, all through TRL's compute_loss
        assert _history(fallback.trainer) == _history(plain.trainer)
        train(_trainer(tmp_path / "again", True))
    said = [r.getMessage() for r in caplog.records if "sync_free_metrics" in r.getMessage()]
    assert len(said) == 1, said
    assert "SFTTrainer.compute_loss" in said[0] and "TRL's own compute_loss is used" in said[0], said
    assert "SFTTrainer.log" not in said[0]  # only what differs is named
    monkeypatch.undo()
    assert "sync_free_metrics" in train(_trainer(tmp_path / "back", True)).trainer.nbkit_attached  # the control


@pytest.fixture
def trl_selects(monkeypatch):
    """TRL's fused head selects the labelled positions (as on a Triton device) on the CPU."""
    from trl.trainer import utils as trl_utils

    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)


def test_labelled_positions_are_the_shifted_mask():
    from nbkit.speedups.labelled_head import labelled_positions

    labels = torch.tensor([[-100, 5, 6, -100, 7], [3, -100, -100, 4, 9]])
    expected = [r * 5 + c for r in range(2) for c in range(4) if labels[r, c + 1] != -100]
    assert labelled_positions(labels).tolist() == expected == [0, 1, 3, 7, 8]


def test_the_head_equals_trls_selection(one_thread, trl_selects):
    from parity import tiny_lm
    from trl.trainer.utils import add_fused_lm_head

    from nbkit.speedups.labelled_head import LabelledHead, labelled_positions

    model = tiny_lm("qwen3")
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    settings = LabelledHead.applies(model)
    assert settings is not None and settings["outputs"] == ("log_probs", "entropy", "is_top1")
    head = LabelledHead(model, vars(model)["forward"], settings)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    labels = ids.masked_fill(torch.rand(ids.shape, generator=gen) < 0.4, -100)
    results = []
    for labelled in (False, True):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        call = head if labelled else model.forward
        extra = {"nbkit_labelled": labelled_positions(labels)} if labelled else {}
        out = call(inputs_embeds=embeds, labels=labels, fused_lm_head=True, **extra)
        (out.loss + out.entropy.sum()).backward()
        results.append({"log_probs": out.log_probs, "entropy": out.entropy, "is_top1": out.is_top1,
                        "label_mask": out.label_mask, "loss": out.loss, "input grad": embeds.grad})
    assert head.calls == 1
    assert_same_tensors(results[1], results[0], where="labelled head against TRL's selection")


@pytest.mark.parametrize("accumulation, assistant_only", [(1, False), (2, True)])
def test_runs_through_the_head_equal_trls_selection(tmp_path, one_thread, trl_selects, monkeypatch, accumulation,
                                                    assistant_only):
    from nbkit.speedups.labelled_head import LabelledHead

    calls = []
    original = LabelledHead._labelled
    monkeypatch.setattr(LabelledHead, "_labelled", lambda self, *a: calls.append(1) or original(self, *a))
    runs = {}
    for sync_free in (False, True):
        trainer = _trainer(tmp_path, sync_free, logging_steps=accumulation, accumulation=accumulation,
                           assistant_only_loss=assistant_only)
        runs[sync_free] = (_history(train(trainer).trainer), trainer)
    assert len(calls) == 4 * accumulation  # every micro-step of the sync-free run took the head, none of TRL's
    (plain, _), (fast, trainer) = runs[False], runs[True]
    assert len(plain) == len(fast) >= 2
    for a, b in zip(plain, fast):
        assert a.keys() == b.keys() and all(b[k] == a[k] for k in a), (a, b)  # the same values exactly
    assert_same_tensors(trainable(trainer.model), trainable(runs[False][1].model), where="trained weight")
    assert "forward" not in vars(trainer.model.get_base_model()) or \
        not isinstance(vars(trainer.model.get_base_model())["forward"], LabelledHead)  # detached after train()
