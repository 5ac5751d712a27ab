# Round AY: (1) where the CPU MoE pool's bf16 time goes on the H200 box's 16-core Xeon:
# memory bandwidth, whole experts per thread, and the pool's submits, the previous commit's
# pool (one phase, blocks of I; a copy of its ft/ at $1) against the two-phase pool (blocks of
# I, then of D; measured slower at 8 experts, not landed); (2) the GPU tests of hybrid on
# device gates and of the zero-copy/gates cache; (3) the 48-layer preset written for the sweep
# that follows (scripts/gpu_round_ay2.sh).
# bash scripts/gpu_round_ay.sh OLD_DIR
. scripts/gpu_env.sh
lscpu | grep -E "Model name|Socket|NUMA node|L3|Thread|Core"
for tree in ${1:-old} .; do
  echo "== $tree"
  (cd $tree && PYTHONPATH=$PWD:/tmp/site python3 $OLDPWD/scripts/bench_cpu_pool.py \
    --threads ${THREADS:-1,15} --experts 192 --iters 24) | tee -a $OUT/pool_$(basename $(realpath $tree)).jsonl
done
timeout 200 python3 -m pytest -q -x -m gpu tests/engine/test_hybrid.py tests/engine/test_zero_copy.py 2>&1 | tail -15
synth_q30
