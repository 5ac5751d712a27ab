#!/usr/bin/env bash
# GPU round N (issue 7): device gates (ft.engine.gates): each stretch queued before the host's
# stop it follows, waiting on the device, so the GPU idles only for the host's bookkeeping.
#   0. scripts/probe_gates.py: a gate opens (host store, stream copy) and only then; the round
#      trip's latency. Stops the round if a gate hangs.
#   1. the GPU tests of gates, graphs, the cache and hybrid (gated and not: tokens as eager)
#   2. the 48-layer preset: offload and hybrid with gates at b1 and b4, offload without
#      (FT_DECODE_GATES=0, round K's way) at b1 and b4
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
B="python3 -m ft bench decode --model /tmp/q30 --tokens 16 --warmup 3 $P --json --moe-cache-rate 0.15"
{
date -u
timeout 60 python3 scripts/probe_gates.py || { echo "probe failed: rc $?"; exit 1; }
timeout 200 python3 -m pytest -q -m gpu -o timeout=60 tests/engine/test_graphs.py \
  tests/engine/test_expert_cache.py tests/engine/test_hybrid.py 2>&1 | tail -6; echo
timeout 150 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
FT_DECODE_GATES=1 timeout 150 $B --strategies offload,hybrid --batch 1,4 > $OUT/n-gates.json 2>$OUT/n-gates.err
echo "== gates on (rc $?)"; show $OUT/n-gates.json; tail -2 $OUT/n-gates.err
FT_DECODE_GATES=0 timeout 100 $B --strategies offload --batch 1,4 > $OUT/n-nogates.json 2>/dev/null
echo "== gates off"; show $OUT/n-nogates.json
date -u
} 2>&1 | tee $OUT/round_n.log
