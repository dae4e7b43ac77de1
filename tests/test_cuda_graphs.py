"""``cuda_graphs``: buckets, padding, static metadata and the replay's autograd plumbing, on CPU through emulation.

On a CPU there are no graphs; ``CudaGraphs(backend=TapeBackend())`` runs the same static buffers, buckets, padding document
and autograd function with an eager re-run of the layer in place of each replay. What these tests prove is what the
graphs' dataflow does to the numbers: a micro-batch padded into its bucket gives the eager layers' loss and LoRA
gradients (fp32, to 1e-5 relative: only the GEMMs' row counts differ), the padding never leaks into real tokens, and
every call a graph cannot take runs eagerly with its reason counted. The graphs are an engine of the layer runner
(``layer_runner``): ``CudaGraphs.attach`` runs it in a runner of its own, and FastSFT through its ``decoder_layers``
row; which layers replay is the runner's plan (``plans[i].graphed``), the memory test its budget's. The GPU test
(``tests/gpu/test_cuda_graphs_gpu.py``) checks the same parity with real captures.
"""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
from grad_steps import StepGrads
from peft import LoraConfig, get_peft_model

from nbkit import FastSFT, FastSFTConfig
from nbkit.demo.data import make_dataset
from nbkit.demo.models import tiny_model
from nbkit.demo.tokenizer import load_demo_tokenizer
from nbkit.ops.layer_graphs import TapeBackend, trainable_parameters
from nbkit.ops.packed_boundaries import metadata_from_lengths
from nbkit.speedups import LAYER_MODES, SPEEDUPS, layer_budget
from nbkit.speedups import cuda_graphs as graphs_mod
from nbkit.speedups.cuda_graphs import MAX_TOKENS, CudaGraphs
from nbkit.speedups.fused_lora import FusedLoRA
from nbkit.speedups.graph_buckets import BUCKETS, bucket_for, doc_capacity
from nbkit.speedups.graph_memory import GraphMemory
from nbkit.speedups.layer_budget import Budget
from nbkit.speedups.layer_runner import LayerRunner
from nbkit.speedups.packed_attention import PackedAttention

VOCAB = 97
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_buckets_hold_every_length_up_to_the_largest_and_grow_by_at_most_half():
    assert bucket_for(1, MAX_TOKENS) == 256 and bucket_for(256, MAX_TOKENS) == 256 and bucket_for(257, MAX_TOKENS) == 384
    assert bucket_for(1919, MAX_TOKENS) == 2048 and bucket_for(2049, MAX_TOKENS) == 3072
    assert bucket_for(8192, MAX_TOKENS) == 8192
    assert bucket_for(8193, MAX_TOKENS) is None and bucket_for(2049, max_tokens=2048) is None
    assert all(b / a <= 1.5 for a, b in zip(BUCKETS, BUCKETS[1:]))
    assert doc_capacity(128) == 16 and doc_capacity(256) == 32 and doc_capacity(8192) == 256


def _model(seed: int = 0, wide_mlp: Optional[int] = None) -> torch.nn.Module:
    """The tiny qwen3 with LoRA on every projection; ``wide_mlp``: that decoder layer's MLP twice as wide (a layer of
    another shape)."""
    model = tiny_model("qwen3", VOCAB, seed=seed)
    if wide_mlp is not None:
        config = copy.copy(model.config)
        config.intermediate_size *= 2
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            model.model.layers[wide_mlp].mlp = type(model.model.layers[wide_mlp].mlp)(config)
    torch.manual_seed(seed)  # PEFT initializes LoRA A from the global generator
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():  # LoRA B starts at zero: give it values so every LoRA gradient is non-trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    return model


def _batch(lengths: list[int], seed: int) -> dict:
    meta = metadata_from_lengths(lengths)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids, "use_cache": False, **meta}  # use_cache: as TRL's compute_loss


def _steps(model, batches, *speedups) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    attached = [s for s in speedups if s.attach(model)]
    assert len(attached) == len(speedups)
    losses, grads = [], []
    try:
        for batch in batches:
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        for s in reversed(attached):
            s.detach()
    return losses, grads


def _packed_graphs(mode=True, **kwargs) -> tuple[PackedAttention, CudaGraphs]:
    """Packed attention on the exact SDPA kernel, and graphs on tapes that read its per-forward runs."""
    packed = PackedAttention(kernel="sdpa")
    return packed, CudaGraphs(mode=mode, backend=TapeBackend(), packed=packed, **kwargs)


def _close(a: list[dict], b: list[dict]) -> None:
    for ga, gb in zip(a, b):
        assert ga.keys() == gb.keys() and len(ga) > 0
        for name in ga:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-7, msg=name)


# lengths: several documents, a row that fills its bucket exactly, a row in a smaller bucket
BATCHES = [[120, 80, 100], [256, 128], [50, 150, 40], [120, 80, 100]]


def test_padded_replays_give_the_eager_layers_loss_and_lora_gradients(caplog):
    batches = [_batch(lengths, seed) for seed, lengths in enumerate(BATCHES)]
    plain = _steps(_model(), batches, PackedAttention(kernel="sdpa"), FusedLoRA())
    packed, graphs = _packed_graphs()
    with caplog.at_level("DEBUG", logger="nbkit.speedups.cuda_graphs"):
        graphed = _steps(_model(), batches, packed, FusedLoRA(), graphs)
    # each capture says what it reserved (0 off CUDA): what reading an out-of-memory under graphs needs
    assert caplog.text.count("layers captured at") == 2 and "4 layers captured at 384 tokens" in caplog.text
    torch.testing.assert_close(graphed[0], plain[0], rtol=1e-5, atol=0)
    _close(graphed[1], plain[1])
    layers = 4  # tiny_model's qwen3
    assert graphs.eager == {}
    assert graphs.replays == layers * len(BATCHES)
    assert graphs.captured == layers * 2  # buckets 384 (300 tokens, 384) and 256 (240 tokens)
    counters = graphs.counters()
    assert counters["captures"] == 2 and graphs.capture_s > 0 and counters["capture_s"] == round(graphs.capture_s, 3)


