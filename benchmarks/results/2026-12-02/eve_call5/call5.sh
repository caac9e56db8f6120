set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
echo "== tests $(date +%T)"
timeout 170 python3 -m pytest -m gpu tests/gpu/test_compile_gpu.py tests/gpu/test_triton_gpu.py -k "compile or functional or zero" -q -rA -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo tests rc $?
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | tail -6
echo "== bench $(date +%T)"
timeout 100 python3 benchmarks/gpu_bench.py --out $OUT --impls ours-zero,cce --shapes gemma3-270m --iters 10 --warmup 2 > $OUT/bench.log 2>&1; echo bench rc $?
grep "^|" $OUT/bench.log | head -8
echo "== end $(date +%T)"
