#!/usr/bin/env bash
# First GPU run of session 3 (2026-11-29): where does a 14B FastSFT step go after the fused switches? (issue 8)
set -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
timeout 330 python -m nbkit.bench.e2e --shape 14b --tokens 16384 --paths fastsft --profile fastsft --steps 2 --warmup 2 2>&1 | grep -vE "Warning|warn\(" | grep -E "^\||^GPU|^#|Error|model |step_ms" | cut -c1-200
timeout 150 python -m nbkit.bench.e2e --shape 1.7b --tokens 16384 --paths fastsft --profile fastsft --steps 2 --warmup 2 2>&1 | grep -E "^\||^GPU|^#|Error|model |step_ms" | cut -c1-200
rm -f $OUT/trace_*.json
