#!/usr/bin/env bash
# GPU round AO (run 2026-12-02; FT_GUESS_NEXT_TOKEN was its switch, now what gates always do,
# so its `gates` and `next` variants both guess today): does guessing the next token's
# first MoE layers at the end of the step (FT_GUESS_NEXT_TOKEN=1: the logits' argmax, its
# embedding, the first routers, written for the host, which copies them in while the GPU samples
# and starts the next step) take layer 0's misses and the step's front-loaded copies off b1's
# critical path? On the 8-layer cut on the CPU the guess named 81-87% of the experts layers 0-3
# took that the token before did not (scripts/next_token_guess.py). Gates (the default) against
# gates + the guess, per-layer copies, b1 and b4, and the GPU tests with the switch on.
set -u
source scripts/gpu_env.sh
{
date -u
timeout 120 python3 -m pytest -q -m gpu tests/engine/test_zero_copy.py tests/engine/test_graphs.py 2>&1 | tail -3
[ -f /tmp/q30/config.json ] || { rm -rf /tmp/q30; synth_q30; }
date -u
timeout $((360 - SECONDS)) $OFFLOAD_SWEEP --batch 1 --repeats 3 --by-layer \
  --variants "stop:GATES=0;gates:;next:FT_GUESS_NEXT_TOKEN=1;next_d3:FT_GUESS_NEXT_TOKEN=1,DEPTH=3" \
  2>$OUT/ao_b1.err | tee $OUT/ao_b1.jsonl
date -u
timeout $((480 - SECONDS)) $OFFLOAD_SWEEP --batch 4 --repeats 2 \
  --variants "gates:;next:FT_GUESS_NEXT_TOKEN=1" 2>$OUT/ao_b4.err | tee $OUT/ao_b4.jsonl
date -u
} 2>&1 | tee $OUT/round_ao.log