def test_the_padding_is_its_own_document_with_a_zero_gradient():
    """A bucket's padding, filled with anything finite, changes no real token's output or gradient."""
    batch = _batch([100, 60], seed=3)  # 160 tokens in the 256 bucket
    packed, graphs = _packed_graphs()
    model = _model()
    for s in (packed, FusedLoRA(), graphs):
        assert s.attach(model)
    entry = next(g for g in graphs._graphs.values()) if graphs._graphs else None
    assert entry is None
    model(**batch).loss.backward()
    entry = next(iter(graphs._graphs.values()))
    assert entry.x.shape[1] == 256
    shared = graphs._shared[256]
    assert shared.cu_q[:4].tolist() == [0, 100, 160, 256]  # the real documents, then the padding's end
    assert set(shared.cu_q[4:].tolist()) == {256}  # zero-length documents after it
    assert torch.count_nonzero(entry.grad_out[:, 160:]) == 0
    assert torch.count_nonzero(entry.x[:, 160:]) == 0


def test_a_second_forward_before_the_backward_is_refused():
    model = _model()
    packed, graphs = _packed_graphs()
    speedups = [packed, FusedLoRA(), graphs]
    for s in speedups:
        s.attach(model)
    batch = _batch([100, 60], seed=1)
    first = model(**batch).loss
    model(**batch).loss.backward()
    with pytest.raises(RuntimeError, match="forward again before the backward"):
        first.backward()


class _Pools(TapeBackend):
    """Tapes, with a new object for each pool asked for: which graphs share a pool shows on a CPU."""

    def pool(self):
        return object()


def test_every_buckets_kept_graphs_share_one_pool():
    """A bucket's kept graphs keep nothing alive between a forward and its backward but for that pair, and no other
    bucket's replays come between them in training: every bucket's first capture goes into the run's one kept pool
    (on a GPU its memory is one bucket's activations, not each bucket's)."""
    model = _model()
    packed = PackedAttention(kernel="sdpa")
    graphs = CudaGraphs(mode=True, backend=_Pools(), packed=packed)
    _attached(model, graphs)
    for seed, lengths in enumerate(BATCHES):  # buckets 384, 384, 256, 384
        _step(model, _batch(lengths, seed))
    pools = {id(g.pool) for g in graphs._graphs.values()}
    assert graphs.captured == 8 and len(graphs._pooled) == 2 and pools == {id(graphs._kept_pool)}


def test_kept_graphs_keep_no_output_and_one_input_per_layer_outside_the_pool():
    """What kept graphs hold for good outside the activations: the layers of a bucket copy their output and input
    gradient into one pair of buffers (each replay's cloned out before the next), and a layer's static input of
    every bucket is a view of one buffer of its own, sized by the run's largest bucket. The eager numbers
    throughout, padded rows and a second bucket included."""
    batches = [_batch(lengths, seed) for seed, lengths in enumerate(BATCHES)]  # buckets 384, 384, 256, 384
    expected = _plain(batches)
    _, graphs = _packed_graphs()
    model = _model()
    _attached(model, graphs)
    graphs._runner.max_tokens = 500  # as the plan's first look sets it: the largest bucket is 512
    got = [_step(model, batch) for batch in batches]
    layers = 4
    kept = [g for g in graphs._graphs.values() if hasattr(g, "fwd")]
    assert len(kept) == 3 * layers  # buckets 512 (the first capture), 384 and 256
    for bucket in {g.x.shape[1] for g in kept}:
        of_bucket = [g for g in kept if g.x.shape[1] == bucket]
        grad_x = {g.grads[0].data_ptr() for g in of_bucket if g.x.requires_grad}  # layer 0's input needs none
        assert len({g.out.data_ptr() for g in of_bucket}) == 1 and len(grad_x) == 1
    for i in range(layers):
        inputs = [g.x for (j, _), g in graphs._graphs.items() if j == i and g in kept]
        assert len({x.untyped_storage().data_ptr() for x in inputs}) == 1, i
        assert {x.untyped_storage().nbytes() for x in inputs} == {512 * inputs[0].shape[-1] * 4}
    for (loss, grads), (ref_loss, ref_grads) in zip(got, expected):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0)
        _close([grads], [ref_grads])


