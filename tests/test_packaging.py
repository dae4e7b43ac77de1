"""Installing nbkit (the distribution ``nbkit-sft``; the import is ``nbkit``) works: the project builds as an sdist and
a wheel (the wheel built from the sdist, so the sdist is complete), both carry the shipped data, the wheel installed
into a fresh virtual environment runs ``python -m nbkit demo`` from outside the source tree, and the setup paths
(colab_setup.sh, and the notebooks' setup cell) replace an unrelated ``nbkit`` (PyPI's "nbkit" is another project)
already in a fresh venv with this project, using the real pip, offline.

The fresh venv gets nbkit from the wheel only (``--no-deps --no-index``); the heavy dependencies (torch,
transformers, ...) are borrowed from the running environment through a ``.pth`` line added *after* the install,
so nothing is downloaded and pip never sees the developer's editable nbkit. Its editable-install hook is not run
(a ``.pth`` line only adds a path; hooks run for ``.pth`` files in site directories), so ``import nbkit`` in the
venv can only find the installed wheel, which the test checks.

Needs ``build`` (pypa/build). The build-and-install tests are marked slow (about a minute on two CPU cores).
"""

from __future__ import annotations

import email
import json
import os
import re
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
    "nbkit/dashboard/__init__.py",
    "nbkit/notebook.py",
    "nbkit/generation.py",
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
    wheels, sdists = list(out.glob("nbkit_sft-*.whl")), list(out.glob("nbkit_sft-*.tar.gz"))
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
    assert meta["Name"] == "nbkit-sft" and meta["Version"] and meta["Requires-Python"]
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
    owner = run_in(venv, tmp_path, "-c", "import nbkit, pathlib; from importlib import metadata; "
                                         "dist = metadata.distribution('nbkit-sft'); print(dist.metadata['Name'], "
                                         "dist.locate_file('nbkit/__init__.py') == pathlib.Path(nbkit.__file__))")
    assert owner.stdout.split() == ["nbkit-sft", "True"], owner.stdout + owner.stderr  # the file imported is its

    result = run_in(venv, tmp_path, "-m", "nbkit", "demo", "--max-steps", "5", "--eval-examples", "8",
                    "--output-dir", "demo-out", "--json", "metrics.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
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
# an unrelated "nbkit" already installed: the setup paths replace it (real pip, offline)

UNRELATED = {"name": "nbkit", "version": "0.0.10", "summary": "jupyter notebook toolkit"}


def unrelated_nbkit_wheel(folder: Path) -> Path:
    """A wheel of an unrelated project named nbkit 0.0.10 with its own nbkit/__init__.py, built here."""
    import base64
    import hashlib

    info = f"{UNRELATED['name']}-{UNRELATED['version']}.dist-info"
    files = {
        "nbkit/__init__.py": b'"""another project that happens to be called nbkit"""\nTOOLKIT = "jupyter"\n',
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {UNRELATED['name']}\nVersion: {UNRELATED['version']}\n"
                             f"Summary: {UNRELATED['summary']}\n").encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/top_level.txt": b"nbkit\n",
    }

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},{digest(data)},{len(data)}\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{UNRELATED['name']}-{UNRELATED['version']}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{info}/RECORD", record)
    return path


