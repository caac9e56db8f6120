set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/nvidia-smi.csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
echo "== compact $(date +%T)"
timeout 130 python3 .gpu_probe/compact2.py 2>&1 | grep -v -i warn | tee $OUT/compact2.log
echo "== compile $(date +%T)"
timeout 330 python3 benchmarks/gpu_compile.py --out $OUT --steps 6 --warmup 3 --profile > $OUT/gpu_compile.log 2>&1; echo compile rc $?
grep -A6 '^| variant' $OUT/gpu_compile.log
echo "== trl_head $(date +%T)"
timeout 110 python3 benchmarks/gpu_trl_head.py --out $OUT --iters 10 --warmup 2 > $OUT/trl_head.log 2>&1; echo trl rc $?
tail -25 $OUT/trl_head.log
echo "== end $(date +%T)"