def _summed(model, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """The forwards of ``batches``, then one backward of their summed losses (a loop that sums two losses): the
    loss and the gradients."""
    model.zero_grad(set_to_none=True)
    loss = sum(model(**batch).loss for batch in batches)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _plain_model() -> torch.nn.Module:
    model = _model()
    for s in (PackedAttention(kernel="sdpa"), FusedLoRA()):
        s.attach(model)
    return model


def test_a_forward_of_another_bucket_before_the_backward_runs_eagerly():
    """Two forwards before their backwards (a loop that sums two losses): with one pool for every bucket, the
    second bucket's replay would write over what the first bucket's backward still needs. Its layers run eagerly;
    the numbers are the eager layers'. Once the first backward ran, the second bucket replays again."""
    first, second = _batch([200, 100], seed=1), _batch([100, 60], seed=2)  # buckets 384 and 256

    def summed(model):
        return _summed(model, [first, second])

    expected = summed(_plain_model())
    _, graphs = _packed_graphs()
    model = _model()
    _attached(model, graphs)
    _step(model, second)  # the 256 bucket captured
    got = summed(model)
    layers = 4
    assert graphs.eager == {graphs_mod.OTHER_TURN.text: layers}
    assert got[0] == pytest.approx(expected[0], rel=1e-5, abs=0)
    _close([got[1]], [expected[1]])
    before = graphs.replays
    _step(model, second)
    assert graphs.replays == before + layers and graphs.eager == {graphs_mod.OTHER_TURN.text: layers}
    model(**first)  # a forward never backpropagated: its turn ends with its autograd graph
    _step(model, second)
    assert graphs.replays == before + 3 * layers and graphs.eager == {graphs_mod.OTHER_TURN.text: layers}
    # a second backward after another bucket's forward: that forward may have written over this one's activations
    loss = model(**first).loss
    loss.backward(retain_graph=True)
    _step(model, second)
    with pytest.raises(RuntimeError, match="came after a forward of another bucket"):
        loss.backward()


def test_two_forwards_of_one_bucket_before_their_backwards_give_checkpointed_layers_the_eager_numbers():
    """Checkpointed layers' graphs (``cuda_graphs_checkpointed``) keep only each layer's input, so two forwards of
    one bucket may run before their backwards (a loop that sums two losses). Each backward puts its forward's
    metadata back into the bucket's static buffers before its recompute (the second forward loaded its own), and
    hands autograd a copy of the layer's shared gradient buffers while the other backward is still to replay into
    them: the eager layers' loss and gradients."""
    first, second = _batch([200, 100, 50], seed=5), _batch([60, 300], seed=6)  # both in the 384 bucket

    def summed(model):
        return _summed(model, [first, second])

    expected = summed(_plain_model())
    _, graphs = _packed_graphs(checkpointed=True)
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _attached(model, graphs)
    for seed in range(2):  # the first step measures the layers, the second captures their graphs
        _step(model, _batch([120, 80, 100], seed=seed))
    layers, before = 4, graphs.checkpointed_replays
    assert graphs.captured == layers and before == layers
    got = summed(model)
    assert graphs.checkpointed_replays == before + 2 * layers and graphs.eager == {}
    assert got[0] == pytest.approx(expected[0], rel=1e-5, abs=0)
    _close([got[1]], [expected[1]])
    assert [g.awaiting for g in graphs._grads.values()] == [0] * layers
    # a forward never backpropagated stops counting with its autograd graph; a retained graph backpropagated twice
    # counts once: neither leaves a later pair of forwards uncounted or counted for good
    model(**first)
    assert [g.awaiting for g in graphs._grads.values()] == [0] * layers
    loss = model(**second).loss
    loss.backward(retain_graph=True)
    loss.backward()
    assert [g.awaiting for g in graphs._grads.values()] == [0] * layers
    again = summed(model)
    assert again[0] == pytest.approx(expected[0], rel=1e-5, abs=0)
    _close([again[1]], [expected[1]])


class _Warmups(TapeBackend):
    """Tapes that count the warm-ups (each a whole eager forward and backward of a layer)."""

    def __init__(self) -> None:
        self.warm_ups = 0

    def warm_up(self, fn, device):
        self.warm_ups += 1
        fn()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_capture_warms_up_each_layer_shape_once(checkpointed):
    """A warm-up (an eager forward and backward, so kernels and workspaces exist before the capture) is a whole
    layer step: one capture call warms up one layer of each shape (class, attention type, parameters, whether its
    input needs grad) and captures the others of that shape on what it made, once they have run eagerly before (a
    layer's first call sets up what it sets up outside a graph). The numbers stay the eager layers'."""
    batches = [_batch(lengths, seed) for seed, lengths in enumerate(BATCHES)]
    plain_model = _model(wide_mlp=2)
    for s in (PackedAttention(kernel="sdpa"), FusedLoRA()):
        s.attach(plain_model)
    expected = [_step(plain_model, b) for b in batches]
    backend = _Warmups()
    graphs = CudaGraphs(mode=True, backend=backend, packed=PackedAttention(kernel="sdpa"), checkpointed=checkpointed)
    model = _model(wide_mlp=2)
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _attached(model, graphs)
    got = [_step(model, b) for b in batches]
    assert graphs.counters()["captures"] == 2 and graphs.eager == {}  # buckets 384 and 256
    if checkpointed:  # step 1 ran every layer (measured); inputs need grad; a warm-up runs with grad and without
        assert graphs.checkpointed_replays == 4 * 3 and backend.warm_ups == 2 * 2 * 2
    else:  # the first capture is every layer's first call; then layer 0 (its input needs no grad), layers 1 and 3,
        assert graphs.replays == 4 * 4 and backend.warm_ups == 4 + 3  # layer 2 (its MLP twice as wide)
    for (loss, grads), (want_loss, want_grads) in zip(got, expected):
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=0)
        _close([grads], [want_grads])


def test_the_pools_bytes_are_counted_by_kind():
    """What explains an out-of-memory under graphs: the reserved bytes of each kind of pool, from the allocator's
    snapshot (every segment of a pool, whatever its blocks hold); the default pool's are not the graphs'."""
    graphs = CudaGraphs(mode=True)
    assert graphs.pool_bytes() == {} and "pools_mib" not in graphs.counters()  # no pools
    graphs._kept_pool, graphs._own_pools, graphs._recompute_pool = (0, 1), [(0, 2), (0, 4)], (0, 3)
    mib = 2**20
    segments = [{"segment_pool_id": pool, "total_size": size * mib} for pool, size in
                [((0, 0), 500), ((0, 1), 64), ((0, 1), 20), ((0, 2), 8), ((0, 3), 300), ((0, 4), 2), ((0, 9), 7)]]
    assert graphs.pool_bytes(segments) == {"kept": 84 * mib, "kept_late": 10 * mib, "recompute": 300 * mib}


def test_a_capture_into_the_kept_pool_needs_what_the_pools_earlier_captures_did_not_free():
    """Sizing a capture into the kept pool: its layers' activations only beyond what earlier captures into the pool
    took (freed between replays; outputs and input gradients go to buffers outside it); a capture of its own pool,
    or of a bucket larger than any the pool held (its tensors do not fit the smaller freed blocks), needs all of
    it."""
    graphs = CudaGraphs(mode=True)
    graphs.memory.layer_bytes, graphs.memory.layer_bucket = 100 * 4096, 4096
    assert graphs.memory.need(4096, layers=3) == 3 * 100 * 4096  # a pool of their own
    assert graphs.memory.need(4096, layers=3, taken=0) == 3 * 100 * 4096  # an empty kept pool
    graphs.memory.kept_activations, graphs.memory.kept_tokens = 4 * 100 * 4096, 4096  # four layers at 4096
    assert graphs.memory.need(2048, layers=4, taken=0) == 0  # half the tokens: it fits in what was freed
    assert graphs.memory.need(2048, layers=4, taken=6) == 2 * 100 * 2048  # beyond eight layers at 2048: two more
    assert graphs.memory.need(4096, layers=1, taken=4) == 100 * 4096  # a fifth layer: beyond the pool's earlier captures
    assert graphs.memory.need(8192, layers=4, taken=0) == 4 * 100 * 8192  # a larger bucket: all of it
    graphs.memory.layer_bytes = None
    assert graphs.memory.need(2048, taken=0) is None  # nothing measured: nothing to size by


