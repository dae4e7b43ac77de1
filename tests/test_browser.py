"""A real browser renders the dashboard: headless Chromium (Debian's package) on a running JupyterLab server.

JupyterLab serves its widget manager (jupyterlab_widgets, from PyPI) from the local server, so nothing comes from a
CDN. Chromium is driven through the DevTools protocol with a small client (websocket-client, a dependency of
jupyter-server). Two checks, each from the page's DOM, with a screenshot of each saved beside the test's files
(``NBKIT_SCREENSHOT_DIR`` keeps them):

1. an executed notebook (run by nbclient) opened in JupyterLab shows the dashboard's end-of-run summary with real
   numbers (steps, tokens/s, loss, RAM);
2. the same training run from the browser (JupyterLab's *run all*) shows the live ipywidgets panel (rendered by the
   widget manager: a ``widget-vbox`` with a progress bar, not the HTML fallback) with numbers that change in place,
   and at the end it is replaced by the summary.

Skipped only when Chromium is not installed (``apt-get install -y chromium``).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium)")

LIVE_STEPS = 60
TRAIN_CELL = """
import time

from transformers import TrainerCallback

from nbkit import FastSFT, FastSFTConfig, load_model
from nbkit.notebook import demo_chat_dataset, pick_model

choice = pick_model("tiny", gpu_default="", folder="tiny-base")
model, tokenizer = load_model(choice.path, load_in_4bit=False, lora_r=8, modules_to_save=["embed_tokens", "lm_head"])


class Pace(TrainerCallback):
    \"\"\"Slows the tiny run down so that the live panel is on screen long enough to be observed.\"\"\"

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(STEP_SLEEP)


config = FastSFTConfig(output_dir="trainer", max_steps=STEPS, per_device_train_batch_size=1, max_length=64,
                       learning_rate=3e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True)
trainer = FastSFT(model=model, args=config, train_dataset=demo_chat_dataset(200), processing_class=tokenizer,
                  callbacks=[Pace()])
trainer.train()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_notebook(path: Path, steps: int, step_sleep: float) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.cells = [nbformat.v4.new_code_cell(f"STEPS = {steps}\nSTEP_SLEEP = {step_sleep}"),
                nbformat.v4.new_code_cell(TRAIN_CELL.strip())]
    nbformat.write(nb, path)


class DevTools:
    """The few DevTools-protocol calls this test needs, over one page's websocket."""

    def __init__(self, ws_url: str) -> None:
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def wait_for(self, expression: str, timeout: float, what: str, interval: float = 0.25):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")

    def close(self) -> None:
        self.ws.close()


def outputs_js(name: str) -> str:
    """JS: the outputs of notebook ``name`` that hold a dashboard (text, rendered as a live widget panel or not, with
    a progress bar or not, height). Only that notebook's panel: JupyterLab keeps other open notebooks in the DOM."""
    return f"""Array.from({panel_js(name)}.node.querySelectorAll('.jp-OutputArea-output'))
  .filter(e => e.innerText.includes('nbkit · training'))
  .map(e => ({{text: e.innerText, widget: !!e.querySelector('.widget-vbox'),
              bar: !!e.querySelector('.widget-hprogress .progress-bar'), height: e.getBoundingClientRect().height}}))"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 serving a temporary folder; yields (base url, token, folder)."""
    pytest.importorskip("jupyterlab")
    root = tmp_path_factory.mktemp("lab")
    home = tmp_path_factory.mktemp("jupyter-home")
    port, token = free_port(), secrets.token_hex(16)
    config = home / "lab_config.py"
    config.write_text(
        f"c.ServerApp.ip = '127.0.0.1'\nc.ServerApp.port = {port}\nc.ServerApp.port_retries = 0\n"
        f"c.IdentityProvider.token = '{token}'\nc.ServerApp.open_browser = False\n"
        "c.ServerApp.allow_root = True\n"  # CI runs as root
        "c.LabApp.extension_manager = 'readonly'\n"  # no extension index to query
        f"c.ServerApp.root_dir = {str(root)!r}\n"
        "c.LabApp.expose_app_in_browser = True\n"  # window.jupyterapp, to run all cells
        "c.LabApp.news_url = None\n"
        "c.LabApp.check_for_updates_class = 'jupyterlab.handlers.announcements.NeverCheckForUpdate'\n"
        f"c.LabApp.workspaces_dir = {str(home / 'workspaces')!r}\n"
        f"c.LabApp.user_settings_dir = {str(home / 'settings')!r}\n"
    )
    news = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')  # no "get notified about news?" prompt over the page
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # see test_notebooks.py
    log = open(home / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "jupyterlab", f"--config={config}"], cwd=root, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("JupyterLab did not start:\n" + (home / "server.log").read_text()[-3000:])
            time.sleep(0.5)
        yield base, token, root
    finally:
        try:  # shut the kernels down through the server, then the server
            request = urllib.request.Request(f"{base}/api/kernels?token={token}")
            with urllib.request.urlopen(request, timeout=5) as response:
                for kernel in json.load(response):
                    urllib.request.urlopen(urllib.request.Request(
                        f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE"), timeout=10)
        except OSError:
            pass
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium with the DevTools protocol on a free local port; yields a DevTools client for its page."""
    pytest.importorskip("websocket")
    profile = Path(tempfile.mkdtemp(prefix="nbkit-chromium-"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-port=0",
             "--window-size=1400,1100"]
    proc = subprocess.Popen([CHROMIUM, *flags, "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = None
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            page = next(t for t in json.load(response) if t["type"] == "page")
        client = DevTools(page["webSocketDebuggerUrl"])
        yield client
    finally:
        if client is not None:
            client.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


def screenshot(browser: DevTools, name: str, path: Path) -> None:
    """A screenshot with notebook ``name``'s dashboard scrolled into the middle of the window."""
    browser.evaluate(f"""(() => {{ const e = Array.from({panel_js(name)}.node.querySelectorAll('.jp-OutputArea-output'))
        .find(x => x.innerText.includes('nbkit · training')); if (e) e.scrollIntoView({{block: 'center'}});
        return true; }})()""")
    time.sleep(0.3)
    browser.screenshot(path)


def screenshot_dir(tmp_path: Path) -> Path:
    keep = os.environ.get("NBKIT_SCREENSHOT_DIR")
    path = Path(keep) if keep else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


def panel_js(name: str) -> str:
    """JS for the notebook panel showing ``name`` (found by path: headless Chromium has no focused widget)."""
    return (f"Array.from(window.jupyterapp.shell.widgets('main'))"
            f".find(w => w.context && w.context.path === {json.dumps(name)})")


def open_notebook(browser: DevTools, base: str, token: str, name: str) -> None:
    browser.call("Page.navigate", url=f"{base}/lab/tree/{name}?token={token}")
    # by path, so that the page left by a previous navigation cannot answer
    browser.wait_for(f"""(() => {{ if (!window.jupyterapp) return false; const panel = {panel_js(name)};
        return !!(panel && panel.node.querySelector('.jp-Cell')); }})()""", 90, f"JupyterLab to show {name}")


def assert_numbers(text: str, finished: bool) -> None:
    text = re.sub(r"\s+", " ", text)
    assert re.search(r"tokens/s [\d.]+k? now, [\d.]+k? mean", text), text  # numbers, not "--"
    assert re.search(r"loss \d+\.\d{4} last", text), text
    assert re.search(r"RAM \d+(\.\d)? (MiB|GiB) of \d+(\.\d)? GiB", text), text
    if finished:
        assert re.search(r"step (\d+)/\1 100%", text), text


def test_executed_notebook_shows_the_dashboard_summary(lab, browser, tmp_path, monkeypatch):
    import nbclient
    import nbformat

    base, token, root = lab
    path = root / "executed.ipynb"
    write_notebook(path, steps=5, step_sleep=0.0)
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel nbclient starts inherits it (see test_notebooks.py)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(root)}})
    client.execute()
    nbformat.write(nb, path)

    open_notebook(browser, base, token, "executed.ipynb")
    outputs = browser.wait_for(f"(() => {{ const o = {outputs_js('executed.ipynb')}; return o.length ? o : null; }})()",
                               60, "the dashboard summary to render")
    screenshot(browser, "executed.ipynb", screenshot_dir(tmp_path) / "executed_notebook.png")
    assert len(outputs) == 1, outputs
    summary = outputs[0]
    assert "training finished" in summary["text"] and summary["height"] > 50
    assert not summary["widget"]  # the live panel was replaced by the static summary
    assert_numbers(summary["text"], finished=True)
    assert "step 5/5" in summary["text"]


