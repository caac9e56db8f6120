set -x
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/trl-*.whl .whl/cut_cross_entropy-*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -x tests/gpu/test_token_stats_gpu.py 2>&1 | tail -15
timeout 250 python3 .gpu_probe/stats_ab.py 2>&1 | tail -30
cp .gpu_probe/*.py $OUT/ 2>/dev/null
timeout 120 python3 -m pytest -q tests/gpu/test_triton_gpu.py -k zero 2>&1 | tail -15