def test_calls_a_graph_cannot_take_run_eagerly_with_their_reason():
    """Training calls a graph cannot take run eagerly, counted by reason. Calls outside training (eval, no grad)
    never reach the graphs: the runner calls the layer's own forward, which gives the same output as without it."""
    model = _model()
    packed, graphs = _packed_graphs(max_tokens=256)
    for s in (packed, FusedLoRA(), graphs):
        s.attach(model)
    runner = graphs._runner
    many_docs = _batch([6] * 40, seed=4)  # 40 documents: above the 256 bucket's 32
    long_row = _batch([200, 100], seed=5)  # 300 tokens: above max_tokens
    model(**many_docs).loss.backward()
    model(**long_row).loss.backward()
    assert runner.forwards == 2 and all(p.graphed for p in runner.plans)
    model.eval()
    short = _batch([100], seed=6)  # a row the graphs would take in training
    with torch.no_grad():
        evaluated = model(**short).logits
        training_with_no_grad = model.train()(**short).logits
    assert runner.forwards == 2  # neither was a training forward of the runner
    assert graphs.replays == 0 and graphs.captured == 0
    assert graphs.eager == {"more documents than the bucket holds": 4, "more than 256 tokens": 4}  # 4 layers
    graphs.detach()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(**short).logits, evaluated, rtol=0, atol=0)
        torch.testing.assert_close(model.train()(**short).logits, training_with_no_grad, rtol=0, atol=0)


def test_graphs_not_handed_the_packed_attention_run_eagerly():
    """The graphs read a forward's packed metadata through the ``PackedAttention`` they are given (its runs, by the
    forward's ``cu_seq_lens_q``): without one, attached beside them or not, every call is eager, and says why."""
    model = _model()
    graphs = CudaGraphs(mode=True, backend=TapeBackend())
    for s in (PackedAttention(kernel="sdpa"), FusedLoRA(), graphs):
        assert s.attach(model)
    model(**_batch([100, 60], seed=1)).loss.backward()
    assert graphs.replays == 0 and graphs.captured == 0
    assert graphs.eager == {"no packed metadata (cached_packing off)": 4}  # 4 layers


def test_a_layer_with_hooks_inside_runs_eagerly():
    """A hook runs in Python: a graph would run it once, at capture. The layer's own hooks run around the replay."""
    model = _model()
    packed, graphs = _packed_graphs()
    for s in (packed, FusedLoRA(), graphs):
        s.attach(model)
    layers = model.get_base_model().model.layers
    seen = []
    layers[1].self_attn.register_forward_pre_hook(lambda *a: seen.append(1))
    layers[2].register_forward_hook(lambda *a: seen.append(2))
    for seed in range(2):
        model(**_batch([100, 60], seed=seed)).loss.backward()
    assert graphs.eager == {"hooks inside the layer": 2}
    assert seen == [1, 2, 1, 2]
    assert graphs.replays == 6


def test_auto_graphs_only_buckets_small_enough_for_the_launches_to_matter(monkeypatch):
    """'auto' bounds a bucket by a layer's parameters x its tokens (large layers keep the GPU busy anyway)."""
    per_layer = graphs_mod.layer_parameters(_model().get_base_model().model.layers[0])
    monkeypatch.setattr(graphs_mod, "AUTO_MAX_WORK", per_layer * 300)
    model = _model()
    packed, graphs = _packed_graphs(mode="auto")
    for s in (packed, FusedLoRA(), graphs):
        assert s.attach(model)
    assert graphs.max_tokens == 300
    model(**_batch([100, 100], seed=0)).loss.backward()  # 200 tokens: the 256 bucket
    model(**_batch([200, 100], seed=1)).loss.backward()  # 300 tokens: the 384 bucket, above the bound
    assert graphs.replays == 4 and graphs.eager == {"more than 300 tokens": 4}
    monkeypatch.setattr(graphs_mod, "AUTO_MAX_WORK", per_layer * 100)  # not even the smallest bucket
    assert CudaGraphs(mode="auto", backend=TapeBackend()).attach(_model()) is False
    assert CudaGraphs(mode=True, backend=TapeBackend()).attach(_model()) is True  # True: every bucket up to max_tokens


def test_another_layer_is_captured_only_while_the_step_keeps_its_headroom(monkeypatch):
    """What is not reserved of the process's limit, less the graphs asked for (a layer's measured graphs scaled to the
    bucket), must stay above 10% of the limit and above the step's peak so far less what it holds now (the run's
    budget, ``Budget.graphs_room``, from its readings: the limit, the peak, allocated now). Reserved, not allocated:
    the graphs' pools keep their memory between replays, and no other allocation can use it."""
    gib = 2**30
    readings = {"peak": 25 * gib, "limit": 32 * gib, "reserved": 20 * gib}
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: readings["reserved"])
    runner = LayerRunner()
    runner.budget = Budget(cuda, readings=lambda device: (readings["limit"], readings["peak"], 20 * gib))
    memory = GraphMemory(runner)
    memory.layer_bytes, memory.layer_bucket = 1 * gib, 4096
    readings.update(limit=100 * gib)
    assert memory.problem(cuda, 4096) is None  # 80 - 1 >= max(10, 25 - 20)
    readings.update(limit=32 * gib)
    assert memory.problem(cuda, 4096) is None  # 12 - 1 >= max(3.2, 5)
    assert memory.problem(cuda, 4096, layers=8) is not None  # 12 - 8 < 5
    assert memory.problem(cuda, 2048, layers=8) is None  # 12 - 4 >= 5: half the bucket, half the bytes
    readings.update(reserved=27 * gib)  # 7 GiB held by pools, not by tensors
    memory.pools_reserved = 7 * gib
    assert "5.0 GiB not reserved" in memory.problem(cuda, 4096)
    memory.pools_reserved = 0
    readings.update(reserved=20 * gib, peak=32 * gib)
    assert "12.0 GiB stay free" in memory.problem(cuda, 4096)  # the step may still need 12 GiB more
    readings.update(peak=20 * gib, limit=31.5 * gib)
    assert memory.problem(cuda, 4096) is None  # 11.5 - 1 >= 3.15
    readings.update(limit=22 * gib)
    assert "2.2 GiB stay free" in memory.problem(cuda, 4096)  # 2 - 1 < 10% of the limit
    memory.layer_bytes = None
    assert memory.problem(cuda, 4096) is None  # the first layer: nothing to size by yet
    memory.layer_bytes = 1 * gib
    runner.budget = Budget(torch.device("cpu"))  # off CUDA: no readings, nothing refused
    assert memory.problem(torch.device("cpu"), 4096) is None


