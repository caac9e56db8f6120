python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
date -u
timeout 300 python3 benchmarks/gpu_bench.py --shapes llama3-8b-long,gemma3-270m \
  --impls ours-chunked,ours-zero,torch-compile,liger,cce,cce-compile,trl-head,cublas-3gemm \
  --iters 10 --warmup 2 --out $OUT --tag gpu_bench_32k 2>&1 | grep "^|" | tail -20
date -u
timeout 230 python3 benchmarks/gpu_trl_head.py --impls trl-sft,trl-logp,trl-grpo,ours-sft,ours-logp,ours-grpo --iters 10 --warmup 2 --out $OUT 2>&1 | grep -v stand-in | tail -16
date -u
