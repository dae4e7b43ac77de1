#!/usr/bin/env bash
# Fourth GPU run of session 3 (2026-11-29): final tables for issues 8 and 4 on the final code (non-finite check
# moved after the backward: no host sync between forward and backward).
set -u
timeout 100 python -m pytest -q tests/gpu/test_moe_gpu.py tests/gpu/test_oom_gpu.py tests/gpu/test_fastsft_gpu.py 2>&1 | grep -E "passed|failed|Error|^FAILED|^E " | tail -8
timeout 130 python -m nbkit.bench.e2e --shape 1.7b --tokens 16384 --paths "sft,fastsft,fastsft[fused_lora=False;fused_kernels=False],sft_liger" --steps 8 --warmup 3 2>&1 | grep -E "^\||Error" | cut -c1-240
python -c "import json;d=json.load(open('$OUT/bench_e2e_1.7b.json'));[print(r['path'],[round(x) for x in r['step_ms_all']],'host',round(r.get('host_ms',0))) for r in d['runs']['16384']['rows']]"
timeout 240 python -m nbkit.bench.e2e --shape 14b --tokens 4096,16384 --paths "sft,fastsft" --steps 5 --warmup 2 2>&1 | grep -E "^\||Error|model " | cut -c1-240
python -c "import json;d=json.load(open('$OUT/bench_e2e_14b.json'));[print(t,r['path'],[round(x) for x in r['step_ms_all']],'host',round(r.get('host_ms',0))) for t,run in d['runs'].items() for r in run['rows']]"
timeout 110 python -m nbkit.bench.moe_step --paths sft_lora,fast_lora,sft,fast --steps 5 --warmup 2 2>&1 | grep -E "^\||Error|max relative" | cut -c1-240
