set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
python3 --version; python3 -c "import trl.kernels" 2>&1 | tail -4
echo "== tests $(date +%T)"
timeout 120 python3 -m pytest -m gpu tests/gpu/test_triton_gpu.py -k "zero" -q -rA -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo tests rc $?
tail -3 $OUT/gpu_tests.log
echo "== align $(date +%T)"
timeout 150 python3 .gpu_probe/align_ab.py 2>&1 | grep -v -i warn | tee $OUT/align_ab.log
echo "== bench $(date +%T)"
timeout 300 python3 benchmarks/gpu_bench.py --out $OUT --impls ours-chunked,ours-zero,liger,cce,cce-compile,trl-head,cublas-3gemm --iters 10 --warmup 2 > $OUT/bench.log 2>&1; echo bench rc $?
grep -B2 -A60 '^| shape' $OUT/bench.log | head -90
echo "== end $(date +%T)"
