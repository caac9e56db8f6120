python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
grep -c "_quotient_dtype" fused_ce_patch/hf/forward.py
timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_compile_gpu.py tests/gpu/test_liger_gpu.py tests/gpu/test_architectures_gpu.py tests/gpu/test_stock_semantics_gpu.py -p no:cacheprovider 2>&1 | tail -3
