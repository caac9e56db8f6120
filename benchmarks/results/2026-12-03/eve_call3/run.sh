python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 540 python3 benchmarks/gpu_bench.py --shapes llama3-8b,gemma2-2b,qwen2.5-7b,llama2-7b \
  --impls ours-chunked,ours-zero,torch-compile,liger,cce,cce-compile,trl-head,cublas-3gemm \
  --iters 10 --warmup 2 --out $OUT --tag gpu_bench_8k 2>&1 | grep -v "^{" | tail -45
date -u
