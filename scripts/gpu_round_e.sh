#!/usr/bin/env bash
# GPU round E (issue 7): offload decode as CUDA graphs between the per-layer host stops, against
# eager; kernel-level profile of the graphed steps; the GPU tests of graphs and kernels.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache
{
date -u
echo "== gpu tests"; timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine 2>&1 | tail -5
echo "== synth 8 layers"; timeout 60 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -1
for g in 0 1; do
  echo "== bench decode offload, FT_CUDA_GRAPHS=$g"; date -u
  FT_CUDA_GRAPHS=$g timeout 120 python3 -m ft bench decode --model /tmp/q30-8 --strategies resident,offload \
    --moe-cache-rate 0.15 --gpu-memory-limit 4 --batch 1,4 --tokens 16 --json > $OUT/decode8-graphs$g.json 2> $OUT/decode8-graphs$g.err
  python3 -c "import json,sys; r=json.load(open('$OUT/decode8-graphs$g.json')); [print(x.get('strategy'), x.get('batch'), x.get('tok_s'), x.get('ratio')) for x in r.get('runs', r.get('results', []))]" 2>&1 | head; tail -2 $OUT/decode8-graphs$g.err
done
echo "== profile offload graphs"; date -u
FT_CUDA_GRAPHS=1 timeout 90 python3 scripts/profile_decode.py /tmp/q30-8 offload 2>&1 | grep -v INFO | cut -c1-200 | tail -70
echo "== profile resident graphs"; date -u
FT_CUDA_GRAPHS=1 timeout 60 python3 scripts/profile_decode.py /tmp/q30-8 resident 2>&1 | grep -v INFO | cut -c1-200 | tail -34
date -u
} 2>&1 | tee $OUT/round_e.log
