"""Tests for nbkit.dashboard in real runs: a tiny TRL ``SFTTrainer`` and nbkit's ``FastSFT`` on CPU, a real notebook
kernel (when nbclient and ipykernel are installed), and what importing the package costs."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.trainer_callback import ProgressCallback

from nbkit import dashboard as dash
from nbkit.dashboard import LiveDashboard, attach_dashboard

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:LiveDashboard was added with add_callback"),
              pytest.mark.usefixtures("no_env_mode")]


def test_importing_the_dashboard_imports_neither_torch_nor_transformers():
    code = ("import sys, nbkit.dashboard as d; d.panel_html; "
            "print(sorted(m for m in ('torch', 'transformers', 'IPython', 'ipywidgets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------------
# a real tiny TRL run on CPU


def _tiny_sft_parts():
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from nbkit.demo.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    words = ["red", "green", "blue", "cat", "dog", "runs", "sleeps", "fast", "slowly", "today"]
    texts = [" ".join(words[(i * k) % len(words)] for k in range(1, 4 + i % 5)) for i in range(48)]
    return model, tok, Dataset.from_dict({"text": texts})


def _sft_args(out, **kw):
    base = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, logging_steps=1, report_to=[],
                use_cpu=True, save_strategy="no", max_length=32, learning_rate=1e-3)
    return {**base, **kw}


def test_real_sft_trainer_run(tmp_path):
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(2)
    model, tok, ds = _tiny_sft_parts()
    trainer = SFTTrainer(model=model, args=SFTConfig(**_sft_args(tmp_path)), train_dataset=ds, processing_class=tok)
    before = list(trainer.callback_handler.callbacks)
    assert any(isinstance(c, ProgressCallback) for c in before)
    out = io.StringIO()
    d = attach_dashboard(trainer, mode="text", stream=out, min_interval=0.0, text_interval=0.0)
    assert not any(isinstance(c, ProgressCallback) for c in trainer.callback_handler.callbacks)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    s = d.summary
    assert s.step == 6 and s.max_steps == 6 and len(logs) == 6
    assert s.tokens == int(logs[-1]["num_tokens"]) > 0  # tokens as TRL counts them
    assert s.tokens_per_s_mean > 0 and s.tokens_per_s > 0
    assert s.loss == pytest.approx(logs[-1]["loss"]) and [h[1] for h in s.history] == [e["loss"] for e in logs]
    assert s.train_loss == pytest.approx(trainer.state.log_history[-1]["train_loss"])
    assert s.memory.total is None and s.memory.host_total  # CPU: no VRAM, host RAM
    text = out.getvalue()
    assert text.count("[nbkit] step") == d.renders and "[nbkit] training finished: 6/6 steps" in text
    # max_steps bounds this run: epochs are the data seen, never "epoch x/<rounded-up total>"
    assert "step 6/6 100% | " in text and "epochs of data" in text and "| epoch " not in text
    d.detach()
    assert trainer.callback_handler.callbacks == before


def test_real_sft_trainer_with_add_callback_html(tmp_path, fake_display):
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(2)
    model, tok, ds = _tiny_sft_parts()
    d = LiveDashboard(mode="html")
    trainer = SFTTrainer(model=model, args=SFTConfig(**_sft_args(tmp_path, max_steps=3)), train_dataset=ds,
                         processing_class=tok, callbacks=[d])
    with pytest.warns(UserWarning, match="attach_dashboard"):
        trainer.train()
    assert len(fake_display.calls) == 1
    summary = fake_display.handles[0].updates[-1].html
    assert "training finished" in summary and "step 3/3" in summary
    assert f"{dash.fmt_count(d.summary.tokens_per_s_mean)} mean" in summary and "RAM" in summary


def test_fast_sft_attaches_the_dashboard(tmp_path):
    trainer_mod = pytest.importorskip("nbkit.trainer")
    from nbkit.config import FastSFTConfig

    torch.set_num_threads(2)
    model, tok, ds = _tiny_sft_parts()
    out = io.StringIO()
    args = FastSFTConfig(**_sft_args(tmp_path, max_steps=3), live_dashboard=True)
    trainer = trainer_mod.FastSFT(model=model, args=args, train_dataset=ds, processing_class=tok)
    boards = [c for c in trainer.callback_handler.callbacks if isinstance(c, LiveDashboard)]
    assert len(boards) == 1 and not any(isinstance(c, ProgressCallback) for c in trainer.callback_handler.callbacks)
    boards[0].mode, boards[0].stream = "text", out
    trainer.train()
    assert boards[0].summary.step == 3 and boards[0].summary.tokens > 0
    assert "training finished: 3/3" in out.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# a real notebook kernel


NOTEBOOK_CELL = r"""
import io, types, torch
from transformers import TrainerCallback, TrainerControl, TrainerState
from nbkit.dashboard import LiveDashboard, MemoryReading, in_notebook, resolve_mode
print("in_notebook", in_notebook(), "mode", resolve_mode("auto"))
shell, published = get_ipython(), []  # the mime types of every output the kernel publishes
publish = shell.display_pub.publish
shell.display_pub.publish = lambda data, *a, **k: (published.append(sorted(data)), publish(data, *a, **k))[1]
t = [0.0]
d = LiveDashboard(clock=lambda: t[0], memory_reader=lambda: MemoryReading(gpu_name="Fake GPU", allocated=2**30,
                  reserved=2**31, peak=2**31, total=2**33, host_used=2**30, host_total=2**32))
args, control = types.SimpleNamespace(device=torch.device("cpu")), TrainerControl()
state = TrainerState(max_steps=200, num_train_epochs=1)
d.on_train_begin(args, state, control)
for i in range(1, 201):
    t[0] += 0.05
    state.global_step, state.epoch = i, i / 200
    d.on_step_end(args, state, control)
    d.on_log(args, state, control, logs={"loss": 3.0 / i, "num_tokens": 64.0 * i, "learning_rate": 1e-4})
d.on_train_end(args, state, control)
print("first output", published[0], "outputs", len(published))
print("renders", d.renders, "mode", d.active_mode)
"""


def test_in_a_real_kernel_the_widget_output_becomes_the_summary():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(NOTEBOOK_CELL)]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = nb.cells[0].outputs
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "in_notebook True mode widget" in printed and "mode widget" in printed.splitlines()[-1]
    import ipywidgets

    # the live panel's output, on this ipywidgets (7 as on Colab, or 8): the widget's view, its HTML, the text line
    first = "first output ['application/vnd.jupyter.widget-view+json', 'text/html', 'text/plain']"
    assert first in printed, (ipywidgets.__version__, printed)
    assert not [o for o in outputs if o.output_type == "error"]
    assert "Traceback" not in "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    displays = [o for o in outputs if o.output_type == "display_data"]
    assert len(displays) == 1  # one output for the whole run
    data = displays[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" not in data  # replaced by the static summary
    assert "training finished" in data["text/html"] and "step 200/200" in data["text/html"]
    assert "12.8k tokens" in data["text/html"] and "1.28k mean" in data["text/html"] and "Fake GPU" in data["text/html"]
    # text-only viewers of the saved notebook read the summary too
    assert data["text/plain"].startswith("[nbkit] training finished: 200/200 steps") and "12.8k" in data["text/plain"]
