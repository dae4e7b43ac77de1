"""Stand-ins for IPython's display, a kernel and an ipywidgets 7 widget, shared by the dashboard tests (and their
fixture in conftest.py)."""

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


class FakeCommManager:
    """A kernel's comm manager, as far as ipywidgets 7 uses it when imported: it registers its comm target."""

    def __init__(self) -> None:
        self.targets: dict = {}

    def register_target(self, name, handler) -> None:
        self.targets[name] = handler


class FakeKernel:
    """The kernel of a notebook shell (``get_ipython().kernel``). ipywidgets 7, imported inside a kernel, registers
    its "jupyter.widget" comm target on the kernel's ``comm_manager`` (8 leaves that to the ``comm`` package)."""

    def __init__(self) -> None:
        self.comm_manager = FakeCommManager()


WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"


class Widget7:
    """A widget with ipywidgets 7's display API and none of 8's, as in ipywidgets 7.7.1 (Colab's): no
    ``_repr_mimebundle_``; ``display(widget)`` calls ``_ipython_display_``, which publishes ``text/plain`` and the
    view spec as one raw output, then runs the ``on_displayed`` callbacks; ``close`` unsets ``_ipython_display_``.
    Lets the ipywidgets 7 path run where ipywidgets 8 is installed."""

    _view_name = "VBoxView"

    def __init__(self, model_id: str = "0123abcd") -> None:
        self._model_id = model_id
        self._callbacks: list = []
        self.published: list[dict] = []  # what _ipython_display_ published, one dict per display

    def __repr__(self) -> str:
        return "VBox(children=(HTML(value=''),))"

    def on_displayed(self, callback) -> None:
        self._callbacks.append(callback)

    def _handle_displayed(self, **kwargs) -> None:
        for callback in self._callbacks:
            callback(self, **kwargs)

    def get_view_spec(self) -> dict:
        return {"version_major": 2, "version_minor": 0, "model_id": self._model_id}

    def _ipython_display_(self, **kwargs) -> None:
        self.published.append({"text/plain": repr(self), WIDGET_VIEW_MIME: self.get_view_spec()})
        self._handle_displayed(**kwargs)

    def close(self) -> None:
        self._ipython_display_ = None
