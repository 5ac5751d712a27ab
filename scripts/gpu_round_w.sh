#!/usr/bin/env bash
# GPU round W (issue 7): a bounded prefetch window. Round T's traces: the demand misses' copies
# and the prefetches share one copy engine in order of arrival, so a miss waited a median 179 us
# (p90 850) behind prefetches of later layers while its layer's compute waited for it.
# FT_PREFETCH_WINDOW=N (the experiment's switch, in an uncommitted cache.py; it landed as
# --moe-prefetch-window after round Z) keeps at most N prefetched experts queued on the engine
# and the rest on the host, queued at the next stops, nearest layer first. Run by a session cut
# off before it landed anything; its figures survive only in docs/perf.md (round W).
# 1. the GPU tests of graphs and the cache, as they are and with a window of 2 (tokens as eager)
# 2. scripts/bench_sweep.py b1: no window, 1, 2, 3, interleaved, four runs each, one load
# 3. b4: no window, 2, 4, 8, three runs each, one load
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
T="tests/engine/test_graphs.py tests/engine/test_expert_cache.py"
S="python3 scripts/bench_sweep.py --model /tmp/q30 --tokens 32 $P"
W="FT_PREFETCH_WINDOW"
{
date -u
synth_q30 > /tmp/synth.log &
timeout 100 python3 -m pytest -q -m gpu -o timeout=60 $T 2>&1 | tail -2
FT_PREFETCH_WINDOW=2 timeout 100 python3 -m pytest -q -m gpu -o timeout=60 $T 2>&1 | tail -2
wait; cat /tmp/synth.log; date -u
timeout 230 $S --batch 1 --repeats 4 --variants "off:;w1:$W=1;w2:$W=2;w3:$W=3" \
  2>$OUT/w-b1.err | tee $OUT/w-b1.jsonl
date -u
timeout 200 $S --batch 4 --repeats 3 --variants "off:;w2:$W=2;w4:$W=4;w8:$W=8" \
  2>$OUT/w-b4.err | tee $OUT/w-b4.jsonl
date -u
} 2>&1 | tee $OUT/round_w.log
