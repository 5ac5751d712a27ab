#!/usr/bin/env bash
# GPU round AW: --moe-prefetch-depth auto (3 at batch 1, 2 above, with device gates; round AU:
# depth 3 +1.4% at b1, -1.4% at b4): the GPU tests of zero-copy, gates and graphs, then
# `ft bench decode` for the record at b1 and b4 (the session's last device minutes).
set -u
source scripts/gpu_env.sh
{
date -u
timeout 120 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py tests/engine/test_graphs.py \
  tests/engine/test_gpu.py -rs 2>&1 | tail -3
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
record_offload aw_bench 430
grep "MoE prefetch" $OUT/aw_bench.err | head -1
date -u
} 2>&1 | tee $OUT/round_aw.log
