"""``expandable_segments``: when the allocator's setting is turned on for a run, and that it is left as found (CPU).

The allocator itself is CUDA's (tests/gpu/test_expandable_segments_gpu.py trains with it, bit for bit as without);
here torch's settings are only read and written, which a CPU build does too: "auto" stays off without a CUDA GPU
and keeps a user's own choice, True turns it on unless it is on already, detach restores the settings' text, and
FastSFT attaches it for the call only.
"""

from __future__ import annotations

import pytest
import torch

from nbkit.speedups import expandable_segments as seg
from nbkit.speedups.expandable_segments import ExpandableSegments, current_settings, user_choice

pytestmark = pytest.mark.skipif(current_settings() is None, reason="this torch cannot read its allocator settings")


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch):
    """No allocator configuration from the environment; the settings' text restored after each test."""
    for name in seg.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    before = current_settings()
    yield
    torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
    torch._C._accelerator_setAllocatorSettings(before)


def test_true_turns_it_on_and_detach_leaves_the_settings_as_found():
    speedup = ExpandableSegments(mode=True)
    assert user_choice() is None
    assert speedup.attach(object()) is True
    assert current_settings() == "expandable_segments:True" and user_choice() is True
    speedup.detach()
    assert current_settings() == "" and user_choice() is None  # no choice of ours is left for the next run to read
    speedup.detach()
    assert current_settings() == ""
    assert speedup.attach(object()) is True  # a second run turns it on again
    speedup.detach()


def test_auto_stays_off_without_a_cuda_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ExpandableSegments(mode="auto").attach(object()) is False
    assert current_settings() == ""


def test_auto_turns_it_on_where_supported(monkeypatch):
    monkeypatch.setattr(seg, "supported", lambda: True)
    speedup = ExpandableSegments(mode="auto")
    assert speedup.attach(object()) is True and user_choice() is True
    speedup.detach()
    assert user_choice() is None


@pytest.mark.parametrize("env", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("value", ["expandable_segments:False", "max_split_size_mb:128,expandable_segments:false"])
def test_a_users_choice_in_the_environment_is_kept(monkeypatch, env, value):
    monkeypatch.setattr(seg, "supported", lambda: True)
    monkeypatch.setenv(env, value)
    assert user_choice() is False
    assert ExpandableSegments(mode="auto").attach(object()) is False  # theirs is kept
    speedup = ExpandableSegments(mode=True)  # the switch, set explicitly, wins; the user's off comes back after
    assert speedup.attach(object()) is True
    speedup.detach()
    assert user_choice() is False


def test_on_already_is_left_alone(monkeypatch):
    monkeypatch.setattr(seg, "supported", lambda: True)
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")  # a user's own runtime choice
    for mode in ("auto", True):
        speedup = ExpandableSegments(mode=mode)
        assert speedup.attach(object()) is False
        speedup.detach()
        assert current_settings() == "expandable_segments:True"  # not turned off by a run that did not turn it on


def test_other_allocator_settings_survive_the_run(monkeypatch):
    monkeypatch.setattr(seg, "supported", lambda: True)
    torch._C._accelerator_setAllocatorSettings("max_split_size_mb:128")
    speedup = ExpandableSegments(mode="auto")
    assert speedup.attach(object()) is True
    speedup.detach()
    assert current_settings() == "max_split_size_mb:128"


def test_fastsft_attaches_it_for_the_call_only_and_trains_as_without(monkeypatch, tmp_path, one_thread):
    """On for the call, off after it; the run's losses, gradients and weights bit for bit those of the run without
    (on a CPU the allocator is not CUDA's: this holds the switch to changing nothing else; the GPU test trains with
    the setting really in use)."""
    from parity import BITWISE, assert_same_run, fast_sft, train

    seen: list[bool | None] = []
    real_attach = ExpandableSegments.attach

    def attach(self, target):
        attached = real_attach(self, target)
        seen.append(user_choice())
        return attached

    monkeypatch.setattr(ExpandableSegments, "attach", attach)
    on = train(fast_sft(tmp_path / "on", expandable_segments=True, max_steps=2), grads=True)
    assert seen == [True] and "expandable_segments" in on.trainer.nbkit_attached
    assert user_choice() is None and current_settings() == ""
    off = train(fast_sft(tmp_path / "off", expandable_segments=False, max_steps=2), grads=True)
    assert "expandable_segments" not in off.trainer.nbkit_attached
    assert_same_run(on, off, weights=BITWISE)