def test_kept_graphs_are_refused_by_what_the_pools_reserve_not_by_the_allocators_cache(monkeypatch):
    """A kept layer's graphs are asked for by what the pools reserve (none before the first capture, read after each)
    and what tensors hold (``Budget.graphs_room(pools=)``): the cache that serves the step's own peak does not count
    twice, at the first capture as at later ones. Recompute graphs keep counting from what tensors hold."""
    gib = 2**30
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: 27 * gib)  # 20 held by tensors, 2 by pools
    runner = LayerRunner()
    runner.budget = Budget(cuda, readings=lambda device: (32 * gib, 25 * gib, 20 * gib))
    memory = GraphMemory(runner)
    memory.layer_bytes, memory.layer_bucket = 1 * gib, 4096
    assert memory.problem(cuda, 4096) is None  # no pools yet: 32 - 20 - 1 >= 5
    assert "12.0 GiB not reserved" in memory.problem(cuda, 4096, layers=8)  # 32 - 20 - 8 < 5
    memory.pools_reserved = 2 * gib
    assert memory.problem(cuda, 4096) is None  # 32 - 22 - 1 >= 5
    assert memory.problem(cuda, 4096, layers=6) is not None  # 32 - 22 - 6 < 5


def test_a_layers_first_capture_counts_its_gradient_buffers(monkeypatch):
    """A graphed layer's backward writes its parameters' gradients into buffers of the layer's own, made at its first
    capture and shared by its graphs of every bucket (small with LoRA, a layer's size in a full fine-tune). That
    capture asks the budget for them beside the activations; later buckets' do not."""
    gib = 2**30
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: 20 * gib)
    runner = LayerRunner()
    runner.budget = Budget(cuda, readings=lambda device: (32 * gib, 20 * gib, 20 * gib))
    memory = GraphMemory(runner)
    memory.layer_bytes, memory.layer_bucket = 1 * gib, 4096
    assert memory.problem(cuda, 4096, grads=7 * gib) is None  # 12 - 8 >= 3.2
    assert memory.problem(cuda, 4096, grads=8 * gib) is not None  # 12 - 9 < 3.2
    assert memory.problem(cuda, 4096, stands_in=True, grads=8 * gib) is None  # recompute: the plan's reserve

    asked = []
    _, graphs = _packed_graphs()
    model = _model()
    _attached(model, graphs)
    monkeypatch.setattr(GraphMemory, "problem", lambda self, device, bucket, layers=1, **kw: asked.append(
        (layers, kw.get("grads"))) or None)
    graphs.memory.layer_bytes, graphs.memory.layer_bucket = 1, 256  # as a CUDA capture measures them (not the CPU tape)
    _step(model, _batch([120, 80, 100], seed=1))
    layer = graphs._layers[0].module
    lora = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if "lora_" in n)
    hidden = layer.self_attn.q_proj.in_features
    static_x = 384 * hidden * 4  # each layer's static input at the bucket (the plan's max_tokens unknown here), fp32
    # the run's first capture (nothing to fall back to): each layer, its buffers beside its activations
    assert graphs.captured == 4 and lora > 0 and asked == [(1, lora + static_x)] * 4, asked
    asked.clear()
    _step(model, _batch([120, 80], seed=2))  # another bucket: the layers' buffers are there already
    # whether the bucket fits at all (every kept layer's, before falling back to a larger bucket), then each layer
    assert graphs.captured == 8 and asked == [(4, 0)] + [(1, 0)] * 4
    assert all(graphs._graphs[(0, v)].grads_into is graphs._grads[0] for (i, v) in graphs._graphs if i == 0)


def test_recompute_graphs_are_sized_by_the_plan_and_count_from_what_tensors_hold(monkeypatch):
    """A checkpointed layer's recompute graphs hold one layer's activations in one pool for the run: sized by the
    plan's measured cost of keeping a layer (at its longest micro-batch) scaled to the tokens the pool grows by, and
    counted from what tensors hold, not what the allocator reserved: the pool stands in for the eager recompute's
    allocations, and the cached blocks are given back first where they are in the way."""
    from nbkit.speedups.layer_plan import UNSIZED, LayerCost

    gib = 2**30
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: 30 * gib)  # the cache holds 10 GiB
    runner = LayerRunner()
    runner.budget = Budget(cuda, readings=lambda device: (32 * gib, 25 * gib, 20 * gib))
    memory = GraphMemory(runner)
    assert memory.problem(cuda, 4096, stands_in=True) is None  # nothing measured yet: nothing to size by
    runner.costs, runner.max_tokens = [LayerCost(4 * gib, 2 * gib, 0), LayerCost(UNSIZED, UNSIZED, 0)], 4096
    assert memory.recompute_need(1024) == 1 * gib  # the largest measured layer, at a quarter of its tokens
    assert memory.problem(cuda, 1024, stands_in=True) is None  # 32 - 20 - 1 >= max(3.2, 5)
    assert memory.problem(cuda, 1024) is None  # kept graphs: sized by what graphs measured (none yet)
    assert runner.budget.cache_in_the_way(memory.recompute_need(1024))  # 32 - 30 - 1 < 5: the cache goes first
    assert "no memory" in memory.problem(cuda, 8192, stands_in=True)  # 32 - 20 - 8 < 5


def test_the_plan_holds_back_nothing_for_layers_whose_hooks_keep_them_eager():
    """What the plan leaves free for the checkpointed layers' graphs counts each graphable layer's gradient buffers,
    but not a layer with hooks inside: it runs eagerly whatever the plan (``HOOKED``), so its graphs never come."""
    from nbkit.speedups.layer_plan import LayerCost
    from nbkit.speedups.layer_runner import Layer

    decoder = _model().base_model.model.model.layers
    runner = LayerRunner()
    runner.layers = [Layer(i, m, m.forward, f"layer {i}", checkpointed=True, graphable=True)
                     for i, m in enumerate(decoder)]
    runner.costs, runner.max_tokens = [LayerCost(1 << 20, 1 << 19, 1 << 10)] * len(decoder), 512
    graphs = CudaGraphs(mode=True, checkpointed=True)
    graphs._runner = runner
    per_layer = sum(p.numel() * p.element_size() for p in trainable_parameters(decoder[0]))
    full = graphs.recompute_reserve(runner)
    hook = decoder[1].mlp.register_forward_hook(lambda *a: None)
    try:
        assert full - graphs.recompute_reserve(runner) == per_layer > 0
    finally:
        hook.remove()
    assert graphs.recompute_reserve(runner) == full


