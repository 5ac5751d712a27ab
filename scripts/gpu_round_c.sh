#!/usr/bin/env bash
# GPU round C: where an offload decode step's time goes; issue 10's bisect --jobs drill; the demo.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache
{
date -u
echo "== trace offload (8 layers)"; timeout 40 python3 -m ft model synth --preset qwen3-30b-a3b --layers 8 --out /tmp/q30-8 2>&1 | tail -1
timeout 90 python3 -m ft bench decode --model /tmp/q30-8 --strategies resident,offload --moe-cache-rate 0.15 --tokens 8 --warmup 2 --trace /tmp/trace 2>&1 | grep -v INFO | tail -6
head -c 5000 /tmp/trace/offload-b1.ops.txt; echo; head -c 2500 /tmp/trace/resident-b1.ops.txt; echo
echo "== bisect --jobs drill"; date -u; timeout 300 python3 scripts/bisect_jobs_drill.py /tmp/drill --jobs 2 --device cuda 2>&1 | tail -4
cp /tmp/drill/bisect-jobs*.json $OUT/ 2>/dev/null
echo "== demo cuda"; date -u; timeout 130 python3 -m ft demo --device cuda --out /tmp/demo --prompts 1 --max-tokens 16 --repeats 2 --diagnose-prompts 4 --json 2>&1 | tail -5
date -u
} 2>&1 | tee $OUT/round_c.log
