"""Expandable allocator segments for the run: torch's CUDA caching allocator grows a segment in place instead of
``cudaMalloc``-ing new blocks whenever a larger size is asked for.

Why: packed and padding-free rows change length every step. With the allocator's default segments, the first
micro-batch longer than every one before needs blocks larger than any it has cached, so it ``cudaMalloc``s new
segments for the whole activation set while the old ones stay cached: that one step waits for hundreds of
allocations, and reserved memory grows by gigabytes nobody uses again. The first steps of a run pay the same as its
rows grow. Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which torch's memory notes
recommend for exactly this: allocation sizes that change from batch to batch) map more pages into one segment
instead. BENCHMARKS.md, ``expandable_segments``, has the measurement that made this a default.

When: attached with the model stage, as ``train()`` or ``evaluate()`` starts and before the optimizer's state or any
activation is allocated; detached when the call ends. The setting is the allocator's, one per process: attach turns
it on, detach off again (it was off: otherwise attach does nothing). What was allocated before (the loaded weights)
stays where it is; segments made while attached stay in the allocator's cache until freed.

Modes: "auto": on a CUDA GPU under torch's own caching allocator on Linux (expandable segments need CUDA's virtual
memory API: left off on Windows and ROCm), unless the user chose ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF``
/ ``PYTORCH_ALLOC_CONF``, or through torch's setter where torch can read its settings back (not torch 2.11): theirs
is kept, either way; True: on wherever torch takes the setting, unless it is on already; False: never.
Contract: allocation only, so every output and gradient is the same, bit for bit
(tests/gpu/test_expandable_segments_gpu.py); ``detach`` leaves the allocator's setting as found.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any, Callable, Literal, Optional, Union

import torch

from .ledger import PatchLedger

Mode = Union[bool, Literal["auto"]]
SETTING = "expandable_segments"
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch reads the first that is set
_CHOICE = re.compile(rf"{SETTING}\s*:\s*(true|false)", re.IGNORECASE)


def _setter() -> Optional[Callable[[str], None]]:
    """torch's runtime setter of the allocator's settings (``torch._C._accelerator_setAllocatorSettings`` in newer
    releases, ``torch.cuda.memory._set_allocator_settings`` before; None where neither exists)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(getattr(torch.cuda, "memory", None), "_set_allocator_settings", None)
    return setter


def current_settings() -> Optional[str]:
    """The allocator settings torch holds now, as last set (from the environment, or at runtime); None where torch
    cannot say (torch 2.11 cannot; 2.13 can)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    try:
        return None if getter is None else str(getter())
    except Exception:  # noqa: BLE001 - a build without it: the environment decides
        return None


def user_choice() -> Optional[bool]:
    """Whether ``expandable_segments`` was chosen on (True) or off (False), None if never: the last mention in the
    settings torch holds now, else in the environment variable torch reads."""
    env = next((os.environ[name] for name in ENV_VARS if os.environ.get(name)), "")
    for text in (current_settings() or "", env):
        found = _CHOICE.findall(text)
        if found:
            return found[-1].lower() == "true"
    return None


def supported() -> bool:
    """Where "auto" turns it on: a CUDA GPU (not ROCm), Linux, torch's native caching allocator."""
    if sys.platform != "linux" or getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return False
    try:
        return torch.cuda.memory.get_allocator_backend() == "native"
    except Exception:  # noqa: BLE001 - an allocator torch cannot name: leave it alone
        return False


class ExpandableSegments:
    """The allocator's ``expandable_segments`` setting, on for one ``train()`` / ``evaluate()`` call."""

    name = "expandable_segments"

    def __init__(self, mode: Mode = "auto") -> None:
        self.mode = mode
        self._ledger = PatchLedger(self.name)

    def attach(self, target: Any) -> bool:
        """Turn the setting on (the target is not touched); False when the mode, the platform or the user's own
        choice keeps the allocator as it is."""
        if self._ledger:
            return True
        setter = _setter()
        choice = user_choice()
        if setter is None or choice is True or (self.mode == "auto" and (choice is False or not supported())):
            return False
        found = current_settings()

        def undo() -> None:
            setter(f"{SETTING}:False")
            if found is not None:  # the settings' text as found too, so the next run reads no choice of ours
                with contextlib.suppress(Exception):
                    setter(found)

        setter(f"{SETTING}:True")
        self._ledger.call(f"allocator {SETTING}:True", undo)
        return True

    def detach(self) -> None:
        self._ledger.undo()
