"""Stand-ins for IPython's display, shared by the dashboard tests (and their fixture in conftest.py)."""

from __future__ import annotations


class FakeHandle:
    def __init__(self) -> None:
        self.updates: list = []

    def update(self, obj) -> None:
        self.updates.append(obj)


class FakeDisplay:
    """Stands in for IPython.display.display: records each call, returns a handle that records updates."""

    def __init__(self) -> None:
        self.calls: list = []
        self.handles: list[FakeHandle] = []

    def __call__(self, obj, display_id=False):
        self.calls.append(obj)
        handle = FakeHandle()
        self.handles.append(handle)
        return handle if display_id else None
