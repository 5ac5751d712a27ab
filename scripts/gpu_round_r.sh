#!/usr/bin/env bash
# GPU round R (issue 7): a shorter host stop at batch 1. Round Q put ~38 us of each ~209 us
# MoE-layer cycle on the host's stop while the GPU idles. The two switches below lived on an
# experiment branch only (FT_EXP_*): "uva" landed as the cache's only way, "pinned" did not.
#   uva:    FT_EXP_TABLE=uva, the expert kernel reads the slot table in pinned host memory,
#           so the stop copies no table row to the device;
#   pinned: FT_EXP_STOP=pinned, the stretch copies its stop rows to pinned host memory inside
#           the graph, and the host syncs and reads them there (no pageable copy after it)
# 1. the GPU tests of graphs, cache, hybrid, as they are and with both switches (tokens as eager)
# 2. scripts/bench_sweep.py: the four variants interleaved, three times, b1 and b4, one load
# 3. scripts/bench_stop_phases.py: the host's phases per layer, base and both
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
T="tests/engine/test_graphs.py tests/engine/test_expert_cache.py tests/engine/test_hybrid.py"
V="base:;uva:FT_EXP_TABLE=uva;pinned:FT_EXP_STOP=pinned;both:FT_EXP_TABLE=uva,FT_EXP_STOP=pinned"
{
date -u
timeout 150 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 > /tmp/synth.log 2>&1 &
timeout 100 python3 -m pytest -q -m gpu -o timeout=60 $T 2>&1 | tail -3
FT_EXP_TABLE=uva FT_EXP_STOP=pinned timeout 100 python3 -m pytest -q -m gpu -o timeout=60 $T 2>&1 | tail -3
wait; tail -1 /tmp/synth.log; date -u
timeout 240 python3 scripts/bench_sweep.py --model /tmp/q30 --variants "$V" --batch 1,4 \
  --repeats 3 --tokens 32 --profile profiles/h200-xeon16-measured.json \
  2>$OUT/r-sweep.err | tee $OUT/r-sweep.jsonl
tail -2 $OUT/r-sweep.err; date -u
timeout 120 python3 scripts/bench_stop_phases.py --model /tmp/q30 --tokens 32 \
  --variants "base:;both:FT_EXP_TABLE=uva,FT_EXP_STOP=pinned" --repeats 2 \
  2>$OUT/r-phases.err | tee $OUT/r-phases.jsonl
tail -2 $OUT/r-phases.err
date -u
} 2>&1 | tee $OUT/round_r.log
