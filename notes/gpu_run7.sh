#!/usr/bin/env bash
# Third GPU run of session 3 (2026-11-29): gpt-oss attention sinks on the varlen flash ops (issue 4's whole step),
# and why the 1.7B step varies (host time per micro-step; the non-finite-loss sync on/off).
set -u
timeout 150 python -m pytest -q tests/gpu/test_sink_attention_gpu.py tests/gpu/test_packing_gpu.py tests/gpu/test_moe_gpu.py 2>&1 | grep -E "passed|failed|Error|^FAILED|^E " | tail -8
timeout 170 python -m nbkit.bench.moe_step --paths sft,fast,sft_lora,fast_lora --steps 5 --warmup 2 2>&1 | grep -E "^\||Error|max relative" | cut -c1-240
python -c "import json;d=json.load(open('$OUT/moe_step.json'));[print(r['path'],r.get('speedups'),[round(x) for x in r.get('step_ms_all',[])],'host',round(r.get('host_ms',0))) for r in d['rows']]"
cp $OUT/moe_step.json $OUT/moe_step_table.json
timeout 90 python -m nbkit.bench.moe_step --paths fast_lora --profile fast_lora --steps 2 --warmup 2 2>&1 | grep -E "^\||^GPU|^#|Error" | head -40 | cut -c1-160
timeout 150 python -m nbkit.bench.e2e --shape 1.7b --tokens 16384 --paths "sft,fastsft,fastsft[on_nonfinite_loss=off],fastsft[fused_kernels=False]" --steps 8 --warmup 3 2>&1 | grep -E "^\||Error" | cut -c1-240
python -c "import json;d=json.load(open('$OUT/bench_e2e_1.7b.json'));[print(r['path'],[round(x) for x in r['step_ms_all']],'host',round(r.get('host_ms',0))) for r in d['runs']['16384']['rows']]"
