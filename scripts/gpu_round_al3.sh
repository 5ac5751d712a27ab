#!/usr/bin/env bash
# GPU round AL, third call: the GPU tests of graphs and zero-copy on the code as it lands (the
# host stops' polled read reverted, zero-copy's rows written by the top-k itself).
set -u
source scripts/gpu_env.sh
timeout 200 python3 -m pytest -q -x -m gpu tests/engine/test_graphs.py tests/engine/test_zero_copy.py \
  tests/engine/test_gpu.py 2>&1 | tail -3 | tee $OUT/round_al3.log
