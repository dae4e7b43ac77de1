"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: deterministic sums, and no OpenMP spinning on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fake_display(monkeypatch):
    """IPython's display replaced by a recorder (``dashboard_fakes.FakeDisplay``)."""
    import IPython.display
    from dashboard_fakes import FakeDisplay

    fake = FakeDisplay()
    monkeypatch.setattr(IPython.display, "display", fake)
    return fake


@pytest.fixture
def no_env_mode(monkeypatch):
    """No NBKIT_DASHBOARD from the environment choosing the dashboard's mode."""
    from nbkit.dashboard.mode import ENV_MODE

    monkeypatch.delenv(ENV_MODE, raising=False)


@pytest.fixture
def no_demo_base_above(tmp_path):
    """Fails at once, naming the folder, when a ``nbkit-demo-out/base`` model sits in a folder above ``tmp_path``
    (a demo run from ``/tmp``): ``resolve_base`` searches every folder above an adapter, as documented, so a test
    that expects the demo's relative base to be missing would find that one instead."""
    for root in tmp_path.parents:
        if (root / "nbkit-demo-out" / "base" / "config.json").is_file():
            pytest.fail(f"{root / 'nbkit-demo-out'} is left from a demo run: the export tests' relative base "
                        "'nbkit-demo-out/base' resolves to it; remove it")