def test_a_kept_capture_that_counts_on_the_cache_gives_it_back_first(monkeypatch):
    """With the pools' reserved bytes known, the budget lets kept graphs count on the allocator's cached blocks (they
    serve the step's peak); a capture cannot take from them (the allocator gives none back while it is under way),
    so where only they are in the way they are given back before the capture."""
    gib = 2**30
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: 29 * gib)  # 20 tensors, 2 pools, 7 cached
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    runner = LayerRunner()
    runner.budget = Budget(cuda, readings=lambda device: (32 * gib, 25 * gib, 20 * gib))
    memory = GraphMemory(runner)
    memory.pools_reserved = 2 * gib
    memory.give_back_cache(cuda, 1 * gib)  # 32 - 22 - 1 >= 5 with the cache given back, not beside it
    assert emptied == [1]
    memory.give_back_cache(cuda, 6 * gib)  # fits neither way: the capture is refused, not helped
    memory.give_back_cache(cuda, None)  # nothing measured yet
    memory.give_back_cache(torch.device("cpu"), 1 * gib)
    assert emptied == [1]


class _FailingAt(TapeBackend):
    """Tapes whose ``n``-th graph fails to capture (an op a graph cannot hold)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def capturing(self, graph, pool):
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capturing(graph, pool)


def test_a_failed_capture_leaves_its_layers_eager_with_the_eager_numbers_and_no_buffers():
    batches = [_batch(lengths, seed) for seed, lengths in enumerate(BATCHES)]
    expected = _plain(batches)
    graphs = CudaGraphs(mode=True, backend=_FailingAt(3), packed=PackedAttention(kernel="sdpa"))
    model = _model()
    _attached(model, graphs)
    got = [_step(model, b) for b in batches]
    # the 384 bucket's capture fails at layer 2: layers 0-2 stay eager there, layer 3 captures at its call
    assert graphs.eager == {"capture failed": 3 * 3} and graphs.captured == 1 + 4
    for (loss, grads), (want_loss, want_grads) in zip(got, expected):
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=0)
        _close([grads], [want_grads])
    graphs = CudaGraphs(mode=True, backend=_FailingAt(3), packed=PackedAttention(kernel="sdpa"))
    model = _model()
    _attached(model, graphs)
    _step(model, batches[0])
    assert graphs.captured == 1 and sorted(graphs._grads) == [3]  # no graphs write layers 0-2's: none are kept


def test_every_buckets_graphs_of_a_full_fine_tune_share_one_set_of_gradients():
    """A full fine-tune's gradients are the layer's size: its graphs of every bucket write them into one set of
    buffers, and the numbers stay the eager layers'."""
    def full(model):
        return model.train()

    batches = [_batch(lengths, seed) for seed, lengths in enumerate(BATCHES)]
    plain = full(tiny_model("qwen3", VOCAB, seed=0))
    PackedAttention(kernel="sdpa").attach(plain)
    expected = [_step(plain, b) for b in batches]
    packed, graphs = _packed_graphs()
    model = full(tiny_model("qwen3", VOCAB, seed=0))
    for s in (packed, graphs):
        assert s.attach(model)
    got = [_step(model, b) for b in batches]
    assert graphs.captured == 8 and graphs.eager == {}  # buckets 384 and 256
    layer = graphs._layers[1].module
    buffers = [t.data_ptr() for t in graphs._grads[1]]
    for bucket in (384, 256):  # the static gradients each bucket's backward returns: the input's, then the buffers
        entry = next(e for (i, v), e in graphs._graphs.items() if i == 1 and v.bucket == bucket)
        assert [t.data_ptr() for t in entry.grads[1:]] == buffers
    assert sum(t.numel() for t in graphs._grads[1]) == sum(p.numel() for p in layer.parameters())
    for (loss, grads), (want_loss, want_grads) in zip(got, expected):
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=0)
        _close([grads], [want_grads])
    # a forward never backpropagated, and a retained graph backpropagated twice, leave no forward counted as awaiting
    model(**batches[0])
    loss = model(**batches[1]).loss
    assert [g.awaiting for g in graphs._grads.values()] == [1] * 4
    loss.backward(retain_graph=True)
    loss.backward()
    assert [g.awaiting for g in graphs._grads.values()] == [0] * 4


def _attached(model, graphs):
    for s in (graphs.packed, FusedLoRA(), graphs):
        assert s.attach(model)


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _plain(batches):
    model = _plain_model()
    return [_step(model, b) for b in batches]


def test_a_row_whose_bucket_does_not_fit_replays_a_larger_captured_one(monkeypatch):
    """Near the limit a new bucket's pools beside the others' run the GPU out of memory: a row whose own bucket cannot
    be captured replays the smallest captured bucket that holds it, padded, with the eager layers' numbers."""
    batches = [_batch([256, 128], seed=1), _batch([120, 80], seed=2)]  # buckets 384, then 256
    expected = _plain(batches)
    _, graphs = _packed_graphs()
    model = _model()
    _attached(model, graphs)
    monkeypatch.setattr(GraphMemory, "problem",
                        lambda self, device, bucket, layers=1, **kw: "no memory" if bucket < 384 and layers > 1 else None)
    got = [_step(model, batches[0])]
    graphs.memory.layer_bytes = 1  # as a CUDA capture measures it (the CPU tape does not)
    got.append(_step(model, batches[1]))
    layers = 4
    assert graphs.captured == layers and graphs.reused == 1  # no capture at 256: the 384 graphs replayed
    assert graphs.replays == 2 * layers and graphs.eager == {} and graphs.recomputed == 0
    for (loss, grads), (ref_loss, ref_grads) in zip(got, expected):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0)
        _close([grads], [ref_grads])


def test_the_runs_first_capture_is_of_its_largest_bucket(caplog):
    """The kept pool is sized once: the run's first capture is of the bucket of the plan's ``max_tokens`` (the longest
    micro-batch, which the plan sizes kept activations by), the row that asked for it replayed padded; a shorter row's
    own bucket is captured at its next call (into the blocks the largest one frees), a longer row replays the first
    graphs. The eager layers' numbers throughout."""
    batches = [_batch([120, 80], seed=1), _batch([150, 50], seed=2), _batch([500, 400], seed=3)]
    expected = _plain(batches)
    _, graphs = _packed_graphs()
    model = _model()
    _attached(model, graphs)
    graphs._runner.max_tokens = 1000  # as the plan's first look sets it (the longest micro-batch)
    with caplog.at_level("DEBUG", logger="nbkit.speedups.cuda_graphs"):
        got = [_step(model, batch) for batch in batches]
    layers = 4
    captured = [line for line in caplog.text.splitlines() if "layers captured at" in line]
    assert len(captured) == 2 and "captured at 1024 tokens" in captured[0] and "captured at 256 tokens" in captured[1]
    assert "the first capture is of the 1024-token bucket" in caplog.text
    assert graphs.captured == 2 * layers and graphs.replays == 3 * layers and graphs.eager == {}
    assert graphs.reused == 0  # not for want of memory
    for (loss, grads), (ref_loss, ref_grads) in zip(got, expected):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0)
        _close([grads], [ref_grads])


