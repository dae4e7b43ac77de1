"""The example notebooks: committed clean, and each one runs top to bottom on CPU with tiny parameters.

Each notebook is executed by nbclient in a real ipykernel (so the dashboard takes its notebook path: a widget with
an HTML fallback, replaced by a static summary) with a cell of parameters inserted after its ``parameters`` cell,
the way papermill does. The assertions read what the run produced: the ``results.json`` each notebook writes, the
files it saved, and the outputs of the executed notebook (the dashboard's final summary, errors).

Set ``NBKIT_EXECUTED_DIR`` to keep the executed notebooks (the browser test and reviewers can open them).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["01_qlora_quickstart", "02_speed_lab", "03_long_context", "04_moe_finetune"]

# Parameters for a CPU runner (2 cores). 01 and 03 run with their defaults (what a user without a GPU gets: the
# CPU defaults must learn, and must stay within the machine); 02 and 04 with tiny ones. The kernels run with one
# OpenMP thread: on a shared 2-core machine, two threads that wait for each other at every op's barrier made the
# same runs up to 50x slower whenever another process held a core.
DEFAULTS = dict(model_name="auto", run_setup=False)
TINY = dict(DEFAULTS, max_length=128, batch_size=2)
PARAMS = {
    "01_qlora_quickstart": DEFAULTS,
    "02_speed_lab": dict(TINY, max_steps=6, train_examples=200, load_in_4bit=False),
    "03_long_context": DEFAULTS,
    "04_moe_finetune": dict(TINY, max_steps=10, train_examples=200, eval_examples=4),
}
# 03 on short lengths (with the offload module blocked: FastSFT without it beside plain TRL)
TINY_03 = dict(DEFAULTS, start_length=128, max_try_length=1024, steps_per_try=2, load_in_4bit=False)


def inject(nb, params: dict) -> None:
    """Insert a cell that overrides ``params`` right after the cell tagged ``parameters`` (papermill's way)."""
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    source = "# Injected by tests/test_notebooks.py\n" + "".join(f"{k} = {v!r}\n" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["injected-parameters"]
    cell.id = "injected-parameters"
    nb.cells.insert(index + 1, cell)


BLOCKER = """
# Test-only: makes the modules named in NBKIT_TEST_BLOCK unimportable, as if they had not landed yet.
import os, sys

class _Blocked:
    names = set(filter(None, os.environ.get("NBKIT_TEST_BLOCK", "").split(",")))

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            raise ImportError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, _Blocked())
"""


def execute(source: Path, workdir: Path, params: dict, timeout: int = 600, block: tuple[str, ...] = ()):
    """Run the notebook at ``source`` with ``params`` in ``workdir`` (its cwd); return the executed notebook.
    Modules in ``block`` cannot be imported in the kernel (a ``sitecustomize`` on its PYTHONPATH)."""
    nb = nbformat.read(source, as_version=4)
    inject(nb, params)
    env_keep = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM",
                                               "MPLBACKEND", "PYTHONPATH", "NBKIT_TEST_BLOCK")}
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if block:
        site = workdir / "blocker"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(BLOCKER)
        path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        os.environ.update(PYTHONPATH=path, NBKIT_TEST_BLOCK=",".join(block))
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend, as in Jupyter
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(workdir)}})
    try:
        client.execute()
    finally:
        for key, value in env_keep.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    keep = os.environ.get("NBKIT_EXECUTED_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, Path(keep) / source.name)
    return nb


def errors(nb) -> list[str]:
    found = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found.append(f"cell {cell.id}: {output['ename']}: {output['evalue']}\n"
                             + "\n".join(output["traceback"]))
    return found


def all_text(nb) -> str:
    """Everything the notebook printed or displayed as text or HTML, ANSI codes removed."""
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                parts.append(output["text"])
            data = output.get("data", {})
            for mime in ("text/plain", "text/html", "text/markdown"):
                if mime in data:
                    parts.append(data[mime])
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(parts))


def dashboard_outputs(nb) -> list[str]:
    """The HTML of every dashboard display left in the notebook (the live panel is replaced by its summary)."""
    return [output["data"]["text/html"] for cell in nb.cells for output in cell.get("outputs", [])
            if "text/html" in output.get("data", {}) and "nbkit · training" in output["data"]["text/html"]]


# What a notebook may print on stderr, each for a reason; anything else there is a stray warning or log line.
EXPECTED_STDERR = [
    # chat says once per model, on a CPU, why it decodes with model.generate (its fast paths need CUDA)
    re.compile(r"nbkit chat: decoding with model\.generate: no CUDA device"),
]


