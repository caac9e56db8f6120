set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/nvidia-smi.csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
echo "== tests $(date +%T)"
timeout 150 python3 -m pytest -m gpu tests/gpu/test_compile_gpu.py tests/gpu/test_liger_gpu.py -q -rA -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo tests rc $?
grep -E "passed|failed|PASSED|FAILED|ERROR" $OUT/gpu_tests.log | tail -30
echo "== compile $(date +%T)"
timeout 380 python3 benchmarks/gpu_compile.py --out $OUT --variants stock-compiled,fused-compiled,fused-eager --steps 8 --warmup 3 --profile > $OUT/gpu_compile.log 2>&1; echo compile rc $?
grep -A6 '^| variant' $OUT/gpu_compile.log
grep -h -A3 "idle" $OUT/profile_*.txt 2>/dev/null | head -20
echo "== end $(date +%T)"
