"""``pip install nbkit`` works: the project builds as an sdist and a wheel (the wheel built from the sdist, so the sdist
is complete), both carry the shipped data, and the wheel installed into a fresh virtual environment runs
``python -m nbkit demo`` from outside the source tree.

The fresh venv gets nbkit from the wheel only (``--no-deps --no-index``); the heavy dependencies (torch,
transformers, ...) are borrowed from the running environment through a ``.pth`` line added *after* the install,
so nothing is downloaded and pip never sees the developer's editable nbkit. Its editable-install hook is not run
(a ``.pth`` line only adds a path; hooks run for ``.pth`` files in site directories), so ``import nbkit`` in the
venv can only find the installed wheel, which the test checks.

Needs ``build`` (pypa/build). The build-and-install tests are marked slow (about a minute on two CPU cores).
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
WHEEL_MUST_HAVE = [
    "nbkit/__init__.py",
    "nbkit/__main__.py",
    "nbkit/trainer.py",
    "nbkit/config.py",
    "nbkit/loading.py",
    "nbkit/dashboard.py",
    "nbkit/notebook.py",
    "nbkit/setup.py",
    "nbkit/colab_setup.sh",
    "nbkit/demo/run.py",
    "nbkit/demo/data.py",
    "nbkit/demo/models.py",
    "nbkit/demo/tokenizer.py",
    *[f"nbkit/demo/assets/tokenizer/{name}" for name in TOKENIZER_FILES],
]


def source_files() -> list[Path]:
    """The files of the checkout a release would be built from: tracked and untracked-but-not-ignored."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
        return [Path(p) for p in out.split("\0") if p and (ROOT / p).exists()]
    skip = {".venv", ".git", "build", "dist", "__pycache__", ".pytest_cache", "nbkit-out"}
    return [p.relative_to(ROOT) for p in ROOT.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("build", reason="needs pypa/build: pip install build")
    tmp = tmp_path_factory.mktemp("packaging")
    src, out = tmp / "src", tmp / "dist"
    for rel in source_files():  # a copy: building in place would leave build/ and *.egg-info in the checkout
        target = src / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target, follow_symlinks=False)
    # sdist first, then the wheel from the unpacked sdist (build's default); no isolation: use this env's setuptools
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check",
                             "--outdir", str(out), str(src)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    wheels, sdists = list(out.glob("nbkit-*.whl")), list(out.glob("nbkit-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "tmp": tmp}


@pytest.mark.slow
def test_wheel_ships_code_data_and_metadata(dists):
    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = set(whl.namelist())
        missing = [name for name in WHEEL_MUST_HAVE if name not in names]
        assert not missing, f"not in the wheel: {missing}"
        assert not any(n.startswith(("tests/", "notebooks/", "tools/")) for n in names)
        assert whl.read("nbkit/colab_setup.sh") == (ROOT / "colab_setup.sh").read_bytes()
        for name in TOKENIZER_FILES:
            assert whl.read(f"nbkit/demo/assets/tokenizer/{name}") == (
                ROOT / "nbkit" / "demo" / "assets" / "tokenizer" / name).read_bytes()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(whl.read(f"{info}/METADATA"))
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    assert meta["Name"] == "nbkit" and meta["Version"] and meta["Requires-Python"]
    assert meta["Summary"] and (meta["License-Expression"] or meta["License"])
    requires = " ".join(meta.get_all("Requires-Dist") or [])
    for dep in ("torch", "transformers", "trl", "peft", "bitsandbytes", "datasets", "accelerate", "ipywidgets"):
        assert dep in requires, f"{dep} not declared"
    assert "nbkit = nbkit.__main__:main" in entry_points


@pytest.mark.slow
def test_sdist_ships_sources_and_data(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        members = {m.name.split("/", 1)[1]: m for m in sdist.getmembers() if "/" in m.name}
        for name in ["pyproject.toml", *WHEEL_MUST_HAVE]:
            assert name in members, f"not in the sdist: {name}"
        script = members["nbkit/colab_setup.sh"]
        if script.issym():  # kept as a link: its target must be in the sdist too
            assert script.linkname == "../colab_setup.sh" and "colab_setup.sh" in members
        else:
            assert sdist.extractfile(script).read() == (ROOT / "colab_setup.sh").read_bytes()


@pytest.fixture(scope="module")
def venv(dists) -> Path:
    """A fresh venv with the wheel installed (nothing else), then the running env's packages made visible."""
    path = dists["tmp"] / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    result = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(dists["wheel"])],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    borrowed = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "zz_borrowed_deps.pth").write_text("".join(f"{p}\n" for p in borrowed))
    return path


def run_in(venv: Path, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONNOUSERSITE="1",
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run([str(venv / "bin" / "python"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_installed_wheel_runs_the_demo(venv, tmp_path):
    where = run_in(venv, tmp_path, "-c", "import nbkit, nbkit.demo.tokenizer as t; print(nbkit.__file__); "
                                         "print(t.demo_tokenizer_path())")
    assert where.returncode == 0, where.stderr
    module, tokenizer_dir = where.stdout.split()
    assert Path(module).resolve().is_relative_to(venv.resolve()), f"imported {module}, not the installed wheel"
    assert Path(tokenizer_dir).resolve().is_relative_to(venv.resolve())

    result = run_in(venv, tmp_path, "-m", "nbkit", "demo", "--max-steps", "5", "--eval-examples", "8",
                    "--output-dir", "demo-out", "--json", "metrics.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    import json

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 5 and metrics["tokens_per_second"] > 0
    assert (tmp_path / "demo-out" / "adapter" / "adapter_model.safetensors").is_file()
    assert "tokens/s" in result.stdout


@pytest.mark.slow
def test_installed_wheel_runs_its_setup_script(venv, tmp_path):
    """``python -m nbkit.setup`` finds colab_setup.sh inside the installed package (a PyPI install has no checkout)."""
    result = run_in(venv, tmp_path, "-m", "nbkit.setup", "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "platform: other" in result.stdout
    assert "NBKIT_RESTART_NEEDED=unknown" in result.stdout
    located = run_in(venv, tmp_path, "-c", "from nbkit.setup import script_path; print(script_path())")
    assert Path(located.stdout.strip()).resolve().is_relative_to(venv.resolve())


# ---------------------------------------------------------------------------------------------------------------
# the setup entry point, from the checkout (fast)


def test_setup_entry_point_runs_the_script_dry(tmp_path):
    """``python -m nbkit setup --dry-run`` runs colab_setup.sh in this Python and reports; nothing is installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLAB_", "KAGGLE_"))}
    result = subprocess.run([sys.executable, "-m", "nbkit", "setup", "--dry-run"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "platform: other" in result.stdout and sys.executable in result.stdout
    assert "NBKIT_RESTART_NEEDED=unknown" in result.stdout
    env["COLAB_RELEASE_TAG"] = "release-colab_20250101-060000_RC00"
    result = subprocess.run([sys.executable, "-m", "nbkit.setup", "--dry-run"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "platform: colab" in result.stdout, result.stdout + result.stderr


def test_setup_result_says_which_changes_need_a_restart():
    """A restart is needed only for packages that changed *and* that this Python already imported."""
    import transformers  # noqa: F401 - imported, so a changed transformers is stale

    from nbkit.setup import SetupResult, detect_platform

    output = ("[nbkit-setup] versions:\n"
              "    torch         2.13.0\n"
              "    transformers  5.17.0 (was 4.57.1)\n"
              "    flash-attn    2.8.3 (was 2.8.2)\n"
              "    nbkit         0.1.0 (was -)\n"
              "NBKIT_RESTART_NEEDED=1\n")
    result = SetupResult(0, True, output)
    assert result.changed == {"transformers": ("4.57.1", "5.17.0"), "flash-attn": ("2.8.2", "2.8.3"),
                              "nbkit": ("-", "0.1.0")}
    stale = result.stale_imports()
    assert "transformers" in stale and "nbkit" not in stale  # nbkit was not installed before: nothing stale
    assert ("flash-attn" in stale) == ("flash_attn" in sys.modules)
    assert SetupResult(0, False, "NBKIT_RESTART_NEEDED=0\n").stale_imports() == []
    assert detect_platform({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}) == "kaggle"
    assert detect_platform({"COLAB_GPU": "1"}) == "colab" and detect_platform({}) == "other"