def stray_outputs(nb) -> list[str]:
    """What a reader should not find in an executed notebook, one entry each: a stderr line that is not one of
    ``EXPECTED_STDERR`` (warnings, loggers' lines), a printed line with "Warning" in it, and a cell's value shown
    bare: an ``Out[]`` that is only a plain-text repr (a number, None, an object's repr), where what a notebook
    means to show is a table, a chart or HTML."""
    found = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            kind = output.get("output_type")
            if kind == "stream":
                for line in re.sub(r"\x1b\[[0-9;]*m", "", output.get("text", "")).splitlines():
                    if not line.strip():
                        continue
                    if output.get("name") == "stderr" and not any(p.fullmatch(line.strip()) for p in EXPECTED_STDERR):
                        found.append(f"cell {cell.id} stderr: {line}")
                    elif "Warning" in line:
                        found.append(f"cell {cell.id} printed: {line}")
            elif kind == "execute_result" and set(output.get("data", {})) <= {"text/plain"}:
                found.append(f"cell {cell.id} shows a bare value: {output.get('data', {}).get('text/plain', '')[:200]}")
    return found


def assert_summary_has_numbers(html: str) -> None:
    """The end-of-run summary: finished, steps, tokens/s with numbers, loss, RAM (and VRAM on CUDA)."""
    text = re.sub(r"<[^>]+>", " ", html)
    text = re.sub(r"\s+", " ", text)
    assert "training finished" in text, text
    assert re.search(r"step (\d+)/\1\b", text), text
    assert re.search(r"tokens/s [\d.]+k? now, [\d.]+k? mean \([\d.]+k? tokens\)", text), text
    assert re.search(r"loss \d+\.\d{4} last", text), text
    assert re.search(r"RAM \d+(\.\d)? (MiB|GiB) of \d+(\.\d)? GiB", text), text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("notebooks")


# ---------------------------------------------------------------------------------------------------------------
# committed clean


