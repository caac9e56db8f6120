set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 .gpu_probe/compact.py 2>&1 | grep -v -i warn | tee $OUT/compact.log
timeout 200 python3 benchmarks/gpu_bench.py --out $OUT --impls ours-zero,cce --iters 10 --warmup 2 > $OUT/bench.log 2>&1; echo bench rc $?
grep -A14 '^| shape' $OUT/bench.log
timeout 150 python3 -m pytest -m gpu tests/gpu/test_triton_gpu.py -k "zero" -q -rA -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo tests rc $?
tail -3 $OUT/gpu_tests.log
