"""Every rank's memory for rank 0's dashboard under accelerate (DDP, FSDP2): the one collective nbkit adds.

Why: transformers runs callbacks on every rank, but the dashboard renders only on rank 0, and rank 0 can read only
its own GPU. Tokens/s needs nothing from nbkit: both token counters the dashboard reads are already summed over
ranks before they reach the logs (TRL's ``num_tokens``: ``SFTTrainer.compute_loss`` adds the
``gather_for_metrics`` sum of every rank's tokens each step; transformers' ``num_input_tokens_seen``: the
``accelerator.gather`` sum), so rank 0's tokens/s is the whole job's. Each rank's VRAM does need a gather.

Wiring: ``LiveDashboard.attach(trainer)`` adds a ``RankMemoryCallback`` (on every rank) when
``trainer.args.world_size > 1``, and rank 0's dashboard shows its ``latest`` rows.

Contract: ``RankMemoryCallback`` does one ``all_gather`` of six int64 per rank at each ``on_log``, on every rank.
It is a collective: it relies on ``on_log`` firing on all ranks at the same steps, which ``Trainer.log`` does
(it is called on every process at each logging step, after evaluation, and once at the end of training). In a
single process there is no collective; ``latest`` is the local reading. Readings come from ``nbkit.memory``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .memory import device_memory, process_rss

_FIELDS = ("allocated", "reserved", "peak", "total", "host_rss")


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory in bytes; CUDA fields are None when that rank trains on a CPU."""

    rank: int
    allocated: Optional[int] = None  # torch.cuda.memory_allocated
    reserved: Optional[int] = None  # torch.cuda.memory_reserved
    peak: Optional[int] = None  # torch.cuda.max_memory_allocated (never reset here)
    total: Optional[int] = None  # the GPU's total memory
    host_rss: Optional[int] = None  # this process's resident set

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _process_group_up() -> bool:
    return dist.is_available() and dist.is_initialized()


def local_memory(device: Any = None) -> RankMemory:
    """This process's reading: CUDA numbers for ``device`` when it is a CUDA device (None: none), host RSS always."""
    rank = dist.get_rank() if _process_group_up() else 0
    cuda = device_memory(device) if device is not None else None
    if cuda is None:
        return RankMemory(rank=rank, host_rss=process_rss())
    return RankMemory(rank=rank, allocated=cuda.allocated, reserved=cuda.reserved, peak=cuda.peak,
                      total=cuda.total, host_rss=process_rss())


def gather_rank_memory(device: Any = None) -> list[RankMemory]:
    """Every rank's ``local_memory``, in rank order, on every rank. A collective when a process group is up."""
    mine = local_memory(device)
    if not _process_group_up() or dist.get_world_size() == 1:
        return [mine]
    # NCCL moves only CUDA tensors; gloo (CPU training, or the CPU half of a "cuda:nccl,cpu:gloo" group) CPU ones
    on_cuda = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
    where = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    values = [mine.rank] + [-1 if getattr(mine, k) is None else getattr(mine, k) for k in _FIELDS]
    local = torch.tensor(values, dtype=torch.int64, device=where)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    rows = torch.stack(out).cpu().tolist()
    return [RankMemory(int(r[0]), *[None if v < 0 else int(v) for v in r[1:]]) for r in rows]


class RankMemoryCallback(TrainerCallback):
    """Gathers every rank's memory at each log; ``latest`` (a tuple of ``RankMemory``, rank order) is what rank 0's
    dashboard shows. It must be on every rank's trainer (``LiveDashboard.attach`` adds it when
    ``args.world_size > 1``); put it before the dashboard in the callback list so a log's render shows that log's
    gather."""

    def __init__(self) -> None:
        self.latest: tuple[RankMemory, ...] = ()
        self.gathers = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.latest = tuple(gather_rank_memory(getattr(args, "device", None)))
        self.gathers += 1
