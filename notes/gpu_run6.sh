#!/usr/bin/env bash
# Second GPU run of session 3 (2026-11-29): fused LoRA saves before its base GEMM (recompute skips down_proj's GEMM);
# issue 8 tables again with more steps; a profile of the gpt-oss LoRA step (issue 4).
set -u
timeout 90 python -m pytest -q tests/gpu/test_fused_gpu.py 2>&1 | grep -E "passed|failed|Error|^FAILED|^E " | tail -6
timeout 240 python -m nbkit.bench.e2e --shape 14b --tokens 4096,16384 --paths "sft,fastsft" --steps 5 --warmup 2 2>&1 | grep -E "^\||Error|model " | cut -c1-240
timeout 120 python -m nbkit.bench.e2e --shape 1.7b --tokens 16384 --paths "sft,fastsft,fastsft[fused_lora=False;fused_kernels=False],sft_liger" --steps 5 --warmup 2 2>&1 | grep -E "^\||Error|model " | cut -c1-240
timeout 100 python -m nbkit.bench.moe_step --paths fast_lora --profile fast_lora --steps 2 --warmup 2 2>&1 | grep -E "^\||^GPU|^#|Error" | cut -c1-200
