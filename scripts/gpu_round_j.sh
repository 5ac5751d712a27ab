#!/usr/bin/env bash
# GPU round J (issue 7): the one-launch decode attention (FT_DECODE_ATTENTION=triton against
# SDPA), offload's stop that launches the next stretch before the prefetch copies, and hybrid
# decoding through the host stop (graphed); and whether kernels can read experts from pinned host
# memory fast enough for offload without host stops (scripts/bench_zero_copy.py); the CPU pool's
# compiled kernels for quantised experts (ft bench bw).
#   part 1: GPU tests, the 8-layer cut, bench bw (about 8 min);  part 2: the 48-layer preset (~8 min)
set -u
source scripts/gpu_env.sh
decode() {  # decode NAME MODEL ARGS...: one `ft bench decode --json` run, shown
  local name=$1 model=$2; shift 2
  timeout ${LIMIT:-150} python3 -m ft bench decode --model "$model" --tokens 16 --warmup 3 $P --json "$@" \
    > $OUT/j-$name.json 2>$OUT/j-$name.err; echo "== $name"; show $OUT/j-$name.json
  grep -h "Decode attention" $OUT/j-$name.err | head -1
}
{
date -u
if [ "${1:-1}" = 1 ]; then
  echo "== gpu tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_attention.py \
    tests/engine/test_graphs.py tests/engine/test_gpu.py tests/engine/test_fused.py \
    tests/engine/test_hybrid.py 2>&1 | tail -3
  echo "== zero-copy expert reads (feasibility of offload without host stops)"
  timeout 60 python3 scripts/bench_zero_copy.py > $OUT/j-zero-copy.jsonl 2>&1; cat $OUT/j-zero-copy.jsonl | cut -c1-240
  timeout 60 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -1
  for attn in sdpa triton; do
    FT_DECODE_ATTENTION=$attn decode d8-resident-$attn /tmp/q30-8 --strategies resident --batch 1,4
    FT_DECODE_ATTENTION=$attn decode d8-offload-$attn /tmp/q30-8 --strategies offload,hybrid \
      --moe-cache-rate 0.15 --gpu-memory-limit 4 --batch 1,4
  done
  echo "== CPU MoE pool per format (compiled kernels; bf16's isa_sweep: float32 / native / compiled)"
  timeout 180 python3 -m ft bench bw --out $OUT/j-bw-formats.json \
    2>&1 | grep -v INFO | tail -8
else
  echo "== synth 48"; timeout 200 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
  for attn in sdpa triton; do date -u
    LIMIT=240 FT_DECODE_ATTENTION=$attn decode d48-$attn /tmp/q30 --strategies resident,offload,hybrid \
      --moe-cache-rate 0.15 --batch 1
  done
fi
date -u
} 2>&1 | tee $OUT/round_j${1:-1}.log
