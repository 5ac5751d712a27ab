# Round AY2 (after gpu_round_ay.sh, on the same machine: /tmp/q30): hybrid on device gates
# against its host stops and offload, in one process, b1; hybrid's CPU share on and off.
. scripts/gpu_env.sh
test -d /tmp/q30 || synth_q30
timeout $((570 - SECONDS)) python3 scripts/bench_sweep.py --model /tmp/q30 --strategy hybrid \
  --tokens 32 --warmup 4 --cache-rate 0.15 $P --repeats 2 --variants \
  "off:STRATEGY=offload;hyb-stops:;hyb-gates:GATES=1;hyb-gates-f1:GATES=1,FETCH=1.0" \
  | tee $OUT/sweep_ay2.jsonl | cut -c1-200
