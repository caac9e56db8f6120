export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 python .gpu_probe/grad_tma_ab.py 2>&1 | tee $OUT/grad_tma_ab.log
timeout 200 python -m pytest -x -q tests/gpu/test_triton_gpu.py -k zero 2>&1 | tail -15 | tee $OUT/tests.log
