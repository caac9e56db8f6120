nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; export PYTHONPATH=$PWD; timeout 300 python3 .gpu_probe/budget_gemms.py 2>&1 | tail -20
