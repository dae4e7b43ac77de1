"""``python -m nbkit setup --check``: which ``nbkit`` this Python imports. An editable install (what
``tests/run.sh``'s ``pip install -e ".[dev]"`` makes; found through an import finder, not a folder on ``sys.path``)
is recognized from outside the checkout, and a working nbkit-sft is never advised to be uninstalled. The decision
itself is checked on fake facts (``ImportFacts``); the subprocess test uses this Python's real install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest

from nbkit.setup import DISTRIBUTION

ROOT = Path(__file__).resolve().parents[1]


def editable_checkout() -> Path | None:
    """The folder nbkit-sft is installed editable from in this Python, per its direct_url.json; else None. The
    working directory is left out: a checkout's own ``nbkit_sft.egg-info`` is no install."""
    here = os.getcwd()
    path = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != here]
    dist = next(iter(metadata.distributions(name=DISTRIBUTION, path=path)), None)
    text = dist.read_text("direct_url.json") if dist is not None else None
    info = json.loads(text) if text else {}
    if not (info.get("dir_info") or {}).get("editable"):
        return None
    return Path(url2pathname(urlparse(info["url"]).path))


def test_the_check_recognizes_an_editable_install_from_outside_the_checkout(tmp_path):
    checkout = editable_checkout()
    if checkout is None:
        pytest.skip(f"{DISTRIBUTION} is not installed editable in this Python (tests/run.sh installs it so)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what is installed may be found
    result = subprocess.run([sys.executable, "-m", "nbkit", "setup", "--check"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"import nbkit: this project ({DISTRIBUTION} editable from {checkout}), from {checkout / 'nbkit'}" \
        in result.stdout
    assert "uninstall" not in result.stdout + result.stderr


def test_a_working_editable_install_is_this_project_and_not_to_be_uninstalled():
    from nbkit.setup import ImportFacts, judge

    facts = ImportFacts(owners=(DISTRIBUTION,), path="/src/nbkit/nbkit", project_files=True,
                        editable_from="/src/nbkit")
    check = judge(facts)
    assert check.ours
    assert check.describe() == f"import nbkit: this project ({DISTRIBUTION} editable from /src/nbkit), from " \
                               "/src/nbkit/nbkit"
    # an editable install whose metadata names no top-level package (other build backends) is still this project
    assert judge(ImportFacts((), "/src/nbkit/nbkit", True, "/src/nbkit")).ours


def test_an_unrelated_nbkit_beside_an_editable_install_is_the_only_one_to_uninstall():
    from nbkit.setup import ImportFacts, judge

    check = judge(ImportFacts(("nbkit", DISTRIBUTION), "/site/nbkit", False, "/src/nbkit"))
    text = check.describe()
    assert not check.ours and "does not load this project" in text
    assert "-m pip uninstall -y nbkit " in text and f"uninstall -y nbkit {DISTRIBUTION}" not in text
    assert f"{DISTRIBUTION} stays installed editable from /src/nbkit" in text


def test_an_editable_install_whose_checkout_is_gone_is_reinstalled_not_uninstalled():
    from nbkit.setup import ImportFacts, judge

    text = judge(ImportFacts((DISTRIBUTION,), None, False, "/src/nbkit")).describe()
    assert "it finds nothing" in text and "/src/nbkit" in text and "install -e" in text
    assert "uninstall" not in text


def test_a_package_folder_shared_with_an_unrelated_nbkit_is_replaced_by_reinstalling():
    """Both own site/nbkit/: uninstalling the unrelated one alone would take this project's files with it."""
    from nbkit.setup import ImportFacts, judge

    text = judge(ImportFacts(("nbkit", DISTRIBUTION), "/site/nbkit", True, None)).describe()
    assert f"installed by 'nbkit,{DISTRIBUTION}'" in text
    assert f"-m pip uninstall -y nbkit {DISTRIBUTION}, then install {DISTRIBUTION} again" in text


def test_a_regular_install_is_this_project_and_nothing_installed_says_to_install():
    from nbkit.setup import ImportFacts, judge

    assert judge(ImportFacts((DISTRIBUTION,), "/site/nbkit", True, None)).describe() == \
        f"import nbkit: this project ({DISTRIBUTION}), from /site/nbkit"
    text = judge(ImportFacts((), None, False, None)).describe()
    assert f"{DISTRIBUTION} is not installed" in text and "uninstall" not in text
    shadow = judge(ImportFacts((DISTRIBUTION,), "/elsewhere/nbkit", False, "/src/nbkit")).describe()
    assert "/elsewhere/nbkit" in shadow and "PYTHONPATH" in shadow and "uninstall" not in shadow
