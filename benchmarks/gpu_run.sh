#!/usr/bin/env bash
# Steps of one device call (BENCHMARKS.md shows what the runs measured). Usage, from the repo root
# on the GPU machine, with the peers' wheels carried in .whl/:
#   bash benchmarks/gpu_run.sh STEP[:SECONDS] ...
# Steps: variants | tests[=PATHS] | bench[=IMPLS[@SHAPES]] | e2e | script=NAME[@ARGS] | dist[=PATHS]
#   dist runs tests/distributed (or PATHS) on 2 GPUs with NCCL (FUSED_CE_DIST_DEVICE=cuda)
#   script=NAME runs benchmarks/NAME.py --out $OUT [ARGS, split at spaces: quote the step, e.g.
#   'script=gpu_compile_ab@--modes compiled --batch 4:300'], log appended to $OUT/NAME.log
# Every step's log and result files go to $OUT; a step over its time is stopped, the next runs.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=$PWD
# setuptools / wheel wheels, if carried, only serve the sdist build below (kept off PYTHONPATH).
tools=$(ls .whl/setuptools-*.whl .whl/wheel-*.whl 2>/dev/null)
runtime=$(ls .whl/*.whl 2>/dev/null | grep -v -e '/setuptools-' -e '/wheel-')
if [ -n "$runtime" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $runtime || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
# DeepSpeed is an sdist: built here without its CUDA ops (DS_BUILD_OPS=0, pure Python).
if ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
  [ -n "$tools" ] && python3 -m pip install -q --no-index --no-deps --no-cache-dir \
    --target /tmp/buildtools $tools
  if PYTHONPATH=/tmp/buildtools:$PYTHONPATH DS_BUILD_OPS=0 timeout 90 python3 -m pip install \
      -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
      --target /tmp/site-ds .whl/deepspeed-*.tar.gz > "$OUT/deepspeed_build.log" 2>&1; then
    export PYTHONPATH=$PYTHONPATH:/tmp/site-ds
  else
    echo "deepspeed build failed: see $OUT/deepspeed_build.log"; tail -n 20 "$OUT/deepspeed_build.log"
  fi
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  > "$OUT/nvidia-smi.csv" 2>&1
for spec in "$@"; do
  step=${spec%%:*}; secs=${spec#*:}; [ "$secs" = "$spec" ] && secs=300
  name=${step%%=*}; arg=${step#*=}; [ "$arg" = "$step" ] && arg=""
  echo "=== $name ($arg) for at most ${secs}s: $(date +%T)"
  case $name in
    variants) timeout "$secs" python3 benchmarks/gpu_variants.py --out "$OUT" \
                > "$OUT/variants.log" 2>&1 ;;
    tests)    timeout "$secs" python3 -m pytest -m gpu ${arg:-tests/gpu} -q -rA -p no:cacheprovider \
                > "$OUT/gpu_tests.log" 2>&1 ;;
    bench)    impls=${arg%%@*}; shapes=${arg#*@}; [ "$shapes" = "$arg" ] && shapes=""
              timeout "$secs" python3 benchmarks/gpu_bench.py --out "$OUT" \
                ${impls:+--impls "$impls"} ${shapes:+--shapes "$shapes"} \
                > "$OUT/bench.log" 2>&1 ;;
    e2e)      timeout "$secs" python3 benchmarks/gpu_e2e.py --out "$OUT" \
                > "$OUT/e2e.log" 2>&1 ;;
    script)   sname=${arg%%@*}; sargs=${arg#*@}; [ "$sargs" = "$arg" ] && sargs=""
              timeout "$secs" python3 "benchmarks/$sname.py" --out "$OUT" $sargs \
                >> "$OUT/$sname.log" 2>&1 ;;
    dist)     FUSED_CE_DIST_DEVICE=cuda timeout "$secs" python3 -m pytest ${arg:-tests/distributed} \
                -q -rA -p no:cacheprovider > "$OUT/dist_tests.log" 2>&1 ;;
    *) echo "unknown step $name" ;;
  esac
  echo "=== $name exit $?: $(date +%T)"
done
for f in "$OUT"/*.log; do echo "----- tail $f"; tail -n 25 "$f"; done
