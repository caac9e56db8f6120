export PYTHONPATH=$PWD
timeout 300 python3 .gpu_probe/row_ab.py 2>&1 | grep -v Warning | tail -40
cp .gpu_probe/row_ab.py .gpu_probe/beat_stats_kernels.py .gpu_probe/seg_stats_kernels.py $OUT/
timeout 100 python3 -m pytest -q -x tests/gpu/test_token_stats_gpu.py 2>&1 | tail -3
