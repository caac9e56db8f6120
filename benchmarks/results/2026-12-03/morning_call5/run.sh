python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/trl-*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m pytest -q -x tests/gpu/test_token_stats_gpu.py 2>&1 | tail -2
timeout 150 python3 .gpu_probe/stats_ab2.py 2>&1 | grep -v "stand-in" | tail -6
cp .gpu_probe/stats_ab2.py $OUT/
timeout 250 python3 benchmarks/gpu_trl_head.py --impls trl-sft,trl-logp,trl-grpo,ours-sft,ours-logp,ours-grpo --iters 10 --warmup 2 --out $OUT 2>&1 | tail -32
timeout 90 python3 .gpu_probe/dw_rows.py 2>&1 | tail -30
cp .gpu_probe/dw_rows.py $OUT/