def test_near_the_limit_smaller_buckets_fit_in_the_pool_the_largest_one_sized(monkeypatch):
    """Under a small card's limit the first capture (the largest bucket) sets the device's peak: its pool's
    activations, all alive at once. That pool stays reserved and is counted there; were its peak also counted as the
    step's, no smaller bucket would fit and every shorter row would replay the largest graphs padded. A smaller
    bucket, which fits in the blocks the largest one frees, is captured; a bucket is refused again once the step's
    own peak leaves no room. The eager layers' numbers throughout."""
    gib = 2**30
    batches = [_batch([120, 80], seed=1), _batch([150, 50], seed=2), _batch([300, 60], seed=3)]  # 1024*, 256, 384
    expected = _plain(batches)
    _, graphs = _packed_graphs()
    model = _model()
    _attached(model, graphs)
    state = {"peak": 4 * gib, "pools": 0}  # 15 GiB limit, 3 held by tensors
    monkeypatch.setattr(layer_budget, "gpu_reserved", lambda device: 3 * gib + state["pools"])
    monkeypatch.setattr(layer_budget, "restart_peak", lambda device: None)
    graphs._runner.budget = Budget(torch.device("cuda", 0), readings=lambda device: (15 * gib, state["peak"], 3 * gib))
    graphs._runner.max_tokens = 1000  # as the plan's first look sets it: the first capture is of the 1024 bucket
    capture_from = CudaGraphs._capture_from

    def capture(self, *args, **kwargs):  # what a CUDA capture does to the readings (the CPU tape allocates nothing)
        capture_from(self, *args, **kwargs)
        if not state["pools"]:
            state.update(pools=8 * gib, peak=11 * gib)
            self.memory.pools_reserved, self.memory.layer_bytes, self.memory.layer_bucket = 8 * gib, 2 * gib, 1024
            self.memory.kept_activations = 4 * 2 * gib  # 4 layers' at 1024 tokens: a smaller bucket fits in their blocks

    monkeypatch.setattr(CudaGraphs, "_capture_from", capture)
    got = [_step(model, batches[0]), _step(model, batches[1])]
    layers = 4
    assert graphs.captured == 2 * layers and graphs.reused == 0  # 256 captured beside the 1024 graphs
    state["peak"] = 13 * gib  # the step's own peak, outside a capture: 10 GiB above what it holds stay free
    got.append(_step(model, batches[2]))
    assert graphs.captured == 2 * layers and graphs.reused == 1  # 384 refused: replayed on the 1024 graphs
    assert graphs.replays == 3 * layers and graphs.eager == {}
    for (loss, grads), (ref_loss, ref_grads) in zip(got, expected):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0)
        _close([grads], [ref_grads])


@pytest.mark.parametrize("room", [False, True])
def test_an_eager_call_of_a_graphed_layer_recomputes_only_without_room_for_a_second_copy(monkeypatch, room):
    """A graphed layer's pool keeps its activations between replays; when one of its calls runs eagerly (a row above
    every bucket, too many documents), keeping that call's activations too holds them twice. Without room for that
    (``_memory_problem`` for every graphed layer at the call's tokens) the call is checkpointed (its input kept, its
    forward recomputed in backward); with room it keeps them, as an un-checkpointed layer does. The same numbers."""
    asked = []

    def problem(self, device, bucket, layers=1, **kw):
        asked.append((bucket, layers))
        return None if room or bucket <= 256 else "no memory"

    monkeypatch.setattr(GraphMemory, "problem", problem)
    batches = [_batch([200, 56], seed=1), _batch([300, 100], seed=2)]  # 256 tokens: graphs; 400: above max_tokens
    expected = _plain(batches)
    _, graphs = _packed_graphs(max_tokens=256)
    model = _model()
    _attached(model, graphs)
    saved = []
    got = [_step(model, batches[0])]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        got.append(_step(model, batches[1]))
    layers = 4
    hidden = model.base_model.model.config.hidden_size
    assert (400, layers) in asked  # asked once for the forward, for every graphed layer at its 400 tokens
    assert asked.count((400, layers)) == 1
    if room:  # every layer's activations kept: far more than one input a layer
        assert sum(saved) > 400 * hidden * 4 * layers and graphs.recomputed == 0
    else:  # what the eager forward kept: each layer's input and the head's tensors, not every layer's activations
        assert sum(saved) < 400 * hidden * (layers + 8) and graphs.recomputed == layers
    assert graphs.captured == layers
    assert graphs.eager == {"more than 256 tokens": layers}
    for (loss, grads), (ref_loss, ref_grads) in zip(got, expected):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0)
        _close([grads], [ref_grads])


