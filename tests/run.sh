#!/usr/bin/env bash
# Installs what the tests need and runs them: the README's test command, and what CI runs (.ci/run).
# Works on a fresh machine with Python 3.10+ and nothing else: creates .venv unless a virtualenv is active.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install -q --upgrade pip
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
python -c 'import torch' 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -c tests/constraints.txt -e ".[dev]"

# System tools some tests use (shellcheck for colab_setup.sh, Chromium for the dashboard's browser test).
# Installed when we are root with apt; the tests that need them skip with a reason otherwise.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v shellcheck >/dev/null || missing+=(shellcheck)
  command -v chromium >/dev/null || missing+=(chromium)
  if [ ${#missing[@]} -gt 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
      || echo "tests/run.sh: could not install ${missing[*]}; the tests that need them will skip"
  fi
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# the full demo (~1 min): it must reach >= 90% held-out exact match
export NBKIT_TEST_FULL_DEMO="${NBKIT_TEST_FULL_DEMO:-1}"
python -m pytest -q -ra "$@"
