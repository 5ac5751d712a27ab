#!/usr/bin/env bash
# GPU round G (issue 7): fused add+norm / qk-norm+RoPE kernels and offload's prefetch, on the
# 8-layer cut and the 48-layer preset; rooflines from the box's recorded profile.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache FT_CUDA_GRAPHS=1
P="--profile profiles/h200-xeon16-measured.json"
show() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(x['strategy'], x['batch'], x.get('error') or '', round(x['tok_s'] or 0, 1), (x.get('roofline') or {}).get('bound'), round((x.get('roofline') or {}).get('tok_s') or 0, 1), round(x.get('ratio') or 0, 4), {k: round(v, 2) for k, v in (x.get('per_step') or {}).items() if k in ('experts_fetched', 'experts_prefetched', 'prefetch_hits', 'cache_misses')}) for x in r['results']]" "$1"; }
{
date -u
echo "== gpu tests"; timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_graphs.py tests/engine/test_gpu.py tests/engine/test_fused.py 2>&1 | tail -2
timeout 60 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -1
echo "== 8 layers"; timeout 60 python3 -m ft bench decode --model /tmp/q30-8 --strategies resident --batch 1,4 --tokens 16 $P --json > $OUT/g-d8-resident.json 2>$OUT/g-d8-resident.err; show $OUT/g-d8-resident.json
for pf in --moe-prefetch --no-moe-prefetch; do echo "== 8 layers offload $pf"
  timeout 60 python3 -m ft bench decode --model /tmp/q30-8 --strategies offload --moe-cache-rate 0.15 --gpu-memory-limit 4 --batch 1,4 --tokens 16 $pf $P --json > $OUT/g-d8-offload$pf.json 2>$OUT/g-d8-offload$pf.err; show $OUT/g-d8-offload$pf.json; done
rm -rf /tmp/q30-8
echo "== synth 48"; date -u; timeout 200 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
echo "== 48 layers"; date -u
timeout 200 python3 -m ft bench decode --model /tmp/q30 --strategies resident,offload --moe-cache-rate 0.15 --batch 1 --tokens 16 --warmup 3 $P --json > $OUT/g-d48.json 2>$OUT/g-d48.err; show $OUT/g-d48.json
echo "== 48 layers offload --no-moe-prefetch"; date -u
timeout 120 python3 -m ft bench decode --model /tmp/q30 --strategies offload --moe-cache-rate 0.15 --batch 1 --tokens 16 --warmup 3 --no-moe-prefetch $P --json > $OUT/g-d48-nopf.json 2>$OUT/g-d48-nopf.err; show $OUT/g-d48-nopf.json
date -u
} 2>&1 | tee $OUT/round_g.log
