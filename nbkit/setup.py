"""``python -m nbkit.setup`` (and ``python -m nbkit setup``): run the shipped ``colab_setup.sh`` in this Python.

Why a module: a PyPI install has no checkout, so the setup script travels inside the package (``nbkit/colab_setup.sh``,
package data) and this module finds and runs it. A notebook on Colab or Kaggle bootstraps with two commands that
cannot replace the runtime's torch::

    %pip install --no-deps nbkit        # nbkit alone: no dependency is resolved, so torch is not touched
    !python -m nbkit.setup --from pypi  # the script pins torch, then installs nbkit's dependencies

Every argument is passed to the script unchanged (``--from``, ``--flash``, ``--dry-run``; ``--help`` lists them);
``--python`` defaults to this interpreter. The script's output is streamed line by line (a notebook shows it live,
which ``subprocess.run`` without capture would not: the child would write to the kernel's own terminal).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence, TextIO

SCRIPT_NAME = "colab_setup.sh"
RESTART_MARKER = "NBKIT_RESTART_NEEDED="


def detect_platform(environ: Optional[dict] = None) -> str:
    """"colab", "kaggle" or "other", from the variables those runtimes set (the script's own first test)."""
    env = os.environ if environ is None else environ
    if env.get("COLAB_RELEASE_TAG") or env.get("COLAB_GPU"):
        return "colab"
    if env.get("KAGGLE_KERNEL_RUN_TYPE") or env.get("KAGGLE_URL_BASE"):
        return "kaggle"
    return "other"


def script_path() -> Path:
    """The setup script: package data in an installed nbkit, else the checkout's top-level copy."""
    shipped = resources.files("nbkit") / SCRIPT_NAME
    if shipped.is_file():
        return Path(str(shipped))
    checkout = Path(__file__).resolve().parents[1] / SCRIPT_NAME
    if checkout.is_file():
        return checkout
    raise FileNotFoundError(f"{SCRIPT_NAME} is neither in the nbkit package nor beside it: reinstall nbkit")


_CHANGED = re.compile(r"^\s{4}(\S+)\s+(\S+) \(was (\S+)\)\s*$")


@dataclass
class SetupResult:
    returncode: int
    restart_needed: Optional[bool]  # None: unknown (a dry run, or the script failed before deciding)
    output: str

    @property
    def changed(self) -> dict[str, tuple[str, str]]:
        """Packages the script installed or upgraded: name -> (before, after); "-" means "was not installed"."""
        found = {}
        for line in self.output.splitlines():
            match = _CHANGED.match(line)
            if match:
                found[match.group(1)] = (match.group(3), match.group(2))
        return found

    def stale_imports(self) -> list[str]:
        """Changed packages this Python has already imported (old code in memory): a restart is needed for those.

        A notebook whose setup cell runs before it imports torch, transformers & co. has none, and goes on.
        """
        stale = []
        for name, (before, _after) in self.changed.items():
            module = name.replace("-", "_")
            if before != "-" and module in sys.modules:
                stale.append(name)
        return stale


def run_setup(args: Sequence[str] = (), stream: Optional[TextIO] = None) -> SetupResult:
    """Run the setup script with ``args``; stream its output to ``stream`` (default stdout) and parse it."""
    bash = shutil.which("bash")
    if bash is None:
        raise RuntimeError(f"{SCRIPT_NAME} needs bash, which is not on PATH")
    args = list(args)
    if not any(a == "--python" or a.startswith("--python=") for a in args):
        args += ["--python", sys.executable]
    out = stream if stream is not None else sys.stdout
    lines: list[str] = []
    with subprocess.Popen([bash, str(script_path()), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            out.write(line)
            out.flush()
    restart: Optional[bool] = None
    for line in lines:
        if line.startswith(RESTART_MARKER):
            value = line[len(RESTART_MARKER):].strip()
            restart = True if value == "1" else False if value == "0" else None
    return SetupResult(proc.returncode, restart, "".join(lines))


def main(argv: Optional[Sequence[str]] = None) -> int:
    result = run_setup(sys.argv[1:] if argv is None else argv)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
