# Sourced by the GPU round scripts (round J on): the checked wheels into /tmp/site, the env every
# round runs under, `show FILE` printing one line per result of an `ft bench decode --json`,
# `$OFFLOAD_SWEEP` (offload settings compared in one process) and `record_offload`.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache FT_CUDA_GRAPHS=1
P="--profile profiles/h200-xeon16-measured.json"
show() {
  python3 - "$1" <<'PY'
import json, sys
keys = ("experts_fetched", "experts_prefetched", "prefetch_hits", "cache_misses", "experts_cpu")
for x in json.load(open(sys.argv[1]))["results"]:
    roof = x.get("roofline") or {}
    per_step = {k: round(v, 2) for k, v in (x.get("per_step") or {}).items() if k in keys}
    print(x["strategy"], x["batch"], x.get("error") or "", round(x["tok_s"] or 0, 1),
          roof.get("bound"), round(roof.get("tok_s") or 0, 1), round(x.get("ratio") or 0, 4), per_step)
PY
}
# the 48-layer preset the rounds measure, written fresh (a lent machine's /tmp starts empty)
synth_q30() {
  timeout 200 python3 -m ft model synth --preset qwen3-30b-a3b --out /tmp/q30 2>&1 | tail -1
}
# offload's settings compared in one process (rounds AN2 on): add --batch, --repeats, --variants
OFFLOAD_SWEEP="python3 scripts/bench_sweep.py --model /tmp/q30 --strategy offload --tokens 32 --warmup 4 --cache-rate 0.15 $P"
# `ft bench decode` of offload at b1 and b4 in its own process, for the record, stopped at second
# UNTIL of the round: record_offload NAME UNTIL writes $OUT/NAME.json (and .err) and shows it
record_offload() {
  timeout $(($2 - SECONDS)) python3 -m ft bench decode --model /tmp/q30 --strategies offload \
    --moe-cache-rate 0.15 --batch 1,4 --tokens 32 --warmup 4 $P --json > $OUT/$1.json 2>$OUT/$1.err
  show $OUT/$1.json
}
