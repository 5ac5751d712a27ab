#!/usr/bin/env bash
# GPU round I (issue 7): the router top-k and work-list kernels: GPU tests, then the 8-layer cut
# (resident and graphed offload) against round G's figures.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache FT_CUDA_GRAPHS=1
P="--profile profiles/h200-xeon16-measured.json"
show() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(x['strategy'], x['batch'], x.get('error') or '', round(x['tok_s'] or 0, 1), (x.get('roofline') or {}).get('bound'), round((x.get('roofline') or {}).get('tok_s') or 0, 1), round(x.get('ratio') or 0, 4)) for x in r['results']]" "$1"; }
{
date -u
echo "== gpu tests"; timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_graphs.py tests/engine/test_gpu.py tests/engine/test_hybrid.py 2>&1 | tail -2
timeout 40 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -1
echo "== 8 layers"; timeout 50 python3 -m ft bench decode --model /tmp/q30-8 --strategies resident --batch 1,4 --tokens 16 $P --json > $OUT/i-d8-resident.json 2>$OUT/i-d8-resident.err; show $OUT/i-d8-resident.json
timeout 50 python3 -m ft bench decode --model /tmp/q30-8 --strategies offload --moe-cache-rate 0.15 --gpu-memory-limit 4 --batch 1,4 --tokens 16 $P --json > $OUT/i-d8-offload.json 2>$OUT/i-d8-offload.err; show $OUT/i-d8-offload.json
date -u
} 2>&1 | tee $OUT/round_i.log
