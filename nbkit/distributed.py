"""Every rank's memory for rank 0's dashboard under accelerate (DDP, FSDP2): the one collective nbkit adds.

Why: transformers runs callbacks on every rank, but the dashboard renders only on rank 0, and rank 0 can read only
its own GPU. Tokens/s needs nothing from nbkit: TRL's ``num_tokens`` (the counter the dashboard reads) is already
summed over ranks by ``SFTTrainer.compute_loss`` (``gather_for_metrics`` every step), so rank 0's tokens/s is the
whole job's. Each rank's VRAM does need a gather.

Contract: ``RankMemoryCallback`` does one ``all_gather`` of six int64 per rank at each ``on_log``, on every rank.
It is a collective: it relies on ``on_log`` firing on all ranks at the same steps, which ``Trainer.log`` does
(it is called on every process at each logging step, after evaluation, and once at the end of training). In a
single process there is no collective; ``latest`` is the local reading.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from transformers import TrainerCallback

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


def _host_rss() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def local_memory(device: Any = None) -> RankMemory:
    """This process's reading: CUDA numbers for ``device`` when it is a CUDA device, host RSS always."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        return RankMemory(rank=rank, host_rss=_host_rss())
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return RankMemory(
        rank=rank,
        allocated=int(torch.cuda.memory_allocated(index)),
        reserved=int(torch.cuda.memory_reserved(index)),
        peak=int(torch.cuda.max_memory_allocated(index)),
        total=int(torch.cuda.get_device_properties(index).total_memory),
        host_rss=_host_rss(),
    )


def gather_rank_memory(device: Any = None) -> list[RankMemory]:
    """Every rank's ``local_memory``, in rank order, on every rank. A collective when a process group is up."""
    mine = local_memory(device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
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
    dashboard shows. Add it on every rank (``FastSFT`` would add it when ``args.world_size > 1``)."""

    def __init__(self) -> None:
        self.latest: tuple[RankMemory, ...] = ()
        self.gathers = 0

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001 - TrainerCallback's signature
        self.latest = tuple(gather_rank_memory(getattr(args, "device", None)))
        self.gathers += 1
