python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 330 python3 benchmarks/results/2026-12-03/pm_call1/rowblk.py gemma3-270m,gemma2-2b,llama3-8b-long,qwen2.5-7b 2>&1 | tail -20
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_triton_gpu.py -k zero -x 2>&1 | tail -5
