nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"
timeout 400 python3 .gpu_probe/dw_tma.py 2>&1 | tail -80
