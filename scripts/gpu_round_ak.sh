#!/usr/bin/env bash
# GPU round AK (issue 7): where a decode stretch's GPU time goes, kernel by kernel, and whether
# decode's dense matmuls and expert kernels have room: torch.profiler over resident and offload
# steps of the 8-layer cut (b1, b4), decode's matmul shapes through cuBLAS against Triton GEMV
# candidates, and the expert kernels' tile sweep at b1 and b4.
set -u
source scripts/gpu_env.sh
{
date -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 60 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -1
date -u
timeout 150 python3 scripts/profile_kernels.py --model /tmp/q30-8 --strategies resident,offload \
  --batch 1,4 --steps 8 --top 18 2>$OUT/ak_kernels.err | tee $OUT/ak_kernels.jsonl
date -u
timeout 150 python3 scripts/bench_linear.py --batches 1,4 2>$OUT/ak_linear.err > $OUT/ak_linear.jsonl
grep '"best"' $OUT/ak_linear.jsonl
date -u
timeout $((560 - SECONDS)) python3 scripts/bench_moe_kernels.py --formats bf16 --batches 1,4 \
  --shapes qwen3-30b-a3b --sweep 2>$OUT/ak_moe.err | tee $OUT/ak_moe.jsonl
date -u
} 2>&1 | tee $OUT/round_ak.log
