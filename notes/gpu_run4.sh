#!/usr/bin/env bash
# Fourth GPU run of session 2 (2026-11-29): issues 3 and 4 on the helpers' code. Each step time-capped.
set -u
timeout 150 python -m pytest -q tests/gpu/test_offload_gpu.py tests/gpu/test_moe_gpu.py 2>&1 | grep -E "passed|failed|Error|^FAILED|^E " | tail -12
timeout 130 python -m nbkit.bench.offload --models 14b --tokens 16384 --layers 0 --configs ckpt,ckpt_offload,nbkit_single,nbkit_double --no-profile 2>&1 | grep -E "^\||Error" | cut -c1-260
timeout 100 python -m nbkit.bench.moe --skip-model 2>&1 | grep -E "^\||Error" | cut -c1-200
timeout 120 python -m nbkit.bench.moe_step 2>&1 | grep -E "^\||Error" | cut -c1-240
timeout 80 python -m nbkit.bench.offload --longest --longest-budget 60 2>&1 | grep -E "^\||Error" | cut -c1-240
