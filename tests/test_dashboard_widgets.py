"""Tests for the dashboard's widget output on ipywidgets 7 (Colab ships 7.7.1) and 8: the output that shows the panel
is the one the installed ipywidgets would show (``nbkit.compat.widget_mimebundle``), with the HTML and the text line
beside it; ipywidgets 7's display semantics, checked on a stand-in wherever 8 is installed; and the HTML view taking
over when the widget panel cannot be built or shown. Exact comparisons throughout: nothing here is numeric."""

from __future__ import annotations

import warnings

import pytest
from dashboard_fakes import WIDGET_VIEW_MIME, Widget7
from test_dashboard import ARGS, FakeClock, begin, fixed_memory, step
from transformers import TrainerControl

from nbkit import compat
from nbkit.dashboard import LiveDashboard, views

pytestmark = [pytest.mark.filterwarnings("ignore:LiveDashboard was added with add_callback"),
              pytest.mark.usefixtures("no_env_mode")]


def _formatted(obj) -> dict:
    """The mime bundle a kernel sends for ``obj`` (IPython's own formatter, as ``display`` uses it)."""
    from IPython.core.formatters import DisplayFormatter

    data, _ = DisplayFormatter().format(obj)
    return data


def _ipywidgets_major() -> int:
    import ipywidgets

    return int(ipywidgets.__version__.split(".")[0])


# ---------------------------------------------------------------------------------------------------------------
# the installed ipywidgets, whichever it is


def test_the_widget_bundle_is_what_the_installed_ipywidgets_itself_would_show(monkeypatch):
    import ipywidgets
    import ipywidgets.widgets.widget as widget_module

    box = ipywidgets.VBox([ipywidgets.HTML("x")])
    if hasattr(box, "_repr_mimebundle_"):  # ipywidgets 8: the widget's bundle
        own = box._repr_mimebundle_()
    else:  # ipywidgets 7: what its _ipython_display_ publishes (through the display it imported)
        published = []
        monkeypatch.setattr(widget_module, "display", lambda data, raw=False: published.append((data, raw)))
        box._ipython_display_()
        assert len(published) == 1 and published[0][1] is True
        own = published[0][0]
    assert compat.widget_mimebundle(box) == own
    assert own[WIDGET_VIEW_MIME]["model_id"] == box.model_id and own[WIDGET_VIEW_MIME]["version_major"] == 2
    box.close()
    assert compat.widget_mimebundle(box) == {"text/plain": repr(box)}  # a closed widget shows no view


def test_the_live_panel_output_carries_the_panel_view_the_html_and_the_text_line(fake_display):
    clock = FakeClock()
    d = LiveDashboard(mode="widget", clock=clock, memory_reader=fixed_memory())
    begin(d, 3)
    assert d.active_mode == "widget" and isinstance(d.view, views.WidgetView)
    bundle = _formatted(fake_display.calls[0])
    assert bundle[WIDGET_VIEW_MIME]["model_id"] == d.view.panel.model_id
    assert "nbkit · training" in bundle["text/html"] and bundle["text/plain"].startswith("[nbkit] step 0/3")
    assert set(bundle) == {WIDGET_VIEW_MIME, "text/html", "text/plain"}


def test_colab_s_ipywidgets_7_has_no_repr_mimebundle_where_8_has_one():
    """Why ``compat.widget_mimebundle`` exists: the two display APIs, as installed (CI runs this on 7.7.1 and 8)."""
    import ipywidgets

    box = ipywidgets.HTML("x")
    if _ipywidgets_major() >= 8:
        assert callable(getattr(box, "_repr_mimebundle_", None))
    else:
        assert not hasattr(box, "_repr_mimebundle_") and callable(box._ipython_display_)
    box.close()


# ---------------------------------------------------------------------------------------------------------------
# ipywidgets 7's semantics, on a stand-in (so they are checked where ipywidgets 8 is installed too)


def test_on_ipywidgets_7_the_bundle_is_what_display_would_publish_and_display_callbacks_run():
    widget = Widget7()
    seen = []
    widget.on_displayed(lambda w, **kwargs: seen.append(w))
    bundle = compat.widget_mimebundle(widget)
    widget._ipython_display_()  # what display(widget) does on ipywidgets 7
    assert bundle == widget.published[0] == {"text/plain": repr(widget), WIDGET_VIEW_MIME: widget.get_view_spec()}
    assert seen == [widget, widget]  # once per output, as each display runs them
    widget.close()
    assert compat.widget_mimebundle(widget) == {"text/plain": repr(widget)} and len(seen) == 2