def test_a_4bit_weight_counts_by_its_unpacked_shape():
    class State:
        shape = torch.Size([64, 32])

    layer = torch.nn.Linear(32, 64, bias=False)
    packed = torch.nn.Parameter(torch.zeros(1024, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = State()
    layer.weight = packed
    assert graphs_mod.layer_parameters(layer) == 64 * 32


def test_it_does_not_attach_where_graphs_cannot_repeat_the_step():
    moe = get_peft_model(tiny_model("qwen3_moe", VOCAB), LoraConfig(r=4, target_modules=["q_proj"]))
    assert CudaGraphs(mode=True, backend=TapeBackend()).attach(moe) is False
    dropout = get_peft_model(tiny_model("qwen3", VOCAB, attention_dropout=0.1), LoraConfig(r=4, target_modules=["q_proj"]))
    assert CudaGraphs(mode=True, backend=TapeBackend()).attach(dropout) is False
    lora_dropout = get_peft_model(tiny_model("qwen3", VOCAB), LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1))
    assert CudaGraphs(mode=True, backend=TapeBackend()).attach(lora_dropout) is False
    assert CudaGraphs(mode=True).attach(_model()) is False  # on a CPU without emulation


# ---------------------------------------------------------------------------------------------------------------
# FastSFT: the mode in the layer runner's row, attached at train time, graphing the layers the plan keeps


def _train(tmp_path, monkeypatch, graphs_on: bool, checkpointing: bool, batch: int = 2, accumulation: int = 2,
           tiled: bool = False, steps: int = 3, family: str = "qwen3"):
    built: list[CudaGraphs] = []

    def emulated(args, packed, dataset=None):
        if not graphs_on:
            return None
        built.append(CudaGraphs(mode=True, backend=TapeBackend()))
        return built[-1]

    monkeypatch.setattr("nbkit.speedups.LAYER_MODES", tuple(
        (name, role, emulated if name == "cuda_graphs" else make) for name, role, make in LAYER_MODES))
    tok = load_demo_tokenizer()
    model = tiny_model(family, len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0)
    forwards = []  # training forwards (micro-batches), counted outside the decoder layers
    model.get_input_embeddings().register_forward_hook(lambda m, inputs, output: forwards.append(1) if m.training else None)
    args = FastSFTConfig(
        output_dir=str(tmp_path / f"g{graphs_on}{checkpointing}{family}"), max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
        max_length=128, packing=True, gradient_checkpointing=checkpointing,
        selective_checkpointing=True if checkpointing else False, seed=0, data_seed=0,
        dataloader_num_workers=0, use_cpu=True, bf16=False, fp16=False, tiled_mlp=tiled, tiled_mlp_tokens=16)
    grads = StepGrads()
    trainer = FastSFT(model=model, args=args, train_dataset=make_dataset("messages", n=48), processing_class=tok,
                      peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0),
                      callbacks=[grads])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return (losses, grads.steps, trainer.nbkit_attached, (built[0] if built else None), trainer.nbkit_layer_stats,
            len(forwards))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fastsft_with_graphs_trains_as_without(tmp_path, monkeypatch, checkpointing):
    """Every micro-batch's layers replay, except step 1's under checkpointing: it runs every layer checkpointed, as
    the user asked (a checkpointed layer is never graphed: its recompute would not be); the plan made at the 2nd
    forward keeps them all (selective checkpointing forced, no memory counters on a CPU), and graphs them."""
    plain = _train(tmp_path, monkeypatch, graphs_on=False, checkpointing=checkpointing)
    graphed = _train(tmp_path, monkeypatch, graphs_on=True, checkpointing=checkpointing)
    torch.testing.assert_close(graphed[0], plain[0], rtol=1e-5, atol=0)
    _close(graphed[1], plain[1])
    speedup, stats = graphed[3], graphed[4]
    assert "cuda_graphs" in graphed[2] and "cuda_graphs" not in plain[2]
    layers, forwards = 4, graphed[5]
    assert forwards >= 4 and speedup.replays == layers * (forwards - 1 if checkpointing else forwards) and speedup.captured > 0
    assert speedup.eager == {}  # the runner calls the graphs for graphed layers only: step 1's ran checkpointed
    assert stats["plan"] == f"{layers} layers: {layers} kept ({layers} graphed)"
    assert stats["replays"] == speedup.replays and stats["captured"] == speedup.captured
    assert speedup.capture_s > 0 and stats["capture_s"] == round(speedup.capture_s, 3)
    assert "replays" not in plain[4]
    assert not speedup._graphs  # detached: graphs dropped


@pytest.mark.parametrize("family, batch, accumulation, tiled", [("qwen3", 1, 4, False), ("qwen3", 2, 1, True),
                                                                ("qwen3", 1, 4, True), ("gemma3", 1, 2, False)])
def test_graphs_train_as_without_under_accumulation_and_tiling(tmp_path, monkeypatch, family, batch, accumulation,
                                                               tiled):
    """The cases the first GPU runs got wrong, on the tape backend (Python frozen at capture, as on a GPU): several
    micro-batches of different documents per optimizer step (an attention mask cached outside the capture was read
    stale by every later replay), and tiled MLPs (which held the real parameters while the graph differentiated
    stand-ins: their LoRA weights got no gradient), and gemma3, whose sliding and full layers are handed other
    position embeddings (the full layers replayed on the sliding ones' rope). Per-step losses and every LoRA
    gradient of 4 optimizer steps against the same run without graphs, fp32 to 1e-5."""
    kw = dict(checkpointing=False, batch=batch, accumulation=accumulation, tiled=tiled, steps=4, family=family)
    plain = _train(tmp_path, monkeypatch, graphs_on=False, **kw)
    graphed = _train(tmp_path, monkeypatch, graphs_on=True, **kw)
    torch.testing.assert_close(graphed[0], plain[0], rtol=1e-5, atol=0)
    _close(graphed[1], plain[1])
    speedup = graphed[3]
    assert speedup.replays > 0 and speedup.eager == {}
    assert ("tiled_mlp" in graphed[2]) == tiled


def test_the_mode_is_in_the_layer_runner_and_off_on_a_cpu():
    assert ("cuda_graphs", "graphs") in [(name, role) for name, role, _ in LAYER_MODES]
    build = next(make for name, _, make in LAYER_MODES if name == "cuda_graphs")
    assert build(FastSFTConfig(output_dir="x", use_cpu=True, report_to=[]), True) is None
    assert build(FastSFTConfig(output_dir="x", cuda_graphs=False, report_to=[]), True) is None
    forced = FastSFTConfig(output_dir="x", use_cpu=True, cuda_graphs=True, report_to=[])
    assert isinstance(build(forced, True), CudaGraphs)  # True on a CPU: built, and its attach says why it stays off
    assert build(forced, False) is None  # the graphs read cached_packing's metadata
    row = next(spec for spec in SPEEDUPS if spec.name == "decoder_layers")
    runner = row.build(forced, True)
    assert isinstance(runner, LayerRunner) and isinstance(runner.graphs, CudaGraphs)


def test_forcing_graphs_on_a_cpu_says_why_they_stay_off(caplog):
    with caplog.at_level("WARNING", logger="nbkit.speedups.cuda_graphs"):
        assert CudaGraphs(mode=True).attach(_model()) is False
    assert "not on a CUDA GPU" in caplog.text
    assert graphs_mod.MAX_TOKENS in BUCKETS
