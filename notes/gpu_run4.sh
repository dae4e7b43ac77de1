#!/usr/bin/env bash
# Fourth GPU run of session 2: issue 3 (offload) GPU tests, 14B full-depth side by side, longest-row search.
set -u
python -m pytest -q -s tests/gpu/test_offload_gpu.py 2>&1 | grep -E "passed|failed|Error|^FAILED|peak|overlap|prefetch" | tail -25
python -m nbkit.bench.offload --models 14b --tokens 16384 --layers 0 --configs ckpt,ckpt_offload,nbkit_single,nbkit_double --no-profile 2>&1 | grep -E "^\||Error|limit" | cut -c1-300
python -m nbkit.bench.offload --longest 2>&1 | grep -E "^\||Error|Mem|limit" | cut -c1-300
