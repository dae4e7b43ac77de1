"""The dashboard and the per-rank reading on a real CUDA device: the numbers come from ``nbkit.memory`` (the same
figures torch reports), a CPU device shows no VRAM even with a GPU present, and steps between renders make no CUDA
memory query. Skipped without CUDA."""

from __future__ import annotations

import io
import types

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MIB = 2**20


@pytest.fixture
def block():
    """256 MiB held on cuda:0 for the test."""
    x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda:0")
    yield x
    del x


def test_the_dashboard_reads_the_training_device_as_torch_reports_it(block):
    from nbkit.dashboard import RunTracker, default_memory_reader, text_line
    from nbkit.memory import device_memory

    reading = default_memory_reader(torch.device("cuda", 0))()
    assert reading.gpu_name == torch.cuda.get_device_name(0)
    assert reading.allocated == torch.cuda.memory_allocated(0) >= 256 * MIB
    assert reading.reserved >= reading.allocated and reading.peak >= reading.allocated
    assert reading.total == device_memory(0).total == torch.cuda.get_device_properties(0).total_memory
    s = RunTracker(0.0, 0, 10).snapshot(1.0, reading)
    assert s.vram_percent > 0 and "VRAM " in text_line(s)
    for cpu in (torch.device("cpu"), None):  # a CPU run on a GPU machine: no made-up VRAM
        assert default_memory_reader(cpu)().total is None


def test_a_ranks_reading_is_its_cuda_device(block):
    from nbkit.distributed import gather_rank_memory, local_memory

    mine = local_memory(torch.device("cuda", 0))
    assert mine.allocated == torch.cuda.memory_allocated(0) and mine.peak >= mine.allocated
    assert mine.total == torch.cuda.get_device_properties(0).total_memory and mine.host_rss > 0
    (only,) = gather_rank_memory("cuda:0")  # no process group: the local row, no collective
    assert only.rank == 0 and only.allocated is not None
    assert local_memory("cpu").allocated is None


def test_steps_between_text_lines_make_no_cuda_memory_query(monkeypatch, block):
    from transformers import TrainerControl, TrainerState

    from nbkit.dashboard import LiveDashboard

    queries = []
    real = torch.cuda.memory_allocated
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: queries.append(1) or real(*a, **k))
    t = [0.0]
    out = io.StringIO()
    d = LiveDashboard(mode="text", clock=lambda: t[0], stream=out, text_interval=2.0)  # the real CUDA reader
    args = types.SimpleNamespace(device=torch.device("cuda", 0), max_steps=1000)
    state = TrainerState(max_steps=1000, num_train_epochs=1)
    d.on_train_begin(args, state, TrainerControl())
    for i in range(1, 1001):  # 9 s of steps: lines due at 0, 2, 4, 6 and 8 s
        t[0] += 0.009
        state.global_step = i
        d.on_step_end(args, state, TrainerControl())
        d.on_log(args, state, TrainerControl(), logs={"loss": 1.0, "num_tokens": float(64 * i)})
    d.on_train_end(args, state, TrainerControl())
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("[nbkit] step")]
    assert len(lines) == 5 and all("VRAM " in ln for ln in lines)
    assert len(queries) == len(lines) + 1  # one reading per line written, one for the summary
    assert "GPU: " + torch.cuda.get_device_name(0) in out.getvalue()
