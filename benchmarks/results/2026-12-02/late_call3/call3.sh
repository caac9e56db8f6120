python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/cut_cross_entropy-*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 400 python benchmarks/gpu_bench.py --impls ours-zero,cce --iters 10 --warmup 2 --out $OUT 2>&1 | tee $OUT/bench.log