def test_live_widget_renders_and_updates_in_jupyterlab(lab, browser, tmp_path):
    base, token, root = lab
    write_notebook(root / "live.ipynb", steps=LIVE_STEPS, step_sleep=0.3)
    open_notebook(browser, base, token, "live.ipynb")
    status = browser.wait_for(f"""(async () => {{ const panel = {panel_js("live.ipynb")};
        await panel.context.ready; await panel.sessionContext.ready;
        const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
        return kernel && kernel.status === 'idle' ? 'idle' : null; }})()""", 90, "the kernel to be idle")
    assert status == "idle"
    # JupyterLab's "Run All" (its promise settles when the cells are done: not awaited here)
    browser.evaluate(f"""(() => {{ window.jupyterapp.shell.activateById({panel_js("live.ipynb")}.id);
        window.jupyterapp.commands.execute('notebook:run-all-cells'); return true; }})()""")

    # the live panel: the widget manager's VBox with a progress bar, numbers in it, the step moving on in place
    live_js = f"""(() => {{ const o = {outputs_js("live.ipynb")};
        const live = o.filter(x => x.widget && x.bar && /step [1-9]\\d*\\/{LIVE_STEPS}/.test(x.text)
                                   && /tokens\\/s\\s+[\\d.]+k? now/.test(x.text));
        return live.length ? o : null; }})()"""
    first = browser.wait_for(live_js, 240, "the live widget panel with numbers")
    first_step = int(re.search(rf"step (\d+)/{LIVE_STEPS}", first[0]["text"]).group(1))
    screenshot(browser, "live.ipynb", screenshot_dir(tmp_path) / "live_widget.png")
    assert len(first) == 1, first  # one panel, not one output per update
    assert_numbers(first[0]["text"], finished=False)

    later_js = f"""(() => {{ const o = {outputs_js("live.ipynb")};
        const m = o.length === 1 && o[0].widget && o[0].text.match(/step (\\d+)\\/{LIVE_STEPS}/);
        return m && parseInt(m[1]) > {first_step} ? o : null; }})()"""
    later = browser.wait_for(later_js, 60, "the panel to update in place")
    assert len(later) == 1

    done = browser.wait_for(f"""(() => {{ const o = {outputs_js("live.ipynb")};
        return o.length && o.every(x => x.text.includes('training finished')) ? o : null; }})()""", 240,
                            "the end-of-run summary")
    screenshot(browser, "live.ipynb", screenshot_dir(tmp_path) / "live_finished.png")
    assert len(done) == 1 and not done[0]["widget"]
    assert_numbers(done[0]["text"], finished=True)
