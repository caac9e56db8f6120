set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
python3 -c "
import torch; from fused_ce_patch.backends.triton import zero_logits_inplace as z
print({n: z.chunk_cols(n, torch.device('cuda')) for n in (8192, 32768)})"
timeout 300 python3 benchmarks/gpu_bench.py --out $OUT --impls ours-zero,cce --iters 10 --warmup 2 > $OUT/bench.log 2>&1; echo bench rc $?
grep -v -i warn $OUT/bench.log | tail -30
timeout 200 python3 -m pytest -m gpu tests/gpu/test_triton_gpu.py -k "zero" -q -rA -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo tests rc $?
tail -5 $OUT/gpu_tests.log
