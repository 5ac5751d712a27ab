#!/usr/bin/env bash
# GPU round B: 8-layer offload/hybrid (three fetch fractions), then the 48-layer qwen3-30b-a3b figures.
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache
rm -rf /tmp/q30 /tmp/.q30*
{
date -u
for f in auto 0.25 0.5; do
  echo "== d8 offload/hybrid fetch $f"; timeout 80 python3 -m ft bench decode --model /tmp/q30-8 --strategies offload,hybrid --moe-cache-rate 0.15 --gpu-memory-limit 4 --batch 1,4 --tokens 16 --moe-hybrid-max-fetch $f --out $OUT/d8-offload-$f.json 2>&1 | grep -v "INFO" | tail -9
done
rm -rf /tmp/q30-8
echo "== synth 48"; df -h /tmp | tail -1; timeout 240 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -2; date -u
echo "== q30 resident(graphs)/offload/hybrid"; FT_CUDA_GRAPHS=1 timeout 200 python3 -m ft bench decode --model /tmp/q30 --strategies resident,offload,hybrid --moe-cache-rate 0.15 --batch 1 --tokens 16 --warmup 3 --out $OUT/q30.json 2>&1 | grep -v "^INFO" | tail -10
date -u
} 2>&1 | tee $OUT/round_b.log
