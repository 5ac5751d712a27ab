#!/usr/bin/env bash
# GPU round Q (issue 7): round P's b1 figures of one setting differed by up to 25% between
# processes, so here every setting runs in ONE process on one load of the experts, interleaved,
# three times: prefetch depth 2 and 3, gates off and on, b1 and b4 (scripts/bench_sweep.py).
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
{
date -u
cat /sys/devices/system/node/online 2>/dev/null; nvidia-smi topo -m 2>/dev/null | head -3
timeout 150 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
grep -E "MemTotal|MemAvailable|^Cached" /proc/meminfo
timeout 420 python3 scripts/bench_sweep.py --model /tmp/q30 --depths 2,3 --gates off,on \
  --batch 1,4 --repeats 3 --tokens 32 --profile profiles/h200-xeon16-measured.json \
  2>$OUT/q-sweep.err | tee $OUT/q-sweep.jsonl
tail -2 $OUT/q-sweep.err
date -u
} 2>&1 | tee $OUT/round_q.log
