#!/usr/bin/env bash
# GPU round AI (issue 7): the lean stretch with a cheaper stop on the host (the current stream
# and stream switches without torch's Stream objects, each slot's and expert's parts as views
# made once, the prefetch events dropped in order): the GPU tests of the cache and graphs, the
# stop's phases with the device gaps split by what each stop did, and `ft bench decode`.
set -u
source scripts/gpu_env.sh
{
date -u
tests="tests/engine/test_expert_cache.py tests/engine/test_graphs.py tests/engine/test_zero_copy.py"
tests="$tests tests/engine/test_gpu.py tests/engine/test_grouped_gpu.py"
timeout 150 python3 -m pytest -q -x -m gpu $tests 2>&1 | tail -5
[ -f /tmp/q30/config.json ] || synth_q30
date -u
timeout 200 python3 scripts/bench_stop_phases.py --model /tmp/q30 --tokens 32 --batch 1,4 \
  --repeats 2 2>$OUT/ai_phases.err | tee $OUT/ai_phases.jsonl
date -u
timeout $((590 - SECONDS)) python3 -m ft bench decode --model /tmp/q30 \
  --strategies resident,offload,hybrid --moe-cache-rate 0.15 --batch 1,4 --tokens 32 --warmup 4 \
  $P --json > $OUT/ai_bench.json 2>$OUT/ai_bench.err
show $OUT/ai_bench.json
date -u
} 2>&1 | tee $OUT/round_ai.log
