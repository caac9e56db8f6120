set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/zero $OUT/gemma3
echo "== zero $(date +%T)"
timeout 170 python3 benchmarks/gpu_bench.py --out $OUT/zero --impls ours-zero,cce --iters 10 --warmup 2 > $OUT/zero/bench.log 2>&1; echo rc $?
grep -E "^[a-z0-9.-]+ +(ours|cce)" $OUT/zero/bench.log
echo "== gemma3 $(date +%T)"
timeout 110 python3 benchmarks/gpu_bench.py --out $OUT/gemma3 --shapes gemma3-270m --impls ours-chunked,liger,cce-compile,cublas-3gemm --iters 10 --warmup 2 > $OUT/gemma3/bench.log 2>&1; echo rc $?
grep -E "^[a-z0-9.-]+ +(ours|cce|liger|cublas)" $OUT/gemma3/bench.log
echo "== end $(date +%T)"
