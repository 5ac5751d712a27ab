#!/usr/bin/env bash
# GPU round AH (issue 7): a leaner decode stretch for offload's host stops (the handoff written by
# the stretch's own kernels, one GEMM and one top-k for the cut's routing and its guesses, RoPE's
# tables gathered inside the q/k kernel) against the stretch as it was (FT_LEAN_STRETCH=0, this
# round's switch, since removed); the host's cost of each CUDA call a stop makes; the GPU tests.
set -u
source scripts/gpu_env.sh
{
date -u
python3 scripts/probe_host_calls.py --iters 2000 | tee $OUT/host_calls.json
tests="tests/engine/test_zero_copy.py tests/engine/test_expert_cache.py tests/engine/test_graphs.py"
tests="$tests tests/engine/test_hybrid.py tests/engine/test_grouped_gpu.py"
tests="$tests tests/engine/test_attention.py tests/engine/test_gpu.py"
timeout 200 python3 -m pytest -q -x -m gpu $tests 2>&1 | tail -15
[ -f /tmp/q30/config.json ] || synth_q30
date -u
timeout $((590 - SECONDS)) python3 scripts/bench_stop_phases.py --model /tmp/q30 --tokens 32 \
  --batch 1,4 --repeats 3 --variants "lean:;old:FT_LEAN_STRETCH=0" 2>$OUT/ah.err | tee $OUT/ah.jsonl
date -u
} 2>&1 | tee $OUT/round_ah.log
