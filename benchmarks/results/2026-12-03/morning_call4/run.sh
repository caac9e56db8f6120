python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/trl-*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m pytest -q -x tests/gpu/test_token_stats_gpu.py 2>&1 | tail -2
# (.gpu_probe/stats_ab.py = ../morning_call1/stats_ab.py, the same script, on the new launch)
timeout 200 python3 .gpu_probe/stats_ab.py 2>&1 | grep -v "stand-in" | tail -8
timeout 260 python3 benchmarks/gpu_trl_head.py --impls trl-sft,trl-logp,trl-grpo,ours-sft,ours-logp,ours-grpo --iters 10 --warmup 2 --out $OUT 2>&1 | tail -45
