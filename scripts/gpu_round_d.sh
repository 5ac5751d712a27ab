#!/usr/bin/env bash
# GPU round D: issue 10's bisect --jobs drill on one GPU, then the demo on CUDA.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache
{
echo "== bisect --jobs drill"; date -u; timeout 230 python3 scripts/bisect_jobs_drill.py /tmp/drill --jobs 2 --device cuda 2>&1 | tail -4
cp /tmp/drill/bisect-jobs*.json $OUT/ 2>/dev/null
echo "== demo cuda"; date -u; timeout 140 python3 -m ft demo --device cuda --out /tmp/demo --prompts 1 --max-tokens 16 --repeats 2 --diagnose-prompts 4 --json 2>&1 | tail -4
cp /tmp/demo/summary.md $OUT/demo-summary.md 2>/dev/null
date -u
} 2>&1 | tee $OUT/round_d.log
