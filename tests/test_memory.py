"""``nbkit.memory``: the one definition of what this process may use on a GPU, and the readings speedups size by.

The CUDA counters are faked (CPU CI): what is checked is the arithmetic of the definition, each case a number that
a wrong definition (the device's total, the free memory alone, the fraction ignored) would get wrong.
"""

from __future__ import annotations

import torch

from nbkit import memory

GIB = 1 << 30


def _fake_gpu(monkeypatch, *, total=80, fraction=1.0, reserved=5, allocated=2, peak=3, free=75) -> torch.device:
    class Props:
        total_memory = total * GIB
        is_integrated = False

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free * GIB, total * GIB))
    return torch.device("cuda", 0)


def test_the_limit_is_what_this_process_can_reach(monkeypatch):
    """Another process on the same GPU (or the CUDA context) holds memory the allocator never sees: the limit is the
    per-process limit, but no more than what the allocator holds plus what the device has free."""
    device = _fake_gpu(monkeypatch, free=10)  # 65 GiB held elsewhere
    assert memory.memory_readings(device) == (15 * GIB, 3 * GIB, 2 * GIB)
    device = _fake_gpu(monkeypatch, free=75)  # the GPU to itself
    assert memory.memory_readings(device) == (80 * GIB, 3 * GIB, 2 * GIB)
    assert memory.memory_readings(torch.device("cpu")) is None and memory.gpu_limit(torch.device("cpu")) is None


def test_a_per_process_fraction_caps_the_limit(monkeypatch):
    device = _fake_gpu(monkeypatch, fraction=0.25, free=75)
    assert memory.process_cap(device) == 20 * GIB
    assert memory.gpu_limit(device) == 20 * GIB
    assert memory.memory_readings(device).limit == 20 * GIB


def test_room_for_a_buffer_is_a_cache_hit_or_twice_it_below_the_limit(monkeypatch):
    device = _fake_gpu(monkeypatch, reserved=5, allocated=2, free=1)
    assert memory.room_for(device, 3 * GIB)  # 3 GiB reserved and unused: a cache hit
    assert not memory.room_for(device, 4 * GIB)  # 1 GiB free < 2 x 4
    device = _fake_gpu(monkeypatch, reserved=5, allocated=5, free=8)
    assert memory.room_for(device, 4 * GIB) and not memory.room_for(device, 5 * GIB)
    device = _fake_gpu(monkeypatch, reserved=5, allocated=5, free=70, fraction=0.1)  # cap 8 GiB: 3 GiB above reserved
    assert not memory.room_for(device, 2 * GIB) and memory.room_for(device, GIB)
    assert memory.room_for(torch.device("cpu"), 1 << 40)


def test_room_for_asks_the_driver_only_on_a_cache_miss(monkeypatch):
    """A cache hit (the common case: the offload lanes ask per layer) is answered from the allocator's host-side
    counters; the device's free memory is a driver query, asked only when the cache cannot serve the buffer."""
    device = _fake_gpu(monkeypatch, reserved=5, allocated=2, free=1)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(1) or (GIB, 80 * GIB))
    assert memory.room_for(device, 3 * GIB) and not asked
    assert not memory.room_for(device, 4 * GIB) and len(asked) == 1


def test_in_use_reads_the_allocator_and_zero_off_cuda(monkeypatch):
    device = _fake_gpu(monkeypatch, allocated=7, reserved=9)
    assert memory.gpu_in_use(device) == 7 * GIB
    assert memory.gpu_reserved(device) == 9 * GIB and memory.gpu_reserved(torch.device("cpu")) == 0
    assert memory.gpu_in_use(torch.device("cpu")) == 0
    assert not memory.shares_host_memory(device) and not memory.shares_host_memory(torch.device("cpu"))
