# Round AZ: the CPU MoE pool with each bf16 task one compiled call (cpu_kernels.bf16_ffn_block:
# the GIL released once a task) at 1, 4 and 15 threads; then hybrid on gates with the pool
# native (auto) and compiled, against offload and hybrid's host stops, in one process, b1.
. scripts/gpu_env.sh
python3 scripts/bench_cpu_pool.py --threads 1,4,15 --experts 192 --iters 24 | tee $OUT/pool_az.jsonl
test -d /tmp/q30 || synth_q30
timeout $((580 - SECONDS)) python3 scripts/bench_sweep.py --model /tmp/q30 --strategy hybrid \
  --tokens 32 --warmup 4 --cache-rate 0.15 $P --repeats 2 --variants \
  "off:STRATEGY=offload;hyb-gates:GATES=1;hyb-gates-c:GATES=1,FT_CPU_MOE_COMPUTE=compiled;hyb-gates-c-f1:GATES=1,FETCH=1.0,FT_CPU_MOE_COMPUTE=compiled" \
  | tee $OUT/sweep_az.jsonl | cut -c1-200
