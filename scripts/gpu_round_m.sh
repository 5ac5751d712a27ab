#!/usr/bin/env bash
# GPU round M (issue 7), for the next session: the prefetch depth on the full preset at batch 1
# and 4 (round L found depth 1 faster on the 8-layer cut, round K depth 2 on 48 layers), and how
# long the end-to-end `ft demo` takes on CUDA with and without graphs (it ran out of its 290 s in
# round K; no GPU run of it has been seen to finish).
#   part 1: the 48-layer preset, depth 1, 2, 3 at batch 1 and 4 (~8 min)
#   part 2: ft demo on CUDA, graphs on, then off (up to 2 x 280 s)
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS
{
date -u
if [ "${1:-1}" = 1 ]; then
  timeout 150 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
  for depth in 2 1 3; do
    timeout 150 python3 -m ft bench decode --model /tmp/q30 --tokens 16 --warmup 3 $P --json \
      --strategies offload --moe-cache-rate 0.15 --batch 1,4 --moe-prefetch-depth $depth \
      > $OUT/m-depth$depth.json 2>/dev/null
    echo "== depth $depth"; show $OUT/m-depth$depth.json
  done
else
  for graphs in 1 0; do
    start=$(date +%s)
    FT_CUDA_GRAPHS=$graphs timeout 280 python3 -m ft demo --out /tmp/demo-$graphs --device cuda \
      --prompts 1 --max-tokens 16 --repeats 2 --diagnose-prompts 4 --json > $OUT/m-demo-$graphs.json 2>/tmp/demo-$graphs.err
    echo "== demo FT_CUDA_GRAPHS=$graphs: rc $? in $(( $(date +%s) - start )) s"; tail -3 /tmp/demo-$graphs.err
  done
fi
date -u
} 2>&1 | tee $OUT/round_m${1:-1}.log