def venv_with_unrelated_nbkit(dists: dict, path: Path) -> Path:
    """A fresh venv with pip, holding the unrelated nbkit 0.0.10 (installed by pip) and, as metadata only, the
    dependencies nbkit-sft declares (with its notebooks extra) at the versions this environment has: pip then
    resolves nothing and downloads nothing, and what it installs is this project alone."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    wheel = unrelated_nbkit_wheel(path.parent)
    result = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", str(wheel)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    from importlib import metadata

    with zipfile.ZipFile(dists["wheel"]) as whl:
        meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        requires = email.message_from_bytes(whl.read(meta_name)).get_all("Requires-Dist") or []
    for requirement in requires:  # the core and the notebooks' extra (colab_setup.sh installs it)
        if "extra ==" in requirement and not re.search(r"extra == ['\"]notebooks['\"]", requirement):
            continue
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
        info = site / f"{name.replace('-', '_')}-{metadata.version(name)}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {metadata.version(name)}\n")
    return path


def offline_env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith(("COLAB_", "KAGGLE_", "PIP_"))}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1", CUDA_VISIBLE_DEVICES="",
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return env


def assert_this_project_is_installed(venv: Path, cwd: Path) -> None:
    """``import nbkit`` in ``venv`` is this project, owned by nbkit-sft; no distribution named nbkit is left."""
    check = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import json, nbkit, nbkit.setup; from importlib import metadata\n"
         "try:\n    other = metadata.version('nbkit')\nexcept metadata.PackageNotFoundError:\n    other = None\n"
         "print(json.dumps({'owners': metadata.packages_distributions()['nbkit'], 'other': other, "
         "'file': nbkit.__file__, 'toolkit': hasattr(nbkit, 'TOOLKIT')}))"],
        cwd=cwd, env=offline_env(venv), capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    found = json.loads(check.stdout)
    assert [o.replace("_", "-") for o in found["owners"]] == ["nbkit-sft"] and found["other"] is None, found
    assert Path(found["file"]).resolve().is_relative_to(venv.resolve()) and not found["toolkit"], found


@pytest.mark.slow
def test_colab_setup_replaces_an_unrelated_nbkit_with_this_project(dists, tmp_path):
    venv = venv_with_unrelated_nbkit(dists, tmp_path / "venv")
    result = subprocess.run(["bash", str(ROOT / "colab_setup.sh"), "--python", str(venv / "bin" / "python"),
                             "--from", str(dists["wheel"])], cwd=tmp_path, env=offline_env(venv),
                            capture_output=True, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert "found the distribution 'nbkit' 0.0.10 (jupyter notebook toolkit): an unrelated project" in out
    assert "-m pip uninstall -y nbkit\n" in out
    assert "import nbkit: this project (nbkit-sft), from " in out and "NBKIT_RESTART_NEEDED=" in out
    assert_this_project_is_installed(venv, tmp_path)


@pytest.mark.slow
def test_the_notebook_setup_cell_replaces_an_unrelated_nbkit_with_this_project(dists, tmp_path):
    """The notebooks' setup cell (plain Python: run here by the venv's interpreter, as a kernel would), on a hosted
    runtime, with an unrelated nbkit installed: it removes it, installs this project alone, runs its setup."""
    import nbformat

    venv = venv_with_unrelated_nbkit(dists, tmp_path / "venv")
    cells = [c for c in nbformat.read(ROOT / "notebooks" / "01_qlora_quickstart.ipynb", as_version=4).cells
             if c.cell_type == "code"]
    params = f"run_setup = True\nnbkit_source = {str(dists['wheel'])!r}\nsetup_options = []\n"
    script = tmp_path / "setup_cell.py"
    script.write_text(params + cells[1].source + "\n")
    result = subprocess.run([str(venv / "bin" / "python"), str(script)], cwd=tmp_path, env=offline_env(venv),
                            capture_output=True, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert "a distribution named 'nbkit' (0.0.10) is installed: this project's is nbkit-sft" in out
    assert "+ pip uninstall -y nbkit\n" in out and f"+ pip install -q --no-deps {dists['wheel']}" in out
    assert "import nbkit: this project (nbkit-sft)" in out  # colab_setup.sh ran, from the package just installed
    assert_this_project_is_installed(venv, tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# the setup entry point, from the checkout (fast)


def test_nbkit_setup_has_its_own_usage():
    """``nbkit setup --help`` describes nbkit setup (not ``bash colab_setup.sh``) and lists every option the script
    takes; a bad option is refused before anything runs."""
    result = subprocess.run([sys.executable, "-m", "nbkit", "setup", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: nbkit setup") and "colab_setup.sh [" not in result.stdout
    script_options = set(re.findall(r"^  (--[a-z-]+)", (ROOT / "colab_setup.sh").read_text(), re.M))
    assert script_options == {"--from", "--flash", "--dry-run", "--python"}
    assert all(option in result.stdout for option in script_options)
    assert "nbkit-sft @ git+https://github.com/nbkit/nbkit" in result.stdout  # the default source
    bad = subprocess.run([sys.executable, "-m", "nbkit", "setup", "--bogus"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr


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
              "    nbkit-sft     0.1.0 (was -)\n"
              "NBKIT_RESTART_NEEDED=1\n")
    result = SetupResult(0, True, output)
    assert result.changed == {"transformers": ("4.57.1", "5.17.0"), "flash-attn": ("2.8.2", "2.8.3"),
                              "nbkit-sft": ("-", "0.1.0")}
    stale = result.stale_imports()
    assert "transformers" in stale and "nbkit-sft" not in stale  # nbkit was not installed before: nothing stale
    assert "nbkit" in sys.modules  # imported (nbkit.setup above), so an upgraded nbkit-sft, import nbkit, is stale
    upgraded = SetupResult(0, True, "    nbkit-sft     0.2.0 (was 0.1.0)\nNBKIT_RESTART_NEEDED=1\n")
    assert upgraded.stale_imports() == ["nbkit-sft"]
    assert ("flash-attn" in stale) == ("flash_attn" in sys.modules)
    assert SetupResult(0, False, "NBKIT_RESTART_NEEDED=0\n").stale_imports() == []
    assert detect_platform({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}) == "kaggle"
    assert detect_platform({"COLAB_GPU": "1"}) == "colab" and detect_platform({}) == "other"
