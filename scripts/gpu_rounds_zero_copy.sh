#!/usr/bin/env bash
# GPU rounds AC to AG (issue 7): zero-copy decode (--moe-zero-copy), the GPU never stopping for the
# host, against offload's host stops. `bash scripts/gpu_rounds_zero_copy.sh ROUND` on the device
# machine; each round is the GPU tests it names, then scripts/bench_sweep.py, offload b1 and b4, on
# one load of the experts (docs/perf.md has the figures).
#   ac  first version (a prefetched slot published by the host once its copy had ended; round AD
#       replaced that with ready marks): host stops against windows 2 and none
#   ad  ready marks, the work list waiting for a queued copy: windows 1, 2, 4
#   ae  the host's in-flight bookkeeping gone; no copy of in-place misses for the next token
#       (FT_ZERO_COPY_MISSES=0, that round's switch, since removed), and depth 3
#   af  cache rates 0.3 and 0.5
#   ag  windows 2, 4, 8 at rate 0.3, with the zero-copy GPU tests of the code as it landed
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
round=${1:?round: ac, ad, ae, af or ag}
tests="tests/engine/test_zero_copy.py tests/engine/test_expert_cache.py tests/engine/test_graphs.py"
tests="$tests tests/engine/test_hybrid.py"
repeats=3
case $round in
  ac) variants="stop:;zc2:ZC=1,WINDOW=2;zc0:ZC=1,WINDOW=0" ;;
  ad) variants="stop:;zc1:ZC=1,WINDOW=1;zc2:ZC=1,WINDOW=2;zc4:ZC=1,WINDOW=4" ;;
  ae) tests=""
      variants="stop:;zc4:ZC=1,WINDOW=4;zc4m0:ZC=1,WINDOW=4,FT_ZERO_COPY_MISSES=0"
      variants="$variants;zc4d3:ZC=1,WINDOW=4,DEPTH=3" ;;
  af) tests="" repeats=2
      variants="stop30:RATE=0.3;zc30:ZC=1,WINDOW=4,RATE=0.3;stop50:RATE=0.5"
      variants="$variants;zc50:ZC=1,WINDOW=4,RATE=0.5" ;;
  ag) tests="tests/engine/test_zero_copy.py" repeats=2
      variants="stop:RATE=0.3;zc2:ZC=1,WINDOW=2,RATE=0.3;zc4:ZC=1,WINDOW=4,RATE=0.3"
      variants="$variants;zc8:ZC=1,WINDOW=8,RATE=0.3" ;;
  *) echo "unknown round $round" >&2; exit 1 ;;
esac
{
date -u
[ -n "$tests" ] && timeout 170 python3 -m pytest -q -x -m gpu $tests 2>&1 | tail -15
[ -f /tmp/q30/config.json ] || synth_q30
date -u
timeout $((585 - SECONDS)) python3 scripts/bench_sweep.py --model /tmp/q30 --tokens 32 $P \
  --batch 1,4 --repeats $repeats --variants "$variants" 2>$OUT/$round.err | tee $OUT/$round.jsonl
date -u
} 2>&1 | tee $OUT/round_$round.log
