#!/usr/bin/env bash
# GPU round H (issue 8): the quantised formats on the H200: kernel correctness on CUDA, the
# bandwidth profile of every format, seed-next in nvfp4 under a 24 GB budget (offload, hybrid),
# and the kernels' speed per format.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache FT_CUDA_GRAPHS=1
show() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(x['strategy'], x['batch'], x.get('error') or '', round(x['tok_s'] or 0, 2), x.get('cache_size'), (x.get('roofline') or {}).get('bound'), round((x.get('roofline') or {}).get('tok_s') or 0, 1), round(x.get('ratio') or 0, 4), {k: round(v, 2) for k, v in (x.get('per_step') or {}).items() if k in ('experts_fetched', 'experts_cpu', 'prefetch_hits', 'cache_misses', 'expert_bytes')}) for x in r['results']]" "$1"; }
{
date -u
echo "== gpu tests (formats)"; timeout 130 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/engine/test_grouped_gpu.py tests/engine/test_formats.py tests/engine/test_graphs.py 2>&1 | tail -3
echo "== bench bw, every format"; date -u
timeout 120 python3 -m ft bench bw --out $OUT/bw-formats.json 2>&1 | grep -v INFO | tail -12
echo "== synth seed-next nvfp4, 4 layers"; date -u
timeout 180 python3 -m ft model synth --preset seed-next --layers 4 --expert-format nvfp4 --out /tmp/sn4 2>&1 | tail -1; du -sh /tmp/sn4
echo "== decode seed-next nvfp4, --gpu-memory-limit 24"; date -u
timeout 110 python3 -m ft bench decode --model /tmp/sn4 --strategies offload,hybrid --moe-cache-rate 0.152 --gpu-memory-limit 24 --batch 1 --tokens 16 --warmup 3 --profile $OUT/bw-formats.json --json > $OUT/h-sn4.json 2>$OUT/h-sn4.err; show $OUT/h-sn4.json; grep -E "MoE experts|executor ready|fetching" $OUT/h-sn4.err | head -4
echo "== kernels"; date -u
timeout 50 python3 scripts/bench_moe_kernels.py > $OUT/kernels.jsonl 2>&1; tail -20 $OUT/kernels.jsonl | cut -c1-300
date -u
} 2>&1 | tee $OUT/round_h.log
