set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 200 python3 .gpu_probe/widths.py 2>&1 | tee $OUT/widths.log | grep -v Warning
mkdir -p $OUT/main $OUT/cgrad
timeout 170 python3 benchmarks/gpu_compile.py --out $OUT/main --variants stock-compiled,fused-compiled,fused-eager --steps 6 --warmup 3 > $OUT/main/log 2>&1; tail -8 $OUT/main/log
PYTHONPATH=$PWD/.gpu_probe/cgrad:$PWD timeout 170 python3 benchmarks/gpu_compile.py --out $OUT/cgrad --variants stock-compiled,fused-compiled --steps 6 --warmup 3 > $OUT/cgrad/log 2>&1; tail -8 $OUT/cgrad/log
