#!/usr/bin/env bash
# GPU round A: CUDA tests, bandwidth profile, 8-layer decode figures, then the 48-layer synth.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache
mkdir -p $FT_CACHE_DIR
ft() { python3 -m ft "$@"; }
{
date -u; nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,driver_version --format=csv,noheader
echo "== gpu tests"; timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -6
echo "== bench bw"; timeout 90 python3 -m ft bench bw --out $OUT/benchbw-h200.json 2>&1 | tail -14
cp $OUT/benchbw-h200.json $FT_CACHE_DIR/benchbw.json
echo "== synth 8"; timeout 60 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -2
echo "== decode 8 resident"; timeout 70 python3 -m ft bench decode --model /tmp/q30-8 --strategies resident --batch 1,4 --out $OUT/d8-resident.json 2>&1 | grep -v INFO | tail -12
echo "== decode 8 resident graphs"; FT_CUDA_GRAPHS=1 timeout 70 python3 -m ft bench decode --model /tmp/q30-8 --strategies resident --batch 1,4 --out $OUT/d8-resident-graphs.json 2>&1 | grep -v INFO | tail -12
echo "== decode 8 offload/hybrid/peer"; timeout 130 python3 -m ft bench decode --model /tmp/q30-8 --strategies offload,hybrid --moe-cache-rate 0.15 --gpu-memory-limit 4 --batch 1,4 --peer accelerate --out $OUT/d8-offload.json 2>&1 | grep -v INFO | tail -14
echo "== synth 48"; df -h /tmp | tail -1; timeout 200 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -2; date -u
} 2>&1 | tee $OUT/round_a.log
