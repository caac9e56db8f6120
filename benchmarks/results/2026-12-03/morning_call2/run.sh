export PYTHONPATH=$PWD
timeout 150 python3 .gpu_probe/prof_stats.py gemma3-270m,gemma2-2b 2>&1 | grep -v Warning | tail -60
cp .gpu_probe/prof_stats.py $OUT/
timeout 330 python3 -m pytest -q tests/gpu/test_triton_gpu.py -k zero 2>&1 | tail -15
