#!/usr/bin/env bash
# GPU round K (issue 7): defaults now CUDA graphs on and the Triton decode attention; offload's
# and hybrid's stops prefetch two layers ahead (misses and prefetches on separate copy streams);
# hybrid prefetches too. The whole GPU test suite, then the 48-layer preset: every strategy at
# depth 2, offload at depth 1 (A/B), and a torch.profiler trace of offload and hybrid.
set -u
source scripts/gpu_env.sh
unset FT_CUDA_GRAPHS  # the defaults are what is measured
decode() {  # decode NAME ARGS...: one `ft bench decode --json` run on the 48 layers, shown
  local name=$1; shift
  timeout ${LIMIT:-150} python3 -m ft bench decode --model /tmp/q30 --tokens 16 --warmup 3 $P \
    --moe-cache-rate 0.15 --json "$@" > $OUT/k-$name.json 2>/tmp/k-$name.err
  echo "== $name ($*)"; show $OUT/k-$name.json; grep -h "Decode attention\|CUDA graphs" /tmp/k-$name.err | head -2
}
{
date -u
echo "== gpu tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15
date -u
timeout 150 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
date -u
LIMIT=170 decode d48 --strategies resident,offload,hybrid --batch 1
decode d48-depth1 --strategies offload --batch 1 --moe-prefetch-depth 1
date -u
timeout 120 python3 -m ft bench decode --model /tmp/q30 --tokens 4 --warmup 2 $P --moe-cache-rate 0.15 \
  --strategies offload,hybrid --batch 1 --trace /tmp/trace > /tmp/k-trace.log 2>&1; tail -3 /tmp/k-trace.log
for f in /tmp/trace/*.trace.json; do gzip -c $f > $OUT/k-$(basename $f).gz; done
cat /tmp/trace/*.ops.txt > $OUT/k-ops.txt 2>/dev/null
ls -la $OUT; date -u
} 2>&1 | tee $OUT/round_k.log
