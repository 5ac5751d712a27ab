#!/usr/bin/env bash
# GPU round AR: an expert's parts side by side in one block, in the store and in each cache
# slot, so a copy is one memcpy (the probe of rounds AP and AQ: ~5 us of the link an expert
# less than three parts). The GPU tests that read the banks (grouped kernels, every format's
# Triton kernels, zero-copy and gates, graphs), then blocks against part-by-part copies
# (FT_EXPERT_COPY=parts) in one process at b1 (the
# session's last device minutes).
set -u
source scripts/gpu_env.sh
{
date -u
timeout 80 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py tests/engine/test_grouped_gpu.py \
  tests/engine/test_expert_cache.py tests/engine/test_gpu.py tests/engine/test_graphs.py 2>&1 | tail -3
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
timeout $((290 - SECONDS)) $OFFLOAD_SWEEP --batch 1 --repeats 2 --variants "parts:FT_EXPERT_COPY=parts;block:" \
  2>$OUT/ar_b1.err | tee $OUT/ar_b1.jsonl
date -u
} 2>&1 | tee $OUT/round_ar.log
