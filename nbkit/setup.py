"""``python -m nbkit.setup`` (and ``python -m nbkit setup``): run the shipped ``colab_setup.sh`` in this Python.

Why a module: an installed nbkit has no checkout, so the setup script travels inside the package
(``nbkit/colab_setup.sh``, package data) and this module finds and runs it. nbkit's distribution is named
``nbkit-sft`` (the import stays ``nbkit``; "nbkit" on PyPI is an unrelated project). A notebook on Colab or Kaggle
bootstraps with two commands that cannot replace the runtime's torch::

    %pip install --no-deps "nbkit-sft @ git+https://github.com/nbkit/nbkit"  # alone: no dependency is resolved
    !python -m nbkit.setup  # pins torch, then installs nbkit's dependencies and notebooks extra (--from: what)

``main`` (``python -m nbkit setup``, ``python -m nbkit.setup``, ``nbkit setup``) takes the script's options,
``--from SOURCE`` (default ``DEFAULT_SOURCE``), ``--flash``, ``--dry-run``, ``--python`` (default: this
interpreter), with a usage of its own, and ``--check``: say which ``nbkit`` this Python imports (``which_nbkit``
reads the facts, ``judge`` decides; an editable install counts; the script runs it after installing).
``run_setup(args)`` passes ``args`` to the script unchanged. The script's output is streamed line by line (a
notebook shows it live, which ``subprocess.run`` without capture would not: the child would write to the kernel's
own terminal).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import machinery, metadata, resources
from pathlib import Path
from typing import Optional, Sequence, TextIO
from urllib.parse import urlparse
from urllib.request import url2pathname

SCRIPT_NAME = "colab_setup.sh"
RESTART_MARKER = "NBKIT_RESTART_NEEDED="
DISTRIBUTION = "nbkit-sft"  # what pip calls this project; the import is nbkit
DEFAULT_SOURCE = "nbkit-sft @ git+https://github.com/nbkit/nbkit"  # until nbkit-sft is on PyPI
_MODULES = {DISTRIBUTION: "nbkit"}  # distributions whose import name is not theirs with "_" for "-"


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


@dataclass(frozen=True)
class ImportFacts:
    """What decides which ``nbkit`` an ``import nbkit`` here loads (``which_nbkit`` reads them; ``judge`` decides)."""

    owners: tuple[str, ...]  # the distributions that install a top-level package nbkit (normalized names)
    path: Optional[str]  # the package directory the import system finds (None: no nbkit at all)
    project_files: bool  # that directory holds setup.py and colab_setup.sh: this project's package
    editable_from: Optional[str] = None  # the folder nbkit-sft is installed editable from (direct_url.json)


@dataclass(frozen=True)
class ImportCheck:
    """Which ``nbkit`` an ``import nbkit`` in this Python finds, and what to do when it is not this project."""

    facts: ImportFacts
    ours: bool

    @property
    def owners(self) -> tuple[str, ...]:
        return self.facts.owners

    @property
    def path(self) -> Optional[str]:
        return self.facts.path

    def describe(self) -> str:
        facts = self.facts
        if self.ours:
            how = f" editable from {facts.editable_from}" if facts.editable_from else ""
            return f"import nbkit: this project ({DISTRIBUTION}{how}), from {facts.path}"
        found = facts.path or "nothing"
        if facts.path:
            found += f", installed by '{','.join(facts.owners) or 'no distribution'}'"
        return f"import nbkit does not load this project ({DISTRIBUTION}): it finds {found}. {_advice(facts)}"


def _inside(path: Optional[str], folder: Optional[str]) -> bool:
    if not path or not folder:
        return False
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def judge(facts: ImportFacts) -> ImportCheck:
    """This project is what ``import nbkit`` loads when the package found holds its files and nbkit-sft alone
    installed it: per the metadata, or as the editable install's folder (which some build backends' metadata does
    not name as a package)."""
    others = [o for o in facts.owners if o != DISTRIBUTION]
    installed = DISTRIBUTION in facts.owners or _inside(facts.path, facts.editable_from)
    return ImportCheck(facts, bool(facts.path) and facts.project_files and installed and not others)


def _advice(facts: ImportFacts) -> str:
    """What to do when ``import nbkit`` is not this project. Uninstalling nbkit-sft is advised only where it shares
    the package folder with another distribution (removing that one would take nbkit-sft's files along), and then
    with its reinstall; an editable nbkit-sft keeps its files in its checkout, so it is never to be uninstalled."""
    pip = f"{sys.executable} -m pip"
    others = " ".join(o for o in facts.owners if o != DISTRIBUTION)
    if others and facts.editable_from:
        return (f"Run: {pip} uninstall -y {others} ({DISTRIBUTION} stays installed editable from "
                f"{facts.editable_from})")
    if others:
        return (f"Run: {pip} uninstall -y {others} {DISTRIBUTION}, then install {DISTRIBUTION} again "
                f"(colab_setup.sh does both; they share the package folder)")
    if facts.editable_from and facts.path and not _inside(facts.path, facts.editable_from):
        return (f"{facts.path} comes first on sys.path, before {DISTRIBUTION} installed editable from "
                f"{facts.editable_from}: take its folder off PYTHONPATH (or sys.path)")
    if facts.editable_from:
        return (f"{DISTRIBUTION} is installed editable from {facts.editable_from}, which holds no nbkit package "
                f"now: restore that checkout, or install again from where it is: {pip} install -e <checkout>")
    if facts.owners:
        return (f"{DISTRIBUTION} is installed but its package files are missing: install it again, "
                f"{pip} install --force-reinstall --no-deps <what you installed it from>")
    return f"{DISTRIBUTION} is not installed in this Python: install it ({SCRIPT_NAME}, or python -m nbkit setup)"


def _installed_path() -> list[str]:
    """``sys.path`` without the working directory, so that a checkout there does not stand in for an install."""
    here = os.getcwd()
    return [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != here]


def _find_package(path: list[str]) -> Optional[machinery.ModuleSpec]:
    """The spec the import system finds for the top-level ``nbkit``, asking ``sys.meta_path``'s finders in order as
    ``import`` does: the path finder over ``path``, then the others (an editable install's finder among them)."""
    for finder in sys.meta_path:
        if finder is machinery.PathFinder or isinstance(finder, machinery.PathFinder):
            spec = machinery.PathFinder.find_spec("nbkit", path)
        else:
            find = getattr(finder, "find_spec", None)
            spec = find("nbkit", None) if find is not None else None
        if spec is not None:
            return spec
    return None


def _editable_from(path: list[str]) -> Optional[str]:
    """The folder nbkit-sft is installed editable from, per its ``direct_url.json`` (PEP 610); else None."""
    dist = next(iter(metadata.distributions(name=DISTRIBUTION, path=path)), None)
    text = dist.read_text("direct_url.json") if dist is not None else None
    try:
        info = json.loads(text) if text else {}
    except ValueError:
        return None
    url = urlparse(str(info.get("url", "")))
    if not (info.get("dir_info") or {}).get("editable") or url.scheme != "file":
        return None
    return url2pathname(url.path)


def which_nbkit() -> ImportCheck:
    """Which ``nbkit`` ``import nbkit`` finds here, from metadata and files only: nothing is imported or changed.

    The working directory is left out of the search, so a checkout there does not stand in for what is installed.
    Why it matters: "nbkit" on PyPI is an unrelated project that installs the same package directory; whichever was
    installed last owns ``nbkit/__init__.py``. An editable install (``pip install -e``) is found through the finder
    it adds to ``sys.meta_path``, not a folder on ``sys.path``.
    """
    path = _installed_path()
    names = metadata.packages_distributions().get("nbkit", [])
    owners = tuple(sorted({re.sub(r"[-_.]+", "-", name).lower() for name in names}))
    spec = _find_package(path)
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    ours = [p for p in places if all(os.path.isfile(os.path.join(p, f)) for f in ("setup.py", SCRIPT_NAME))]
    found = ours[0] if ours else (places[0] if places else None)
    return judge(ImportFacts(owners, found, bool(ours), _editable_from(path)))


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
            module = _MODULES.get(name, name.replace("-", "_"))
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


def parse_args(argv: Sequence[str]) -> Optional[list[str]]:
    """``nbkit setup``'s options, checked, as the script's arguments (``--python`` always set); None for
    ``--check``."""
    parser = argparse.ArgumentParser(
        prog="nbkit setup",
        description="Install nbkit (the distribution nbkit-sft) and its dependencies into this Python without "
                    "replacing its torch: pins the installed torch, removes a distribution named 'nbkit' (an "
                    "unrelated project on PyPI) if there is one, installs, checks that 'import nbkit' finds this "
                    "project, and reports the GPU, precision, versions and whether to restart. Runs the "
                    f"{SCRIPT_NAME} shipped in the package.",
    )
    parser.add_argument("--from", dest="source", default=DEFAULT_SOURCE, metavar="SOURCE",
                        help="what to install: a requirement for nbkit-sft (default: %(default)r), a git URL "
                             "(git+https://github.com/OWNER/nbkit[@REF]), a wheel (nbkit_sft-*.whl) or a checkout")
    parser.add_argument("--flash", action="store_true",
                        help="also install flash-attn, only as a prebuilt wheel that fits this runtime")
    parser.add_argument("--dry-run", action="store_true", help="print the commands that would install, run none")
    parser.add_argument("--python", default=sys.executable,
                        help="the Python to install into (default: this one, %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="install nothing: say which nbkit this Python imports (exit 1 when not this project)")
    args = parser.parse_args(list(argv))
    if args.check:
        return None
    return (["--from", args.source, "--python", args.python] + (["--flash"] if args.flash else [])
            + (["--dry-run"] if args.dry_run else []))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args is None:
        check = which_nbkit()
        print(check.describe())
        return 0 if check.ours else 1
    return run_setup(args).returncode


if __name__ == "__main__":
    sys.exit(main())
