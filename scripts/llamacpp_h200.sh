#!/bin/bash
# ft beside llama.cpp on the GPU box, in one device call or two of < 10 minutes each:
#   bash scripts/llamacpp_h200.sh build    CUDA build of llama-bench + llama-quantize (sm_90),
#                                          binaries back under $OUT as llamacpp-bin.tar.xz.*
#   bash scripts/llamacpp_h200.sh measure  synth + convert + check + `ft bench llamacpp`,
#                                          the table back under $OUT/llamacpp/
#   FA=OFF bash scripts/llamacpp_h200.sh all   both in one call: the build without the
#                                          flash-attention kernels took 256 s on the H100 box
#                                          (16 cores, beside the GPU tests), leaving ~5 minutes
# Inputs in .dev/ (ignored; name .dev in the call's carry): llama.cpp-src.tar.xz (from
# shared/peers), for `measure` also the llamacpp-bin.tar.xz.* parts that `build` returned.
# INT8=1 adds ft int8 beside llama.cpp Q8_0 (a second synth and ~3 more minutes: run it when
# the bf16 call's stamps leave room, or as a third call).
# LAYERS (default 8) cuts qwen3-30b-a3b to fit the box's 64 GB disk beside its GGUFs; BUDGET
# (GiB) keeps the full model's share of expert bytes on the GPU: at 24 GiB the 48-layer model
# has 24 - 1 margin - 2.87 dense = 20.1 of 54 GiB of experts (37%) on the GPU; the 8-layer cut
# has 1.44 GiB dense and 9 GiB of experts, so 1 + 1.44 + 0.37 * 9 = 5.8 GiB.
# The build is estimated at 6-8 minutes on 16 cores (ggml-cuda's ~160 .cu files for sm_90 are
# most of it); should it pass its 500 s, FA=OFF leaves out the flash-attention kernels (~80
# files; at 64 tokens of context attention is a negligible share of a decode step).
set -u
STEP=${1:-}
case "$STEP" in build|measure|all) ;; *) echo "error: the step is build, measure or all, not '$STEP'"; exit 1;; esac
[ -f .dev/llama.cpp-src.tar.xz ] || { echo "error: copy shared/peers/llama.cpp-src.tar.xz to .dev/ and carry .dev"; exit 1; }
LLAMA=/tmp/llama.cpp  # the same path in both calls: the binaries' rpath points into it
PRESET=${PRESET:-qwen3-30b-a3b}  # PRESET=tiny DEVICE=cpu BUDGET=2: a dry run of `measure` on a CPU
DEVICE=${DEVICE:-cuda}
LAYERS=${LAYERS:-8}
BUDGET=${BUDGET:-5.8}
FA=${FA:-ON}
T0=$(date +%s); stamp() { echo "== $(($(date +%s) - T0)) s: $*"; }
mkdir -p "$LLAMA" && tar xJf .dev/llama.cpp-src.tar.xz -C /tmp || exit 1

if [ "$STEP" != measure ]; then
  stamp configure
  cmake -S $LLAMA -B $LLAMA/build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_CUDA_FA=$FA -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF > /tmp/cmake.log 2>&1 || { tail -20 /tmp/cmake.log; exit 1; }
  stamp build
  timeout 500 cmake --build $LLAMA/build -j16 --target llama-bench llama-quantize \
    > /tmp/build.log 2>&1; rc=$?
  tail -3 /tmp/build.log
  stamp "build exit $rc"
  [ $rc = 0 ] || exit $rc
  $LLAMA/build/bin/llama-bench --list-devices 2>&1 | tail -3
fi
if [ "$STEP" = build ]; then
  # the binaries, their shared libraries and the cache that names the source tree; what comes
  # back is at most 8 files of 16 MiB, and the parts travel again in the next call's 64 MiB
  strip --strip-unneeded $LLAMA/build/bin/llama-* $LLAMA/build/bin/lib*.so* 2>/dev/null
  du -sh $LLAMA/build/bin
  tar cf - -C $LLAMA build/bin build/CMakeCache.txt | xz -T16 -6 | split -b 15M - $OUT/llamacpp-bin.tar.xz.
  ls -la $OUT; du -sh $OUT; stamp end
  exit 0
fi

[ "$STEP" = all ] || { cat .dev/llamacpp-bin.tar.xz.* | xz -d | tar xf - -C $LLAMA || exit 1; }
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH FT_CACHE_DIR=/tmp/ftcache PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null; df -h /tmp | tail -1
# hybrid's auto fetch fraction comes from the GPU box's profile with the current CPU pool
mkdir -p $FT_CACHE_DIR && cp ${PROFILE:-profiles/h100-xeon16-measured.json} $FT_CACHE_DIR/benchbw.json
stamp synth
python3 -m ft model synth --preset "$PRESET" --layers "$LAYERS" --out /tmp/q-bf16 | tail -1
INT8_FLAG=()
if [ "${INT8:-0}" = 1 ]; then
  python3 -m ft model synth --preset "$PRESET" --layers "$LAYERS" --expert-format int8 \
    --out /tmp/q-int8 | tail -1
  INT8_FLAG=(--int8-model /tmp/q-int8)
fi
stamp measure
mkdir -p "$OUT/llamacpp"
# what is left of a 600 s call, less a margin: a run stopped early keeps the rows it measured
timeout $((570 - $(date +%s) + T0)) python3 -m ft bench llamacpp --build $LLAMA/build --model /tmp/q-bf16 \
  "${INT8_FLAG[@]}" --gpu-memory-limit "$BUDGET" --device "$DEVICE" --gguf-dir /tmp/gguf \
  --out "$OUT/llamacpp" 2>&1 | tee "$OUT/llamacpp/log.txt"
stamp end
