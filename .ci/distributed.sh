#!/usr/bin/env bash
# Distributed modes on CPU (`-m distributed`: every test under tests/distributed/): DDP,
# FSDP1/FSDP2, accelerate, Trainer, DeepSpeed ZeRO-2/3, tensor and context parallelism and the
# vocabulary-parallel loss, 2 gloo processes each against one process running stock. Installs
# DeepSpeed (CPU, no compiled ops) into README's .venv first (made here when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/venv.sh
pip install -q --no-build-isolation deepspeed==0.19.8
export OMP_NUM_THREADS=1
python -m pytest -q -n 2 --dist loadscope -m distributed
