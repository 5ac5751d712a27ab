#!/usr/bin/env bash
# GPU round F (issue 7): decode after graphed offload + fused attention inputs; 8-layer cut and
# the full 48-layer preset; the accelerate peer on the 8-layer cut with the same GPU budget.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache FT_CUDA_GRAPHS=1
show() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(x['strategy'], x['batch'], x.get('error') or '', round(x['tok_s'] or 0, 1), (x.get('roofline') or {}).get('bound'), round((x.get('roofline') or {}).get('tok_s') or 0, 1), round(x.get('ratio') or 0, 4)) for x in r['results']]" "$1"; }
{
date -u
echo "== gpu tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine 2>&1 | tail -2
echo "== synth 8 layers"; timeout 60 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -1
echo "== 8 layers resident"; timeout 90 python3 -m ft bench decode --model /tmp/q30-8 --strategies resident --batch 1,4 --tokens 16 --json > $OUT/f-d8-resident.json 2>$OUT/f-d8-resident.err; show $OUT/f-d8-resident.json
echo "== 8 layers offload"; timeout 90 python3 -m ft bench decode --model /tmp/q30-8 --strategies offload,hybrid --moe-cache-rate 0.15 --gpu-memory-limit 4 --batch 1,4 --tokens 16 --json > $OUT/f-d8-offload.json 2>$OUT/f-d8-offload.err; show $OUT/f-d8-offload.json
echo "== profile resident graphs"; timeout 60 python3 scripts/profile_decode.py /tmp/q30-8 resident 2>&1 | grep -E "tok/s|Self CUDA time total|# of Calls" | head -3
timeout 60 python3 scripts/profile_decode.py /tmp/q30-8 offload 2>&1 | grep -E "tok/s unprofiled" | head -2
echo "== peer accelerate, 8 layers"; date -u
timeout 170 python3 -m ft bench decode --model /tmp/q30-8 --strategies offload --moe-cache-rate 0.15 --gpu-memory-limit 4 --batch 1 --tokens 3 --warmup 1 --peer accelerate --json > $OUT/f-d8-peer.json 2>$OUT/f-d8-peer.err; echo "rc=$?"; show $OUT/f-d8-peer.json; tail -2 $OUT/f-d8-peer.err
rm -rf /tmp/q30-8
echo "== synth 48 layers"; date -u; timeout 200 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
echo "== 48 layers"; date -u
timeout 280 python3 -m ft bench decode --model /tmp/q30 --strategies resident,offload,hybrid --moe-cache-rate 0.15 --batch 1 --tokens 16 --warmup 3 --json > $OUT/f-d48.json 2>$OUT/f-d48.err; echo "rc=$?"; show $OUT/f-d48.json
date -u
} 2>&1 | tee $OUT/round_f.log