def test_notebooks_match_their_sources(tmp_path):
    """notebooks/*.ipynb are exactly what tools/build_notebooks.py writes from notebooks/src/*.py (so they are
    reviewed as plain text), one source per notebook."""
    builder = str(ROOT / "tools" / "build_notebooks.py")
    assert sorted(p.stem for p in (NOTEBOOKS / "src").glob("*.py")) == NAMES
    result = subprocess.run([sys.executable, builder, "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    result = subprocess.run([sys.executable, builder, "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.stem for p in tmp_path.glob("*.ipynb")) == NAMES
    for name in NAMES:
        assert (tmp_path / f"{name}.ipynb").read_text() == (NOTEBOOKS / f"{name}.ipynb").read_text(), name
    # the check names a notebook that differs from its source (here: one edited by hand)
    edited = tmp_path / "02_speed_lab.ipynb"
    text = edited.read_text()
    assert '"seed = 0"' in text
    edited.write_text(text.replace('"seed = 0"', '"seed = 1"'))
    result = subprocess.run([sys.executable, builder, "--check", "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1 and str(edited) in result.stdout, result.stdout + result.stderr
    assert "01_qlora_quickstart" not in result.stdout


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_clean_with_parameters_first(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    assert "widgets" not in nb.metadata
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert code_cells[0].metadata.get("tags") == ["parameters"]
    for cell in code_cells:
        assert cell.outputs == [] and cell.execution_count is None, cell.id
    params = {}
    exec(code_cells[0].source, {}, params)  # plain assignments only
    assert {"model_name", "load_in_4bit", "output_dir", "seed", "run_setup", "nbkit_source"} <= set(params)
    assert set(PARAMS[name]) <= set(params), "the CI parameters must exist in the notebook"
    # the second code cell is the setup cell, which goes through colab_setup.sh via nbkit.setup
    assert "nbkit.setup" in code_cells[1].source and "--no-deps" in code_cells[1].source


def _homepage() -> str:
    return re.search(r'^Homepage = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_opens_in_colab_and_says_to_pick_a_gpu_runtime(name):
    """The first cell links the notebook in Colab (from the project's repository), and before the parameters a cell
    says how to pick a GPU runtime and what a CPU runtime runs instead."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    github = _homepage().removeprefix("https://github.com/")
    link = f"https://colab.research.google.com/github/{github}/blob/main/notebooks/{name}.ipynb"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("[![Open In Colab]("), first.source[:200]
    assert f"]({link})" in first.source.splitlines()[0]
    before_parameters = nb.cells[:next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")]
    text = " ".join(" ".join(c.source.split()) for c in before_parameters)
    assert "*Runtime > Change runtime type" in text and "GPU*" in text and "*Runtime > Run all*" in text
    assert "On a CPU runtime (Colab's default)" in text and "tiny randomly initialised" in text


def test_quickstart_says_how_to_bring_your_own_jsonl_on_colab():
    nb = nbformat.read(NOTEBOOKS / "01_qlora_quickstart.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "files.upload()" in text and 'own_data = "/content/my_chats.jsonl"' in text  # upload
    assert 'drive.mount("/content/drive")' in text and 'own_data = "/content/drive/MyDrive/' in text  # Drive
    params = {}
    exec(next(c for c in nb.cells if c.cell_type == "code").source, {}, params)
    assert "own_data" in params


def test_the_install_line_brings_what_the_notebooks_import():
    """Every module the notebooks import is the standard library's, the kernel's (IPython), nbkit's, or comes with a
    distribution nbkit-sft requires or its ``notebooks`` extra adds; the README's pip line and colab_setup.sh
    install that extra."""
    from importlib import metadata

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(requirement: str) -> str:
        return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()

    installed = {name(r) for r in project["dependencies"] + project["optional-dependencies"]["notebooks"]}
    owners = metadata.packages_distributions()
    modules = set()
    for n in NAMES:
        for node in ast.parse(notebook_imports(n)).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            modules |= {m.split(".")[0] for m in names}
    assert "matplotlib" in modules  # 02's charts
    missing = {}
    for module in sorted(modules - set(sys.stdlib_module_names) - {"nbkit", "IPython"}):
        dists = {name(d) for d in owners.get(module, [module])}
        if not dists & installed:
            missing[module] = sorted(dists)
    assert missing == {}, f"imported by a notebook, installed by neither the core nor the notebooks extra: {missing}"
    readme = (ROOT / "README.md").read_text()
    assert 'pip install "nbkit-sft[notebooks] @ git+https://github.com/nbkit/nbkit"' in readme
    assert "EXTRA=notebooks" in (ROOT / "colab_setup.sh").read_text()  # tests/test_colab_setup.py runs it


def test_stray_outputs_names_warnings_stderr_lines_and_bare_values_and_lets_expected_lines_pass():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.id = "c1"
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="loss 0.1\nlearning rate 3e-3\n"),
        nbformat.v4.new_output("stream", name="stderr", text="nbkit chat: decoding with model.generate: no CUDA device\n"),
        nbformat.v4.new_output("execute_result", data={"text/markdown": "| a |", "text/plain": "<Markdown>"}),
    ]
    nb.cells.append(cell)
    assert stray_outputs(nb) == []
    cell.outputs += [
        nbformat.v4.new_output("stream", name="stderr", text="/x.py:1: UserWarning: pinned\n  warnings.warn(\n"),
        nbformat.v4.new_output("stream", name="stdout", text="FutureWarning: old name\n"),
        nbformat.v4.new_output("execute_result", data={"text/plain": "1815"}),
        nbformat.v4.new_output("execute_result", data={"text/plain": "None"}),
    ]
    assert stray_outputs(nb) == ["cell c1 stderr: /x.py:1: UserWarning: pinned", "cell c1 stderr:   warnings.warn(",
                                 "cell c1 printed: FutureWarning: old name", "cell c1 shows a bare value: 1815",
                                 "cell c1 shows a bare value: None"]


def test_setup_cells_are_the_same_everywhere():
    setups = {name: [c for c in nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells
                     if c.cell_type == "code"][1].source for name in NAMES}
    assert len(set(setups.values())) == 1


def installed_nbkit() -> dict:
    from importlib import metadata

    found = {}
    for name in ("nbkit", "nbkit-sft"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def test_setup_cell_runs_colab_setup_on_colab(tmp_path, monkeypatch):
    """On Colab (faked), the setup cell runs colab_setup.sh through nbkit.setup; --dry-run here, so nothing is
    installed or removed (the cell's own pip steps are printed, not run: tests/test_packaging.py runs them for real
    in a fresh venv). No package changed, so no restart."""
    before = installed_nbkit()
    nb = nbformat.read(NOTEBOOKS / "01_qlora_quickstart.ipynb", as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    nb.cells = code_cells[:2]
    nb_path = tmp_path / "setup_only.ipynb"
    nbformat.write(nb, nb_path)
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20250101-060000_RC00")  # the kernel inherits it
    ran = execute(nb_path, tmp_path, {"nbkit_source": str(ROOT), "setup_options": ["--dry-run"]})
    assert not errors(ran), errors(ran)
    text = all_text(ran)
    assert "platform: colab" in text and f"installing nbkit from {ROOT}" in text
    assert "NBKIT_RESTART_NEEDED=unknown" in text and "setup skipped" not in text
    assert installed_nbkit() == before
    if before["nbkit-sft"] is None or before["nbkit"] is not None:  # the cell's bootstrap is due: printed only
        assert f"+ pip install -q --no-deps {ROOT}" in text


# A CPU with AVX512-BF16, as far as bitsandbytes can tell: there it tries to fetch a kernel from the Hub when it is
# imported, and logs a "kernels-community" line when it cannot.
FAKE_AVX512_BF16 = """
import importlib.abc, importlib.machinery, sys

class _AVX512BF16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "bitsandbytes.functional":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: True

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _AVX512BF16())
"""


def notebook_imports(name: str) -> str:
    """The notebook's top-level import statements, in the order its cells run them."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    return "\n".join(ast.unparse(node) for cell in nb.cells if cell.cell_type == "code"
                     for node in ast.parse(cell.source).body if isinstance(node, (ast.Import, ast.ImportFrom)))


def run_imports(code: str, cwd: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", FAKE_AVX512_BF16 + code], capture_output=True, text=True, env=env,
                            cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def hub_kernel_hint(tmp_path_factory) -> bool:
    """Whether this bitsandbytes prints the line at all on such a CPU (it does when imported before nbkit)."""
    return "kernels-community" in run_imports("from trl import SFTTrainer\nimport nbkit", tmp_path_factory.mktemp("bnb"))


@pytest.mark.parametrize("name", NAMES)
def test_notebook_imports_print_no_hub_kernel_hint_on_an_avx512_bf16_cpu(name, tmp_path, hub_kernel_hint):
    """nbkit drops bitsandbytes' "kernels-community" line (advice to ``pip install kernels`` that does not apply) from
    the moment it is imported (nbkit/__init__.py), so each notebook imports nbkit before what imports bitsandbytes
    (TRL, PEFT)."""
    if not hub_kernel_hint:
        pytest.skip("this bitsandbytes does not try Hub kernels on an AVX512-BF16 CPU")
    printed = run_imports(notebook_imports(name) + "\nimport sys\nassert 'bitsandbytes' in sys.modules", tmp_path)
    assert "kernels-community" not in printed, printed


# ---------------------------------------------------------------------------------------------------------------
# the length search of 03: predicted before it runs (fast, no notebook)

MiB = 2**20


def test_forecast_is_exact_for_a_fixed_part_plus_quadratic_growth_and_errs_high_otherwise():
    from nbkit.notebook import forecast

    def quadratic(n):
        return 64 * MiB + 16 * n * n

    points = [(1024, quadratic(1024)), (2048, quadratic(2048))]
    for length in (3072, 4096, 16384):
        assert forecast(points, length) == pytest.approx(quadratic(length), rel=1e-12)

    def linear(n):
        return 64 * MiB + 4096 * n

    points = [(1024, linear(1024)), (2048, linear(2048))]
    assert linear(4096) < forecast(points, 4096) <= 2 * linear(4096)
    assert forecast([(1024, 10.0)], 4096) == 160.0  # one point: all of it taken to grow with the square
    assert forecast([(1024, 10.0), (2048, 8.0)], 4096) == 16.0  # a noisy fall: at least linear growth
    assert forecast([(4096, 1.0)], 2048) is None and forecast([], 1024) is None


def test_answer_loss_is_the_loss_on_the_answer_tokens_training_covers(tmp_path, one_thread):
    """The notebooks' held-out loss counts the tokens TRL trains a conversational prompt-completion row on: those
    after the prompt with its generation prompt (the answer and its end of turn), not the question's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbkit.demo.models import build_base
    from nbkit.notebook import answer_loss

    build_base(tmp_path / "base", "qwen3", seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "base"))
    pairs = [("Reverse the words: red fox moon", "moon fox red"), ("Reverse the words: a b", "b a")]
    total = count = every_total = every_count = 0.0
    for question, answer in pairs:
        prompt = [{"role": "user", "content": question}]
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"]
        ids = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": answer}],
                                            return_dict=True)["input_ids"]
        assert ids[:len(prompt_ids)] == prompt_ids and len(ids) > len(prompt_ids)
        with torch.no_grad():
            losses = torch.nn.functional.cross_entropy(model(input_ids=torch.tensor([ids])).logits[0, :-1],
                                                       torch.tensor(ids[1:]), reduction="none")
        total += float(losses[len(prompt_ids) - 1:].sum())
        count += len(ids) - len(prompt_ids)
        every_total, every_count = every_total + float(losses.sum()), every_count + len(ids) - 1
    assert answer_loss(model, tokenizer, pairs) == pytest.approx(total / count, rel=1e-5)
    assert abs(answer_loss(model, tokenizer, pairs) - every_total / every_count) > 1e-3  # not every token's


class FakeHostCost:
    """Stands in for HostPeak: reports the host bytes a fake try "used" above this process's resident set."""

    pending = 0

    def __enter__(self):
        from nbkit.memory import process_rss

        self.start = process_rss()
        return self

    def __exit__(self, *exc):
        self.peak = self.start + FakeHostCost.pending


def fake_search(cost, seconds, fits=lambda n: True, host=(2 * 2**30, 6 * 2**30), **options):
    """A LengthSearch whose tries cost ``cost(n)`` host bytes and ``seconds(n)`` a step, on a host with ``host``
    (used, total) bytes."""
    from nbkit.notebook import LengthSearch

    said = []

    def try_length(n):
        FakeHostCost.pending = cost(n)
        return {"fits": fits(n), "seconds_per_step": seconds(n)}

    search = LengthSearch(try_length, start=1024, limit=262144, say=said.append, read_host=lambda: host,
                          watch=FakeHostCost, **options)
    return search.run(), said


def test_length_search_never_runs_a_try_predicted_to_exceed_host_memory():
    """4 GiB available, 80% of it allowed (3,277 MiB); a step costs 64 MiB + 16 B x tokens^2: 14,336 tokens (3,200
    MiB) is the longest that fits. Doubling stops before 16,384 (4,160 MiB predicted), bisection finds 12,288, then
    14,336, and no try ever costs more than allowed."""
    def cost(n):
        return 64 * MiB + 16 * n * n

    found, said = fake_search(cost, seconds=lambda n: 0.01)
    assert sorted(found["tried"]) == [1024, 2048, 4096, 8192, 12288, 14336]
    assert found["longest_fit"] == 14336 and found["first_oom"] is None
    assert all(cost(n) <= 0.8 * 4 * 2**30 for n in found["tried"])
    assert found["stopped"].startswith("16,384 not tried: a step at 16,384 tokens would need about 4.06 GiB of host")
    assert "4.00 GiB is available (a try may take 80% of it)" in found["stopped"]
    row = found["tried"][12288]
    # predicted before it ran, then measured: both the cost, give or take this process's own drift in resident set
    assert row["predicted"]["host_bytes"] == pytest.approx(cost(12288), abs=16 * MiB)
    assert row["host_peak"] == pytest.approx(cost(12288), abs=16 * MiB)
    assert len(said) == 6 and "12,288 tokens: fits" in said[4]


def test_length_search_stops_before_a_step_predicted_to_be_too_slow():
    found, _ = fake_search(cost=lambda n: MiB, seconds=lambda n: n * n * 1e-7, max_step_seconds=5)
    assert sorted(found["tried"]) == [1024, 2048, 4096]  # 8,192 would take 6.7 s a step: not run, not bisected
    assert found["stopped"] == "8,192 not tried: a step at 8,192 tokens would take about 7 s (max_step_seconds=5)"


def test_length_search_bisects_towards_an_out_of_memory_and_without_a_host_reading_bounds_nothing():
    found, _ = fake_search(cost=lambda n: 64 * MiB + 16 * n * n, seconds=lambda n: 0.01, fits=lambda n: n < 3000,
                           host=(None, None))
    assert sorted(found["tried"]) == [1024, 2048, 2560, 3072, 4096]
    assert (found["longest_fit"], found["first_oom"]) == (2560, 3072)
    assert found["stopped"] == "out of memory at 3,072 tokens"
    found, _ = fake_search(cost=lambda n: 64 * MiB + 16 * n * n, seconds=lambda n: 0.01, host=(None, None))
    assert found["stopped"] == "reached the search limit, max_try_length=262,144"  # no host reading: no host bound


def test_host_peak_sees_memory_freed_before_the_block_ends():
    import torch

    from nbkit.notebook import HostPeak

    with HostPeak() as peak:
        block = torch.ones(64 * MiB // 4)  # 64 MiB, written, so resident
        time.sleep(0.1)
        del block
    assert peak.peak - peak.start >= 48 * MiB, (peak.start, peak.peak)


# ---------------------------------------------------------------------------------------------------------------
# executed on CPU


def run(name: str, workdir: Path, block: tuple[str, ...] = (), params: dict | None = None) -> tuple:
    start = time.perf_counter()
    params = dict(params or PARAMS[name], output_dir=f"nbkit-out/{name}{'-without' if block else ''}")
    nb = execute(NOTEBOOKS / f"{name}.ipynb", workdir, params, block=block)
    seconds = time.perf_counter() - start
    problems = errors(nb)
    assert not problems, "\n\n".join(problems)
    assert stray_outputs(nb) == [], "\n".join(stray_outputs(nb))
    results = json.loads((workdir / params["output_dir"] / "results.json").read_text())
    print(f"{name}: {seconds:.0f} s")
    return nb, results


STOP_TOKEN_WARNING = "has a stop token among its trained labels"  # nbkit.reliability.stop_token's warning


def renamed_argument_warnings(text: str) -> list[str]:
    """transformers 5.2x's FutureWarnings for TrainingArguments' old checkpointing names, as a cell printed them."""
    return re.findall(r"FutureWarning: `gradient_checkpointing\w*` is deprecated", text)


def test_01_qlora_quickstart(workdir):
    from nbkit.demo.models import TINY_RECIPE

    nb, r = run("01_qlora_quickstart", workdir)
    out = workdir / "nbkit-out" / "01_qlora_quickstart"
    # with no GPU and every training parameter at its default, the tiny model trains with the demo's recipe
    assert r["tiny"] and r["load_in_4bit"]
    assert (r["max_steps"], r["batch_size"], r["max_length"], r["learning_rate"]) == (
        TINY_RECIPE.max_steps, TINY_RECIPE.batch_size, TINY_RECIPE.max_length, TINY_RECIPE.learning_rate)
    assert r["steps"] == TINY_RECIPE.max_steps
    assert r["loss_last"] < r["loss_first"], "training loss did not fall"
    assert r["loss_trained"] < r["loss_before"], "held-out loss did not fall"
    # the skill is learned: from no held-out prompt right to at least 80% (the demo's recipe reaches 100%), and every
    # answer after training is a real answer (decoding ran), not an empty string
    assert r["exact_match_before"] == 0.0 and r["exact_match_after"] >= 0.8, r["exact_match_after"]
    assert len(r["answers_after"]) == 16 and all(a.strip() for a in r["answers_after"]), r["answers_after"]
    assert r["tokens_per_second"] > 0 and math.isfinite(r["tokens_per_second"])
    assert any(name.startswith("cached_packing") for name in r["nbkit_attached"])
    # adapter saved, and reloaded onto a fresh 4-bit base it is the same model
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["adapter_files"])
    assert (out / "adapter" / "adapter_model.safetensors").stat().st_size > 0
    assert abs(r["loss_reloaded"] - r["loss_trained"]) <= 1e-5 * r["loss_trained"]
    # merged 16-bit model saved, reloaded, and it kept what training taught it
    assert r["merged_dtype"] == "bfloat16"
    assert (out / "merged-16bit" / "config.json").is_file() and list((out / "merged-16bit").glob("*.safetensors"))
    assert r["loss_merged"] < r["loss_before"] and r["exact_match_merged"] >= 0.5
    # chat after training answers the first held-out question the way the trained model does (streamed, stopped)
    assert r["chat_reply"].strip() == r["answers_after"][0].strip(), (r["chat_reply"], r["answers_after"][0])
    # save_merged merged into the 16-bit base and checked its logits against the adapter model's
    assert r["merge"]["check"] is not None and r["merge"]["check"]["ok"], r["merge"]
    # the GGUF file was read back and checked, has its Modelfile, and the reloaded file answers the same question
    assert r["gguf"]["quant"] == "q8_0" and r["gguf"]["check"]["ok"] and r["gguf"]["modelfile"], r["gguf"]
    assert (out / "gguf" / "model-q8_0.gguf").stat().st_size > 0 and (out / "gguf" / "Modelfile").is_file()
    assert r["gguf_reply"].strip() == r["chat_reply"].strip(), (r["gguf_reply"], r["chat_reply"])
    # the dashboard: one display in the notebook (no flooding), now the static summary with the numbers in it
    assert r["dashboard_mode"] == "widget"
    summaries = dashboard_outputs(nb)
    assert len(summaries) == 1, f"{len(summaries)} dashboard outputs"
    assert_summary_has_numbers(summaries[0])
    assert "VRAM -- (not on CUDA)" in summaries[0]  # CPU: says so instead of showing made-up VRAM
    assert r["dashboard_tokens_per_second_mean"] > 0
    text = all_text(nb)
    assert "setup skipped" in text and "exact match" in text


def test_02_speed_lab(workdir):
    nb, r = run("02_speed_lab", workdir)
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == ["SFTTrainer (plain TRL)", "FastSFT (defaults)", "cached_packing=False",
                          "offload_checkpointing=True", "offload_double_buffer=False", "cuda_graphs=False",
                          "live_dashboard=False"]
    assert r["reference"] == "SFTTrainer (plain TRL)"
    for row in rows.values():
        assert row["tokens_per_second"] > 0 and math.isfinite(row["tokens_per_second"])
        assert len(row["losses"]) == PARAMS["02_speed_lab"]["max_steps"]
        assert row["peak_vram"] is None  # CPU: not measured, and not faked
    # the switches change speed only: at step 1 (same weights, same batch) every run gives plain TRL's loss and
    # gradient norm up to rounding, and in 6 steps the rounding carried forward keeps the curves within 1e-3
    assert r["same_first_step"] and r["first_step_tolerance"] == 1e-4
    assert all(row["first_step_gap"] <= 1e-4 for row in rows.values())
    assert all(row["max_relative_loss_gap"] <= 1e-3 for row in rows.values())
    assert "match 'SFTTrainer (plain TRL)' within 1e-04 relative: True" in all_text(nb)
    assert renamed_argument_warnings(all_text(nb)) == []  # plain TRL's SFTConfig gets the name transformers has
    # each switch did what its name says
    assert rows["SFTTrainer (plain TRL)"]["nbkit_attached"] == []
    assert any(n.startswith("cached_packing") for n in rows["FastSFT (defaults)"]["nbkit_attached"])
    assert not any(n.startswith("cached_packing") for n in rows["cached_packing=False"]["nbkit_attached"])
    assert "offload_checkpointing" in rows["offload_checkpointing=True"]["nbkit_attached"]
    assert "offload_checkpointing" not in rows["FastSFT (defaults)"]["nbkit_attached"]  # "auto" is off on CPU
    assert "cuda_graphs" not in rows["FastSFT (defaults)"]["nbkit_attached"]  # graphs are CUDA's
    # the chart: saved, and shown inline
    assert (workdir / "nbkit-out" / "02_speed_lab" / "speed_lab.png").stat().st_size > 10_000
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    # one dashboard summary per run that had a dashboard (all but live_dashboard=False)
    summaries = dashboard_outputs(nb)
    assert len(summaries) == len(rows) - 1
    for html in summaries:
        assert_summary_has_numbers(html)


def test_03_long_context_with_its_defaults_stops_within_the_machine(workdir):
    """With its defaults (plain TRL and FastSFT, a search limit of 262,144 tokens) on a CPU, the notebook finishes (its
    kernel is not killed for host memory), never runs a try predicted to exceed the host memory it may take, says
    where and why each search stopped, and both trainers give the same loss and gradient norm at every length."""
    from nbkit.memory import host_memory
    from nbkit.notebook import feature

    nb, r = run("03_long_context", workdir)
    text = all_text(nb)
    available, message = feature("nbkit.speedups.offload", "OffloadedCheckpointing")
    assert r["offload_available"] == available
    if not available:  # the notebook must say what is missing, not pretend
        assert "NOT available" in text and message in text
    assert r["paths"] == ["trl", "fastsft"] and r["memory_budget_bytes"] is None
    assert any(name.startswith("cached_packing") for name in r["fastsft_attached"]), r["fastsft_attached"]
    assert f"FastSFT attached: {', '.join(r['fastsft_attached'])}" in text
    _, total = host_memory()
    assert r["start_length"] == 1024 and r["max_step_seconds"] == 15 and r["host_fraction"] == 0.8
    for path in ("trl", "fastsft"):
        tried = {int(k): v for k, v in r["tried"][path].items()}
        lengths = sorted(tried)
        assert lengths[0] == 1024 and lengths == [1024 * 2**i for i in range(len(lengths))]  # doubling
        assert len(lengths) >= 2 and all(row["fits"] for row in tried.values()) and r["first_oom"][path] is None
        assert r["longest_fit"][path] == lengths[-1] < 262144
        assert all(row["tokens_per_second"] > 0 for row in tried.values())
        # stopped by a prediction, before a length it did not try, and says which bound and why
        stopped = r["stopped"][path]
        assert re.match(rf"{lengths[-1] * 2:,} not tried: a step at {lengths[-1] * 2:,} tokens would ", stopped), stopped
        assert ("host memory" in stopped) or ("max_step_seconds=15" in stopped), stopped
        assert f"the search stopped: {stopped}" in text
        # every try after the first was predicted before it ran; none measured more host memory than the machine has
        assert all(tried[n]["predicted"]["host_bytes"] is not None for n in lengths[1:])
        assert all(row["host_peak"] < total for row in tried.values())
    assert r["max_relative_gap"] is not None and r["max_relative_gap"] <= r["tolerance"] == 1e-4
    assert "same loss and gradient norm for both trainers: True" in text
    assert STOP_TOKEN_WARNING not in text  # its documents end with eos: the stop token is trained
    assert renamed_argument_warnings(text) == []
    assert "CPU run: no VRAM limit to find" in text and "| plain TRL |" in text and "| FastSFT |" in text


def test_04_moe_finetune(workdir):
    from nbkit.notebook import feature

    nb, r = run("04_moe_finetune", workdir)
    text = all_text(nb)
    assert r["tiny"] and r["experts"] == 4 and r["lora_on_experts"]
    assert r["loss_last"] < r["loss_first"] and r["loss_trained"] < r["loss_before"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["adapter_files"])
    assert abs(r["loss_reloaded"] - r["loss_trained"]) <= 1e-4 * r["loss_trained"]
    assert r["chat_reply"].strip() == r["answers_after"][0].strip(), (r["chat_reply"], r["answers_after"][0])
    # it ends with an export: the merged MoE model as GGUF, read back and checked by logits, a Modelfile beside it
    assert r["merge"]["check"]["ok"] and r["gguf"]["check"]["ok"] and r["gguf"]["modelfile"], r.get("gguf")
    assert (workdir / "nbkit-out" / "04_moe_finetune" / "gguf" / "model-q8_0.gguf").stat().st_size > 0
    available, message = feature("nbkit.speedups.moe", "FastMoERouting")
    assert r["routing_available"] == available
    if not available:
        assert "NOT available" in text and message in text
        return
    assert r["routing_used"], "fast_moe_routing did not attach to the tiny qwen3_moe"
    # step 1 (same weights, same batch): the two experts paths agree up to rounding; in 10 steps the rounding carried
    # forward keeps the curves within 1e-3
    assert r["first_step_gap"] <= r["first_step_tolerance"] == 1e-4
    assert "same loss and gradient norm within 1e-04 relative: True" in text
    assert r["max_relative_loss_gap"] <= 1e-3
    assert r["plain_tokens_per_second"] > 0
    summaries = dashboard_outputs(nb)
    assert len(summaries) == 2
    for html in summaries:
        assert_summary_has_numbers(html)


# ---------------------------------------------------------------------------------------------------------------
# the honesty rule: with the feature missing, the notebook says what is missing and measures only what exists


def test_03_says_what_is_missing_without_offload(workdir):
    nb, r = run("03_long_context", workdir, block=("nbkit.speedups.offload",), params=TINY_03)
    text = all_text(nb)
    assert not r["offload_available"] and r["switches"] == {"offload_checkpointing": False}
    assert r["missing"] == ["nbkit.speedups.offload cannot be imported (ImportError: No module named 'nbkit.speedups.offload')"]
    assert "offloaded checkpointing is NOT available" in text and r["missing"][0] in text
    assert "FastSFT runs without it" in text and "offload_checkpointing" not in r["fastsft_attached"]
    for path in ("trl", "fastsft"):  # both trainers are still measured, up to the search limit
        assert list(r["tried"][path]) == ["128", "256", "512", "1024"] and r["longest_fit"][path] == 1024
        assert r["stopped"][path] == "reached the search limit, max_try_length=1,024"
    assert r["max_relative_gap"] <= r["tolerance"] == 1e-4  # what exists is compared, nothing made up
    assert STOP_TOKEN_WARNING not in text


def test_03_refuses_a_path_it_does_not_know(workdir):
    with pytest.raises(Exception, match="the paths are 'trl' and 'fastsft'"):
        run("03_long_context", workdir, params=dict(TINY_03, paths=["trl", "unsloth"]))


def test_04_says_what_is_missing_without_moe_routing(workdir):
    nb, r = run("04_moe_finetune", workdir, block=("nbkit.speedups.moe",))
    text = all_text(nb)
    assert not r["routing_available"] and not r["routing_used"]
    assert "nbkit's MoE routing is NOT available" in text and "nbkit.speedups.moe cannot be imported" in text
    assert "fast_moe_routing" not in " ".join(r["nbkit_attached"])
    assert "plain_tokens_per_second" not in r and "skipped: there is no nbkit MoE routing" in text
    assert r["loss_last"] < r["loss_first"]  # the fine-tune itself still works, on transformers' experts path