def test_on_ipywidgets_7_the_panel_output_keeps_the_view_the_html_and_the_text_line():
    widget = Widget7()
    rendering = views.Rendering("<b>panel</b>", "[nbkit] step 1/3")
    bundle = _formatted(views.WidgetWithFallback(widget, rendering))
    assert bundle == {WIDGET_VIEW_MIME: widget.get_view_spec(), "text/html": "<b>panel</b>",
                      "text/plain": "[nbkit] step 1/3"}


def test_an_ipywidgets_8_bundle_with_metadata_keeps_it():
    class Widget8:
        def _repr_mimebundle_(self, **kwargs):
            return {"text/plain": "W", WIDGET_VIEW_MIME: {"model_id": "m"}}, {"isolated": True}

    data, meta = views.WidgetWithFallback(Widget8(), views.Rendering("<i>h</i>", "line"))._repr_mimebundle_()
    assert data == {WIDGET_VIEW_MIME: {"model_id": "m"}, "text/html": "<i>h</i>", "text/plain": "line"}
    assert meta == {"isolated": True}


# ---------------------------------------------------------------------------------------------------------------
# the HTML view takes over


def _run_three_steps(d: LiveDashboard, clock: FakeClock) -> None:
    state = begin(d, 3)
    for _ in range(3):
        step(d, state, clock, 1.0, {"loss": 2.0, "num_tokens": 100.0 * state.global_step})
    d.on_train_end(ARGS, state, TrainerControl())


def test_a_widget_panel_that_cannot_be_built_gives_way_to_the_html_view(monkeypatch, fake_display):
    def broken(self):
        raise AttributeError("'object' object has no attribute 'comm_manager'")

    monkeypatch.setattr(views.WidgetView, "__init__", broken)
    clock = FakeClock()
    d = LiveDashboard(mode="widget", clock=clock, memory_reader=fixed_memory())
    with pytest.warns(UserWarning, match="shows its HTML view: the widget panel failed .AttributeError"):
        _run_three_steps(d, clock)
    assert d.active_mode == "html" and len(fake_display.calls) == 1
    assert isinstance(fake_display.calls[0], views.Rendering)
    final = fake_display.handles[0].updates[-1]
    assert "training finished" in final.html and final.plain.startswith("[nbkit] training finished: 3/3 steps")


def test_a_widget_panel_that_fails_to_show_gives_way_to_the_html_view_in_its_place(monkeypatch, fake_display):
    """The widget's part of the output fails (an ipywidgets whose display API is neither 7's nor 8's): the view's
    ``show`` fails before anything is displayed, and the HTML view shows and updates the run instead."""
    def no_display_api(widget):
        raise RuntimeError("Comms cannot be opened without a kernel")

    monkeypatch.setattr(compat, "widget_mimebundle", no_display_api)
    clock = FakeClock()
    d = LiveDashboard(mode="widget", clock=clock, memory_reader=fixed_memory())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_three_steps(d, clock)
    said = [str(w.message) for w in caught if str(w.message).startswith("nbkit LiveDashboard")]
    assert said == ["nbkit LiveDashboard shows its HTML view: the widget panel failed (RuntimeError: Comms cannot be "
                    "opened without a kernel)"]
    assert d.active_mode == "html" and len(fake_display.calls) == 1 and d.renders >= 2
    updates = fake_display.handles[0].updates
    assert any("step 2/3" in u.plain for u in updates) and updates[-1].plain.startswith("[nbkit] training finished")


def test_an_html_view_that_fails_stops_displaying_and_training_goes_on(monkeypatch, fake_display):
    """Only the widget panel has a fallback: a failing HTML view stops the display, as before."""
    def broken(self, s):
        raise RuntimeError("no display")

    monkeypatch.setattr(views.HtmlView, "show", broken)
    clock = FakeClock()
    d = LiveDashboard(mode="html", clock=clock, memory_reader=fixed_memory())
    with pytest.warns(UserWarning, match="stopped displaying: RuntimeError: no display"):
        _run_three_steps(d, clock)
    assert d.view is None and d.summary.step == 3 and fake_display.calls == []
