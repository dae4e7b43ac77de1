#!/usr/bin/env bash
# Third GPU run of session 2 (2026-11-29): issue 8 tables (1.7B and 14B QLoRA, side by side), GPU tests.
set -u
python -m pytest -q tests/gpu/test_fused_gpu.py tests/gpu/test_fastsft_gpu.py tests/gpu/test_packing_gpu.py 2>&1 | grep -E "passed|failed|Error|^FAILED" | tail -5
python -m nbkit.bench.e2e --shape 1.7b --tokens 16384 --paths "sft,fastsft,fastsft[fused_lora=False;fused_kernels=False],sft_liger" --steps 5 --warmup 2 2>&1 | grep -E "^\||Error|model " | cut -c1-260
python -m nbkit.bench.e2e --shape 14b --tokens 4096,16384 --paths "sft,fastsft" --steps 3 --warmup 1 2>&1 | grep -E "^\||Error|model " | cut -c1-260
