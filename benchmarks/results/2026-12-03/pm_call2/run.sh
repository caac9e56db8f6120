python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
git log --oneline -1 2>/dev/null
timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_compile_gpu.py tests/gpu/test_liger_gpu.py tests/gpu/test_architectures_gpu.py tests/gpu/test_stock_semantics_gpu.py -p no:cacheprovider 2>&1 | tail -6
timeout 200 python3 benchmarks/gpu_compile.py --variants stock-compiled,fused-compiled --steps 6 --warmup 3 2>&1 | tail -8
