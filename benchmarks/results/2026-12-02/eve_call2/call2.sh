set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/nvidia-smi.csv
echo "== e2e $(date +%T)"
timeout 200 python3 benchmarks/gpu_e2e.py --out $OUT --models gemma3-270m --variants fused+liger,liger_all > $OUT/e2e.log 2>&1; echo e2e rc $?
tail -12 $OUT/e2e.log
echo "== trl_head $(date +%T)"
timeout 230 python3 benchmarks/gpu_trl_head.py --out $OUT --iters 10 --warmup 2 > $OUT/trl_head.log 2>&1; echo trl rc $?
tail -30 $OUT/trl_head.log
echo "== end $(date +%T)"
