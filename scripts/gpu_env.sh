# Sourced by the GPU round scripts (round J on): the checked wheels into /tmp/site, the env every
# round runs under, and `show FILE` printing one line per result of an `ft bench decode --json`.
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
