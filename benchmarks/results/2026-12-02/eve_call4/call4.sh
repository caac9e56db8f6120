set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/nvidia-smi.csv
echo "== tests $(date +%T)"
timeout 150 python3 -m pytest -m gpu tests/gpu/test_triton_gpu.py -k zero -q -rA -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo tests rc $?
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_tests.log | tail -8
echo "== ab $(date +%T)"
timeout 150 python3 .gpu_probe/zero_fwd_ab.py 2>&1 | grep -v -i warn | tee $OUT/zero_fwd_ab.log
echo "== bench $(date +%T)"
timeout 200 python3 benchmarks/gpu_bench.py --out $OUT --impls ours-zero,cce --iters 10 --warmup 2 > $OUT/bench.log 2>&1; echo bench rc $?
grep "^|" $OUT/bench.log | head -30
echo "== end $(date +%T)"
